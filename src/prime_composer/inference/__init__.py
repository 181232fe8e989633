"""OpenAI-compatible inference serving with live weight updates.

``backend.py`` is the contract every backend honours and the registry by ``inference.backend``:
``hf/`` (the embedded transformers server, CPU or GPU) and ``vllm/`` (vLLM's server, extended).
Shared by both: the OpenAI API layer (``protocol.py`` schemas, ``preprocess.py`` prompts,
``tools.py`` tool plans, ``openai_routes.py`` over a ``requests.Decoder``), the request guard
(``guard.py``, ``auth.py``), the weight routes (``weight_updates.py``, ``weight_paths.py``) and
serving inside this process (``local.py``).
"""

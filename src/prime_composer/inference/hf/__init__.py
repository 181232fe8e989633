"""The ``hf`` inference backend: an embedded transformers server (CPU or GPU).

- ``engine``: the decode loop (continuous batching, a per-sequence KV cache ``kv_cache``, GQA
  attention ``attention``, the packed output head ``output_head``, sampling and processed logprobs
  ``sampling``, incremental detokenizing ``detokenize``, weight swaps between iterations
  ``weight_swap``: whole weights or a LoRA adapter merged onto the base);
- ``loading``: the model and tokenizer from ``model.name``;
- ``server``: the FastAPI app around the engine (the shared OpenAI routes, ``/health``,
  ``/metrics``, ``/update_weights``, ``/reload_weights``) and ``serve``;
- ``backend``: ``HFBackend``, registered as ``inference.backend = "hf"``.
"""

"""Streaming DiLoCo across data centers: the outer loop the trainer calls after inner steps.

``base.py`` holds the contracts: ``OuterLoop`` (all the trainer calls), ``Store`` and the
registry of backends by ``diloco.backend``. The ``shardcast`` backend (``loop.py``) is built
from the fragment schedule (``schedule.py``), fragments (``fragments.py``), quantization
(``quantize.py``), the outer optimizer (``outer_optim.py``), signed payloads (``payload.py``) and
the round protocol (``exchange.py``) over a shardcast store (``shardcast_store.py``); the
``torchft`` backend is ``torchft_backend.py``. Both write the checkpoint part of ``part.py``.
"""

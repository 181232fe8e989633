"""Streaming DiLoCo across data centers: the outer loop the trainer calls after inner steps.

``OuterLoop`` (``loop.py``) is the whole interface; the pieces are the fragment schedule
(``schedule.py``), fragments (``fragments.py``), quantization (``quantize.py``), the outer
optimizer (``outer_optim.py``), signed payloads (``payload.py``), the round protocol
(``exchange.py``) over a shardcast store (``shardcast_store.py``), and the torchft backend
(``torchft_backend.py``).
"""

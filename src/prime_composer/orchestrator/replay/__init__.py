"""The replay channel on the orchestrator side: DPO pairs from the teacher service's store mixed
into every batch (``source.py``; ``channel.py`` is the channel's orchestrator part) and packed into the ``replay`` group
(``packing.py``); the trainer's term is ``trainer/losses/replay_term.py``."""

"""The built-in channels, one module each: ``rl.py``, ``sdpo.py``, ``replay.py``. Each registers
its ``ChannelSpec`` (``config/channels.py``: what a channel is, and the registry)."""

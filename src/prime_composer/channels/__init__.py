"""Channels: each source of training signal (RL, SDPO, replay, a plugin) as one registered
``ChannelSpec`` (``spec.py``); the built-in ones are ``rl.py``, ``sdpo.py`` and ``replay.py``.
``sections.py`` lets a plugin channel bring its own config sections."""

from prime_composer.channels.spec import (
    ChannelSpec,
    Column,
    Pairing,
    channel,
    channels,
    register_channel,
    unregister_channel,
)

__all__ = [
    "ChannelSpec",
    "Column",
    "Pairing",
    "channel",
    "channels",
    "register_channel",
    "unregister_channel",
]

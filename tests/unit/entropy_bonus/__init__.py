"""A toy fourth channel, as a plugin: an entropy bonus on the tokens of failed rollouts.

It touches no file of the package. Its four modules are what any channel brings:

- ``spec.py``: the ``ChannelSpec`` and both config sections (torch-free, what ``config/`` sees);
- ``group.py``: the ``entropy_bonus`` batch group (a token mask on the core rows);
- ``orchestrator.py``: its orchestrator part, which picks the samples, and its group packer;
- ``term.py``: its loss term, ``-mean entropy`` over the group's tokens, with gradient.

The test registers ``spec.SPEC`` with ``register_channel`` (a package would do it on import, or
through an entry point in the ``prime_composer.channels`` group) and unregisters it after.
"""

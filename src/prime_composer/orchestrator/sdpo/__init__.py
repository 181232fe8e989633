"""SDPO on the orchestrator side: which failed rollouts get a hint, where the hint text comes from,
how the hinted teacher context is rendered, and how it is packed beside its student.

- ``channel.py``: the channel's orchestrator part (``channels/sdpo.py`` builds it);
- ``target.py``: ``SDPOTarget``, kept in ``Sample.channels["sdpo"]``;
- ``hints.py``: ``HintBuilder`` picks targets and writes them (the target span and the teacher
  prefix);
- ``sources.py``: hint texts (a successful sibling, environment feedback, templates, an LLM);
- ``render.py``: re-rendering the conversation with the hint through the policy's chat template;
- ``packing.py``: the ``sdpo`` batch group (teacher rows aligned with the student tokens).
"""

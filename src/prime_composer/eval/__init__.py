"""``eval``: a checkpoint on the environments' eval splits, outside of training (``main.py``)."""

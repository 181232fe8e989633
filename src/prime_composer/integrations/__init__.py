"""Bridges to other training frameworks; each module imports its framework only when it is used
(``trl.py``: our channels inside a TRL ``GRPOTrainer``). Nothing in the project imports this package."""

"""PRIME-RL compatibility: its config files and flags read in this project's names.

    names.py    ``PrimeRLNames``: the translator ``rl``/``eval`` read configs through
    rules.py    the table of PRIME-RL's keys and what each becomes here
    migrate.py  ``rl migrate prime-rl.toml``: print a PRIME-RL config in this project's names

Above ``config/``: the config layer reaches the translator by name through its dialect registry
(``config.resolve.DIALECTS``), so nothing in ``config/`` imports this package.
"""

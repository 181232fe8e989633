"""Pydantic configs for every process and the ``@ file.toml`` command line. Imports no torch."""

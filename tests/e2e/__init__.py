"""End-to-end tests: the real launcher and processes on a tiny model."""

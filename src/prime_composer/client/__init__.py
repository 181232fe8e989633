"""Calling endpoints this process does not own (see ``http.py``)."""

from prime_composer.client.http import CallError, CallResult, EndpointClient, read_api_key, redact_url

__all__ = ["CallError", "CallResult", "EndpointClient", "read_api_key", "redact_url"]

"""``uv run inference`` serves through the backend registry: the process names no backend, so a
backend registered under a literal is the one that serves (here a stand-in put in place of each)."""

from __future__ import annotations

from typing import get_args

import pytest

import prime_composer.inference.main as inference_main
from prime_composer.config.inference import InferenceBackendName, InferenceConfig
from prime_composer.inference.backend import BACKENDS


class _Recorder:
    def __init__(self, name: str) -> None:
        self.name = name
        self.served: list[InferenceConfig] = []

    def serve(self, config: InferenceConfig) -> None:
        self.served.append(config)


@pytest.mark.parametrize("name", get_args(InferenceBackendName))
def test_the_registered_backend_serves(name: InferenceBackendName, monkeypatch: pytest.MonkeyPatch) -> None:
    BACKENDS.get_or_load(name)  # the real one registered first, then replaced for this test
    standins = {n: _Recorder(n) for n in get_args(InferenceBackendName)}
    for n, standin in standins.items():
        monkeypatch.setitem(BACKENDS._entries, n, standin)
    monkeypatch.setattr(inference_main, "setup_logging", lambda process: None)
    config = InferenceConfig(backend=name)
    assert inference_main.run(config) == 0
    assert [len(s.served) for n, s in sorted(standins.items())] == [int(n == name) for n in sorted(standins)]
    assert standins[name].served == [config]

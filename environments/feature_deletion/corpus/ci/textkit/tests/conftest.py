import pytest


@pytest.fixture
def sentence():
    return "The quick brown fox jumps over the lazy dog; the dog sleeps."

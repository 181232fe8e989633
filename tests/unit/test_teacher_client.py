"""The one module the orchestrator imports of the teacher package (``teacher/client.py``): pairs
read through the reader generated from ``Pair``'s fields, against the store's own schema."""

from __future__ import annotations

import ast
import json
import sqlite3
from pathlib import Path

import pytest

from prime_composer.teacher.client import Pair, TeacherClient
from prime_composer.teacher.pairs import PAIR_FIELDS, PairStoreError
from prime_composer.teacher.store import SCHEMA

SRC = Path(__file__).resolve().parents[2] / "src" / "prime_composer"


def _store(path: Path, schema: str = SCHEMA) -> sqlite3.Connection:
    conn = sqlite3.connect(path)
    conn.executescript(schema)
    return conn


def test_every_pair_field_is_a_column_of_the_store_schema(tmp_path: Path) -> None:
    conn = _store(tmp_path / "s.sqlite")
    columns = {row[1] for row in conn.execute("PRAGMA table_info(pairs)")}
    assert set(PAIR_FIELDS) <= columns and len(PAIR_FIELDS) == 18


def test_a_pair_written_by_hand_reads_back_field_for_field(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite"
    conn = _store(path)
    row = {
        "cursor": 7, "status": "ready", "trace_id": "t-1", "turn_index": 3, "state_hash": "h",
        "chosen_key": "c", "rejected_key": "r", "context_messages": "[]", "chosen_text": "5",
        "rejected_text": "6", "context_ids": "[1, 2]", "chosen_ids": "[3]", "rejected_ids": "[4, 9]",
        "ref_chosen_logprobs": "[-0.5]", "ref_rejected_logprobs": "[-1.0, -2.0]",
        "reference_model": "m", "chosen_source": "teacher", "label_smoothing": 0.25,
        "vote_share": 0.75, "margin": 0.5, "process_reward": -0.5,
        "provenance": json.dumps({"teachers": ["a"]}), "created_at": 0.0,
    }  # fmt: skip
    conn.execute(
        f"INSERT INTO pairs ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})", list(row.values())
    )
    conn.execute(
        f"INSERT INTO pairs ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
        [*{**row, "cursor": None, "status": "pending", "state_hash": "h2"}.values()],
    )
    conn.commit()
    client = TeacherClient(path)
    (pair,) = client.take_pairs(10)
    assert pair == Pair(
        cursor=7, trace_id="t-1", turn_index=3, state_hash="h", context_ids=[1, 2], chosen_ids=[3],
        rejected_ids=[4, 9], ref_chosen_logprobs=[-0.5], ref_rejected_logprobs=[-1.0, -2.0],
        label_smoothing=0.25, vote_share=0.75, margin=0.5, process_reward=-0.5, chosen_source="teacher",
        chosen_text="5", rejected_text="6", reference_model="m", provenance={"teachers": ["a"]},
    )  # fmt: skip
    assert pair.ref_rejected_logp == -3.0 and client.take_pairs(10, after_cursor=7) == []
    client.store.close()


def test_a_store_without_a_pair_column_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    _store(path, SCHEMA.replace("    margin REAL NOT NULL,\n", "")).close()
    with pytest.raises(PairStoreError, match=r"old\.sqlite: the pairs table has no column margin"):
        TeacherClient(path).take_pairs(1)


def test_before_the_service_made_its_store_there_is_nothing_to_take(tmp_path: Path) -> None:
    assert TeacherClient(tmp_path / "missing.sqlite").take_pairs(4) == []


def test_the_orchestrator_imports_only_the_teacher_client() -> None:
    imported = set()
    for path in (SRC / "orchestrator").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.startswith("prime_composer.teacher")
            ):
                imported.add(node.module)
            elif isinstance(node, ast.Import):
                imported.update(a.name for a in node.names if a.name.startswith("prime_composer.teacher"))
    assert imported == {"prime_composer.teacher.client"}

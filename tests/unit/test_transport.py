"""Micro-batch byte format, and filesystem / zmq round trips between threads."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from prime_composer.config.ports import free_port
from prime_composer.config.transport import TransportConfig
from prime_composer.integrity import IntegrityError
from prime_composer.orchestrator.packing import pack_step
from prime_composer.orchestrator.sample import Sample
from prime_composer.transport.batch import BatchFormatError, MicroBatch, decode_rank_batch, encode_rank_batch
from prime_composer.transport.factory import make_receiver, make_sender
from prime_composer.transport.filesystem import FilesystemReceiver, FilesystemSender, rank_path


def make_step(seed: int, num_ranks: int = 2) -> list[list[MicroBatch]]:
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(6):
        num_prompt, num_completion = (
            int(torch.randint(1, 5, (1,), generator=g)),
            int(torch.randint(1, 6, (1,), generator=g)),
        )
        samples.append(
            Sample(
                prompt_ids=torch.randint(1, 50, (num_prompt,), generator=g).tolist(),
                completion_ids=torch.randint(1, 50, (num_completion,), generator=g).tolist(),
                completion_logprobs=(-torch.rand(num_completion, generator=g)).tolist(),
                completion_mask=[1] * num_completion,
                reward=float(i % 2),
                example_id=i // 2,
                group_id=i // 2,
                policy_step=0,
                advantage=float(torch.randn(1, generator=g)),
            )
        )
    rank_batches, _ = pack_step(samples, seq_len=12, micro_batch_size=1, num_ranks=num_ranks, pad_token_id=0)
    return rank_batches


def assert_same(a: list[MicroBatch], b: list[MicroBatch]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.temperature == y.temperature and x.groups.keys() == y.groups.keys()
        for name, tensor in x.core_tensors().items():
            other = y.core_tensors()[name]
            assert other.dtype == tensor.dtype and torch.equal(other, tensor), name


def test_bytes_round_trip() -> None:
    micro_batches = make_step(0)[0]
    data = encode_rank_batch(5, 0, micro_batches)
    assert b"pickle" not in data[:200] and data[8:9] == b"{"  # a safetensors JSON header
    step, rank, decoded = decode_rank_batch(data)
    assert (step, rank) == (5, 0)
    assert_same(micro_batches, decoded)


def test_micro_batch_rejects_wrong_dtype() -> None:
    mb = make_step(0)[0][0]
    with pytest.raises(BatchFormatError, match="loss_mask"):
        MicroBatch(**{**mb.core_tensors(), "loss_mask": mb.loss_mask.long()})


def test_micro_batch_rejects_non_finite_values() -> None:
    mb = make_step(0)[0][0]
    advantages = mb.advantages.clone()
    advantages[0, 0] = float("nan")
    with pytest.raises(BatchFormatError, match="advantages holds non-finite"):
        MicroBatch(**{**mb.core_tensors(), "advantages": advantages})
    with pytest.raises(BatchFormatError, match="temperature"):
        MicroBatch(**mb.core_tensors(), temperature=0.0)


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda d: d[: len(d) * 3 // 4], id="last-quarter-missing"),
        pytest.param(
            lambda d: d[: len(d) * 3 // 4] + bytes(len(d) - len(d) * 3 // 4), id="last-quarter-zeroed"
        ),
        pytest.param(lambda d: d[:-1] + bytes([d[-1] ^ 1]), id="one-bit-flipped"),
        pytest.param(lambda d: d[:8], id="header-only"),
        pytest.param(lambda d: b"", id="empty"),
    ],
)
def test_damaged_bytes_are_refused_not_trained_on(damage) -> None:
    data = encode_rank_batch(5, 0, make_step(0)[0])
    with pytest.raises(IntegrityError):
        decode_rank_batch(damage(data))


def test_a_changed_header_field_is_refused() -> None:
    data = encode_rank_batch(5, 0, make_step(0)[0])
    # Same length, different step number inside the JSON header: the digest covers the header.
    tampered = data.replace(b'\\"step\\": 5', b'\\"step\\": 6', 1)
    assert tampered != data
    with pytest.raises(IntegrityError, match="digest"):
        decode_rank_batch(tampered)


def _rewrite(data: bytes, edit) -> bytes:
    """Re-sign a batch after ``edit(header, tensors)`` changed it (what an older or newer writer makes)."""
    import json

    from safetensors.torch import load, save

    length = int.from_bytes(data[:8], "little")
    header = json.loads(json.loads(data[8 : 8 + length])["__metadata__"]["prime_composer"])
    tensors = load(data)
    edit(header, tensors)
    blob = save(tensors, metadata={"prime_composer": json.dumps(header)})
    # Re-encode through the real encoder's digest scheme by decoding nothing: build the digest here.
    from prime_composer.integrity import bytes_digest
    from prime_composer.transport.batch import _canonical_table, _split

    table, body = _split(blob)
    table["__metadata__"]["prime_composer_sha256"] = bytes_digest(
        table["__metadata__"]["prime_composer"].encode(), _canonical_table(table), body
    )
    new_header = json.dumps(table).encode()
    new_header += b" " * (-len(new_header) % 8)
    return len(new_header).to_bytes(8, "little") + new_header + bytes(body)


def test_version_and_field_mismatches_name_what_is_wrong() -> None:
    data = encode_rank_batch(5, 0, make_step(0)[0])

    def old_format(header: dict, tensors: dict) -> None:
        header["format"] = 3

    with pytest.raises(BatchFormatError, match="format 3 is not 4"):
        decode_rank_batch(_rewrite(data, old_format))

    def drop_field(header: dict, tensors: dict) -> None:
        del tensors["0/advantages"]

    with pytest.raises(BatchFormatError, match="no tensor for field 'advantages'"):
        decode_rank_batch(_rewrite(data, drop_field))

    def unknown_group(header: dict, tensors: dict) -> None:
        header["meta"][0]["groups"] = ["telepathy"]

    with pytest.raises(BatchFormatError, match="'telepathy'"):
        decode_rank_batch(_rewrite(data, unknown_group))

    def group_without_tensors(header: dict, tensors: dict) -> None:
        header["meta"][0]["groups"] = ["sdpo"]

    with pytest.raises(BatchFormatError, match=r"'sdpo\.student_mask'"):
        decode_rank_batch(_rewrite(data, group_without_tensors))


def test_filesystem_round_trip_across_threads(tmp_path: Path) -> None:
    cfg = TransportConfig(receive_timeout_s=20, poll_interval_s=0.01, keep_last_steps=2)
    steps = {step: make_step(step) for step in range(4)}

    def orchestrator() -> None:
        sender = FilesystemSender(tmp_path, cfg)
        for step, rank_batches in steps.items():
            time.sleep(0.05)  # the trainer is already waiting for step 0
            sender.send(step, rank_batches)

    thread = threading.Thread(target=orchestrator)
    receiver = FilesystemReceiver(tmp_path, cfg)
    thread.start()
    for rank in range(2):
        assert_same(receiver.receive(0, rank), steps[0][rank])
    thread.join()
    assert_same(receiver.receive(3, 1), steps[3][1])
    # keep_last_steps = 2: steps 0 and 1 are gone, no temporary file left behind
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == ["step_2", "step_3"]
    assert sorted(p.name for p in rank_path(tmp_path, 3, 0).parent.iterdir()) == ["rank_0.bin", "rank_1.bin"]


def test_filesystem_timeout_names_the_path(tmp_path: Path) -> None:
    receiver = FilesystemReceiver(tmp_path, TransportConfig(receive_timeout_s=0.1, poll_interval_s=0.01))
    with pytest.raises(TimeoutError, match=r"step_7/rank_1\.bin"):
        receiver.receive(7, 1)


def test_zmq_round_trip_keyed_by_step(tmp_path: Path) -> None:
    cfg = TransportConfig(
        kind="zmq",
        port=free_port("127.0.0.1", set()),
        receive_timeout_s=20,
        poll_interval_s=0.01,
        keep_last_steps=3,
    )
    steps = {step: make_step(step) for step in range(5)}
    # the trainer connects and asks before the orchestrator's server exists
    receiver = make_receiver(cfg, tmp_path)
    sender = None
    try:
        got: dict[int, list[MicroBatch]] = {}
        thread = threading.Thread(target=lambda: got.update({0: receiver.receive(0, 1)}))
        thread.start()
        time.sleep(0.1)
        sender = make_sender(cfg, tmp_path)
        sender.send(0, steps[0])
        thread.join(timeout=20)
        assert_same(got[0], steps[0][1])
        # the orchestrator runs ahead: step 2 is sent before the trainer asks for step 1
        sender.send(1, steps[1])
        sender.send(2, steps[2])
        assert_same(receiver.receive(1, 0), steps[1][0])
        assert_same(receiver.receive(2, 1), steps[2][1])
        # keep_last_steps = 3: after step 4, steps 0 and 1 are gone and asking for one is an error
        sender.send(3, steps[3])
        sender.send(4, steps[4])
        with pytest.raises(ValueError, match="already deleted"):
            receiver.receive(1, 0)
        with pytest.raises(ValueError, match="packed for 2 ranks"):
            receiver.receive(4, 5)
        assert_same(receiver.receive(2, 0), steps[2][0])
    finally:
        receiver.close()
        if sender is not None:
            sender.close()


def test_zmq_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port("127.0.0.1", set())
    monkeypatch.setenv("TEST_TRANSPORT_SECRET", "right")
    monkeypatch.setenv("TEST_TRANSPORT_WRONG", "wrong")
    base = {"kind": "zmq", "port": port, "poll_interval_s": 0.01}
    sender = make_sender(TransportConfig(**base, secret_env="TEST_TRANSPORT_SECRET"), tmp_path)
    good = make_receiver(
        TransportConfig(**base, secret_env="TEST_TRANSPORT_SECRET", receive_timeout_s=20), tmp_path
    )
    bad = make_receiver(
        TransportConfig(**base, secret_env="TEST_TRANSPORT_WRONG", receive_timeout_s=0.5), tmp_path
    )
    unsigned = make_receiver(TransportConfig(**base, receive_timeout_s=0.5), tmp_path)
    try:
        step = make_step(0)
        sender.send(0, step)
        assert_same(good.receive(0, 0), step[0])
        for receiver in (bad, unsigned):  # the server ignores their requests
            with pytest.raises(TimeoutError, match="no batch for step 0 rank 0"):
                receiver.receive(0, 0)
    finally:
        for closeable in (good, bad, unsigned, sender):
            closeable.close()


def test_config_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="secret_env"):
        TransportConfig(kind="zmq", host="0.0.0.0")
    TransportConfig(kind="zmq", host="0.0.0.0", secret_env="X")
    TransportConfig(kind="zmq", host="localhost")
    monkeypatch.delenv("TEST_TRANSPORT_UNSET", raising=False)
    with pytest.raises(ValueError, match="TEST_TRANSPORT_UNSET"):
        make_sender(
            TransportConfig(
                kind="zmq", port=free_port("127.0.0.1", set()), secret_env="TEST_TRANSPORT_UNSET"
            ),
            Path("."),
        )

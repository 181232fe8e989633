"""``rl`` with an inference worker on another machine that shares nothing with it but TCP:
two network namespaces (``infra/diloco/netsim.py``), the trainer side's ``rl`` in one, the worker
in the other, started with the command ``rl`` prints from a copy of the worker config it wrote,
in a mount namespace where the trainer's ``output_dir`` is hidden under an empty tmpfs (so no
file can come from it). ``rl`` serves the steps over pinned TLS with the certificate it made; the
worker fetches each step the orchestrator names, and what it serves is, byte for byte, what the
trainer published. Every byte on the worker's link is recorded: neither secret crosses it, and the
orchestrator's calls to the worker are signed, with no bearer token. Needs root and ``unshare``;
skipped with the reason otherwise."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "infra" / "diloco"))

from netsim import NetSim, available  # noqa: E402

from prime_composer.integrity import file_digest  # noqa: E402

_REASON = available() or (None if shutil.which("unshare") else "the unshare command is missing")
pytestmark = [pytest.mark.netns, pytest.mark.skipif(_REASON is not None, reason=f"netsim {_REASON}")]

WORKER_PORT = 7931
STEPS = 2
CONFIG = f"""
max_steps = {STEPS}
seed = 0
max_async_level = 1
[model]
name = "builtin:tiny-qwen3"
[launch]
remote_inference = true
progress = false
health_timeout_s = 200
[inference]
secret_env = "TEST_INFERENCE_SECRET"
private_network = true  # the worker's link stays plain HTTP here: the test reads what crosses it
num_threads = 1
max_model_len = 128
[orchestrator]
base_url = "http://10.77.0.2:{WORKER_PORT}/v1"
inference_private_network = true
batch_size = 8
group_size = 4
seq_len = 48
micro_batch_size = 8
[orchestrator.sampling]
max_tokens = 4
[[orchestrator.env]]
id = "arith"
args = {{ max_operand = 4 }}
[trainer]
num_threads = 1
[transport.weights_origin]
enabled = true
host = "10.77.0.1"
secret_env = "TEST_WEIGHTS_SECRET"
"""


def _wait_for(path: Path, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    until = time.monotonic() + timeout_s
    while not path.is_file():
        assert proc.poll() is None and time.monotonic() < until, log.read_text()[-4000:]
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_rl_feeds_a_worker_in_another_namespace_that_shares_no_folder(tmp_path: Path) -> None:
    out, worker_dir = tmp_path / "trainer-run", tmp_path / "worker"
    worker_dir.mkdir()
    (tmp_path / "run.toml").write_text(CONFIG)
    env = {
        **os.environ,
        "TEST_WEIGHTS_SECRET": "weights-secret-0c5e1d",
        "TEST_INFERENCE_SECRET": "inference-secret-7a2b",
        "HF_HUB_OFFLINE": "1",
    }
    rl_log, worker_log = tmp_path / "rl.log", tmp_path / "worker.log"
    with NetSim(num_dcs=2, rate_mbit=200) as net:
        capture = net.capture(1, str(tmp_path / "wire.bin"), max_bytes=512 << 20)
        rl = subprocess.Popen(
            [*net.prefix(0), sys.executable, "-m", "prime_composer.launch.rl", "@", str(tmp_path / "run.toml"),
             "--output-dir", str(out)],
            cwd=REPO, env=env, stdout=rl_log.open("wb"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        worker = None
        try:
            record_path = out / "configs" / "weights-origin.json"
            _wait_for(record_path, rl, rl_log, 120)
            record = json.loads(record_path.read_text())
            # As a user would: copy the worker config to the worker's machine, run the printed command.
            shutil.copy(out / "configs" / "inference-worker.json", worker_dir)
            [command] = record["workers"]
            assert command in rl_log.read_text()
            argv = shlex.split(command)
            assert argv[:4] == ["uv", "run", "inference", "@"]
            hide = f'mount -t tmpfs tmpfs {shlex.quote(str(out))} && exec "$@"'
            worker = subprocess.Popen(
                [*net.prefix(1), "unshare", "--mount", "--propagation", "private", "sh", "-c", hide, "sh",
                 sys.executable, "-m", "prime_composer.inference.main", *argv[3:]],
                cwd=worker_dir, env=env, stdout=worker_log.open("wb"), stderr=subprocess.STDOUT,
            )  # fmt: skip
            code = rl.wait(timeout=400)
            assert code == 0, (
                rl_log.read_text()[-6000:] + "\n--- worker ---\n" + worker_log.read_text()[-3000:]
            )
            assert worker.poll() is None, worker_log.read_text()[-3000:]
            health = subprocess.run(
                [*net.prefix(1), sys.executable, "-c",
                 f"import urllib.request;print(urllib.request.urlopen('http://10.77.0.2:{WORKER_PORT}/health').read().decode())"],
                capture_output=True, text=True, timeout=30, check=True,
            )  # fmt: skip
        finally:
            for proc in (rl, worker, capture):
                if proc is not None and proc.poll() is None:
                    proc.terminate()
                    proc.wait(timeout=30)
    # Everything on the worker's link: neither secret, no bearer token; the orchestrator's calls
    # (plain HTTP here, so readable) carry signatures instead.
    wire = (tmp_path / "wire.bin").read_bytes()
    assert b"X-Prime-Composer-Auth" in wire and b"/update_weights" in wire
    for secret in (env["TEST_INFERENCE_SECRET"], env["TEST_WEIGHTS_SECRET"]):
        assert secret.encode() not in wire
    assert b"authorization" not in wire.lower() and b"bearer" not in wire.lower()
    assert (
        record["weights_origin"].startswith("https://10.77.0.1:") and "@sha256:" in record["weights_origin"]
    )
    served = json.loads(health.stdout)["weights"]
    fetched = worker_dir / "outputs" / "inference-worker" / "broadcasts"
    assert served["step"] == STEPS - 1 or served["step"] == STEPS, served
    step = served["step"]
    assert Path(served["path"]).resolve() == (fetched / f"step_{step}").resolve()
    for name in json.loads((out / "broadcasts" / f"step_{step}" / "MANIFEST.json").read_text())["files"]:
        assert file_digest(fetched / f"step_{step}" / name) == file_digest(
            out / "broadcasts" / f"step_{step}" / name
        )
    orchestrator = [json.loads(x) for x in (out / "metrics" / "orchestrator.jsonl").read_text().splitlines()]
    assert [r["step"] for r in orchestrator if "reward/mean" in r] == list(range(STEPS))

"""``exit_process``: a console script's end keeps everything a normal exit guarantees (threads
joined, thread pools finished, ``atexit`` handlers, logging, buffered files and stdout flushed)
and skips the interpreter's teardown of every object, which a normal ``sys.exit`` runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import atexit, concurrent.futures, logging, sys, threading, time, weakref
from pathlib import Path

from prime_composer.config.cli import exit_process

out = Path(sys.argv[1])


class Finalized:
    def __del__(self):  # runs only when the interpreter tears its modules down
        (out / "finalized").write_text("yes")


kept_until_teardown = Finalized()
class Referent:
    pass
dead_proxy = weakref.proxy(Referent())  # among gc's objects, and raises on any attribute
buffered = open(out / "buffered.txt", "w")  # written, never flushed nor closed by the script
buffered.write("every byte")
atexit.register(lambda: (out / "atexit").write_text("ran"))
threading.Thread(target=lambda: (time.sleep(0.3), (out / "thread").write_text("joined"))).start()
pool = concurrent.futures.ThreadPoolExecutor(1)
pool.submit(lambda: (time.sleep(0.3), (out / "pool").write_text("done")))
handler = logging.FileHandler(out / "log.txt")
logging.getLogger().addHandler(handler)
logging.getLogger().warning("logged")
print("on stdout", end="")  # no newline: still in the buffer of a pipe
if sys.argv[2] == "exit_process":
    exit_process(3)
sys.exit(3)
"""


def _run(tmp_path: Path, how: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path / how
    out.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(out), how], capture_output=True, text=True, timeout=120
    )
    return proc, out


@pytest.mark.parametrize("how", ["exit_process", "sys.exit"])
def test_a_fast_exit_keeps_what_a_normal_exit_guarantees(tmp_path: Path, how: str) -> None:
    proc, out = _run(tmp_path, how)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "on stdout"
    assert (out / "buffered.txt").read_text() == "every byte"
    assert (out / "atexit").read_text() == "ran"
    assert (out / "thread").read_text() == "joined"
    assert (out / "pool").read_text() == "done"
    assert (out / "log.txt").read_text() == "logged\n"
    # The difference: a normal exit finalizes every object (the control), exit_process does not.
    assert (out / "finalized").exists() == (how == "sys.exit")

"""Benchmark: per-call overhead of an MCP stdio server in the sandbox, started for each call
(``lifetime = "call"``) against one server kept for the episode (``lifetime = "episode"``).

Both sides call the ``add`` tool of the tests' ``mcp`` SDK server
(``tests/integration/mcp_calc_server.py``) ``--calls`` times through a ``Toolset`` on an isolated
sandbox's workspace (needs root), one call at a time; the time of a call is its
``ToolCallRecord.duration_s``. The episode side's first call pays the server's start-up and
``initialize`` (reported apart as ``episode_first_s``); its later calls are a JSON-RPC round trip
plus the SIGCONT/SIGSTOP of the server's processes. The tool list is asked once per process
before timing (it is cached per command). The last line is
``call_median_s=X episode_median_s=Y ratio=X/Y``.

Run (~2-6 min on 2 shared cores, mostly the per-call side's start-ups)::

    uv run python bench/mcp_stdio.py
    uv run python bench/mcp_stdio.py --calls 5
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path

from prime_composer.config.env import McpServerConfig
from prime_composer.config.sandbox import SandboxConfig, ToolsConfig
from prime_composer.orchestrator.mcp_tools import mcp_tools
from prime_composer.sandbox import Sandbox, Toolset

SERVER = Path(__file__).parents[1] / "tests" / "integration" / "mcp_calc_server.py"


def timed_calls(sandbox: Sandbox, task: Path, lifetime: str, num_calls: int) -> list[float]:
    config = McpServerConfig(
        name="calc", command=["python", "mcp_server.py"], tools=["add"], timeout_s=300, lifetime=lifetime
    )
    with sandbox.workspace(task) as workspace:
        toolset = Toolset(
            sandbox, workspace, ToolsConfig(enabled=[]), extra_tools=mcp_tools([config], sandbox, workspace)
        )
        durations = []
        for i in range(num_calls):
            result = toolset.call("add", json.dumps({"a": i, "b": 1}))
            if result.content != str(i + 1):
                raise SystemExit(f"{lifetime}: add({i}, 1) answered {result.content!r}")
            durations.append(result.record.duration_s)
    return durations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20, help="calls per side")
    args = parser.parse_args()
    task = Path(tempfile.mkdtemp(prefix="mcp-bench-"))
    try:
        shutil.copy(SERVER, task / "mcp_server.py")
        with Sandbox(SandboxConfig()) as sandbox:
            timed_calls(sandbox, task, "episode", 1)  # caches the tool list
            per_call = timed_calls(sandbox, task, "call", args.calls)
            episode = timed_calls(sandbox, task, "episode", args.calls)
    finally:
        shutil.rmtree(task)
    later = episode[1:] or episode
    print(f"call: median {statistics.median(per_call):.3f} s, min {min(per_call):.3f} s, n={len(per_call)}")
    print(
        f"episode: first call {episode[0]:.3f} s (start-up + initialize), later calls median "
        f"{statistics.median(later) * 1000:.1f} ms, min {min(later) * 1000:.1f} ms, "
        f"total {sum(episode):.2f} s vs {sum(per_call):.2f} s"
    )
    print(f"episode_first_s={episode[0]:.3f}")
    print(
        f"call_median_s={statistics.median(per_call):.4f} episode_median_s={statistics.median(later):.4f} "
        f"ratio={statistics.median(per_call) / statistics.median(later):.1f}"
    )


if __name__ == "__main__":
    main()

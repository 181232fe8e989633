"""A small MCP tool server (the ``mcp`` SDK's ``MCPServer``) for the MCP agent-tool tests.

``python mcp_calc_server.py`` serves stdio (in the sandbox, from the task's files);
``python mcp_calc_server.py --http PORT`` serves streamable HTTP on 127.0.0.1:PORT at ``/mcp``.
"""

import sys
import time
from pathlib import Path

from mcp.server.mcpserver import MCPServer

app = MCPServer("calc")


@app.tool()
def add(a: int, b: int) -> str:
    """Add two integers."""
    return str(a + b)


@app.tool()
def append_note(text: str) -> str:
    """Append a line to notes.txt in the current folder and return the whole file."""
    notes = Path("notes.txt")
    with notes.open("a") as f:
        f.write(text + "\n")
    return notes.read_text()


@app.tool()
def fail(reason: str) -> str:
    """Always fails with the reason given."""
    raise ValueError(reason)


@app.tool()
def nap(seconds: float) -> str:
    """Sleep, then say so."""
    time.sleep(seconds)
    return f"slept {seconds}"


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--http":
        app.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        app.run()

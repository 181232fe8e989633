"""A small MCP tool server (the ``mcp`` SDK's ``MCPServer``) for the MCP agent-tool tests.

``python mcp_calc_server.py`` serves stdio (in the sandbox, from the task's files);
``python mcp_calc_server.py --http PORT`` serves streamable HTTP on 127.0.0.1:PORT at ``/mcp``;
``--http PORT --token-env VAR`` answers only requests with ``Authorization: Bearer $VAR`` (401
otherwise).
"""

import hmac
import json
import os
import resource
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


calls = 0


@app.tool()
def count() -> str:
    """How many times this server process has been asked to count (state kept in memory)."""
    global calls
    calls += 1
    return str(calls)


@app.tool()
def crash(code: int) -> str:
    """End the server process at once with exit code ``code``."""
    os._exit(code)


@app.tool()
def limits() -> str:
    """The uid this server runs as and its open-files limit, as JSON."""
    return json.dumps({"uid": os.getuid(), "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0]})


def with_token(inner, token: str):
    """``inner`` behind a bearer token: 401 for an HTTP request without it."""
    expected = f"Bearer {token}".encode()

    async def guarded(scope, receive, send):
        if scope["type"] == "http":
            sent = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(sent, expected):
                await send({"type": "http.response.start", "status": 401, "headers": []})
                await send({"type": "http.response.body", "body": b"unauthorized"})
                return
        await inner(scope, receive, send)

    return guarded


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--http" and sys.argv[3] == "--token-env":
        import uvicorn

        asgi = with_token(app.streamable_http_app(), os.environ[sys.argv[4]])
        uvicorn.run(asgi, host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
    elif len(sys.argv) == 3 and sys.argv[1] == "--http":
        app.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        app.run()

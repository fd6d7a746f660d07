"""Drives agent-sandbox's MCP server with the official MCP Python SDK, as an agent's host
would: over stdio (`client.py stdio BINARY STATE_DIR [ARGS...]`: it starts `BINARY mcp` with
those arguments, e.g. `--server URL --token-file F`) or over
streamable HTTP (`client.py http URL TOKEN`: `agent-sandbox serve`'s `/mcp` endpoint).
Prints one JSON line of what it saw for the Rust test to check."""
import asyncio
import base64
import contextlib
import json
import sys

from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client


@contextlib.asynccontextmanager
async def connect(argv):
    if argv[0] == "stdio":
        params = StdioServerParameters(
            command=argv[1],
            args=["mcp", "--state-dir", argv[2], *argv[3:]],
            env={"PATH": "/usr/bin:/bin"},
        )
        async with stdio_client(params) as (r, w):
            yield r, w
    else:
        http = create_mcp_http_client(headers={"Authorization": f"Bearer {argv[2]}"})
        async with http:
            async with streamable_http_client(argv[1], http_client=http) as streams:
                yield streams[0], streams[1]


async def main(argv):
    seen = {}
    async with connect(argv) as (r, w):
        async with ClientSession(r, w) as s:
            await s.initialize()
            seen["tools"] = sorted(t.name for t in (await s.list_tools()).tools)

            async def call(name, args):
                res = await s.call_tool(name, args)
                return {"text": res.content[0].text, "error": bool(res.is_error)}

            def session_of(answer):
                return answer["text"].split("session: ")[1].split("\n")[0]

            first = await call("run_code", {"language": "python", "code": "x = 6 * 7\nprint('set')"})
            seen["first"] = first
            sid = session_of(first)
            seen["second"] = await call("run_code", {"language": "python", "code": "print(x)", "session": sid})
            # A chart: the figure comes back as MCP image content the client model can see.
            chart = await s.call_tool(
                "run_code",
                {"language": "python", "session": sid,
                 "code": "import matplotlib.pyplot as plt\nplt.plot(range(100))\nprint('drawn')"},
            )
            images = [base64.b64decode(c.data) for c in chart.content if c.type == "image"]
            seen["chart"] = {
                "text": chart.content[0].text,
                "error": bool(chart.is_error),
                "types": [c.type for c in chart.content],
                "mimes": [getattr(c, "mime_type", None) or getattr(c, "mimeType", None) for c in chart.content if c.type == "image"],
                "png": [i[:8] == b"\x89PNG\r\n\x1a\n" for i in images],
                "bytes": [len(i) for i in images],
            }
            seen["write"] = await call("write_file", {"session": sid, "path": "a/b.txt", "content": "hello"})
            seen["read"] = await call("read_file", {"session": sid, "path": "a/b.txt"})
            seen["list"] = await call("list_files", {"session": sid, "path": "a"})
            # A snapshot, and a new session from it that has the file.
            seen["snapshot"] = await call("snapshot", {"session": sid})
            snap = seen["snapshot"]["text"].split("snapshot: ")[-1].strip()
            seen["restore"] = await call("restore", {"snapshot": snap})
            if not seen["restore"]["error"]:
                seen["restored_read"] = await call(
                    "read_file", {"session": session_of(seen["restore"]), "path": "a/b.txt"}
                )
            seen["bad_restore"] = await call("restore", {"snapshot": "nope"})
            seen["escape"] = await call("read_file", {"session": sid, "path": "../../etc/passwd"})
            seen["timeout"] = await call(
                "run_code", {"language": "python", "code": "while True: pass", "session": sid, "timeout_ms": 1000}
            )
            seen["unknown"] = await call("read_file", {"session": "nope", "path": "x"})
            seen["destroy"] = await call("destroy_sandbox", {"session": sid})
            seen["after"] = await call("run_code", {"language": "python", "code": "1", "session": sid})
    print(json.dumps(seen))


asyncio.run(main(sys.argv[1:]))

"""Drives `agent-sandbox mcp` with the official MCP Python SDK over stdio, as an agent's
host would; prints one JSON line of what it saw for the Rust test to check."""
import asyncio
import json
import sys

from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client


async def main(binary):
    params = StdioServerParameters(command=binary, args=["mcp"], env={"PATH": "/usr/bin:/bin"})
    seen = {}
    async with stdio_client(params) as (r, w):
        async with ClientSession(r, w) as s:
            await s.initialize()
            seen["tools"] = sorted(t.name for t in (await s.list_tools()).tools)

            async def call(name, args):
                res = await s.call_tool(name, args)
                return {"text": res.content[0].text, "error": bool(res.is_error)}

            first = await call("run_code", {"language": "python", "code": "x = 6 * 7\nprint('set')"})
            seen["first"] = first
            sid = first["text"].split("session: ")[1].split("\n")[0]
            seen["second"] = await call("run_code", {"language": "python", "code": "print(x)", "session": sid})
            seen["write"] = await call("write_file", {"session": sid, "path": "a/b.txt", "content": "hello"})
            seen["read"] = await call("read_file", {"session": sid, "path": "a/b.txt"})
            seen["list"] = await call("list_files", {"session": sid, "path": "a"})
            seen["escape"] = await call("read_file", {"session": sid, "path": "../../etc/passwd"})
            seen["timeout"] = await call(
                "run_code", {"language": "python", "code": "while True: pass", "session": sid, "timeout_ms": 1000}
            )
            seen["unknown"] = await call("read_file", {"session": "nope", "path": "x"})
            seen["destroy"] = await call("destroy_sandbox", {"session": sid})
            seen["after"] = await call("run_code", {"language": "python", "code": "1", "session": sid})
    print(json.dumps(seen))


asyncio.run(main(sys.argv[1]))

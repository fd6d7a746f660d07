"""Drives `agent-sandbox serve`'s E2B code interpreter (port 49999) with the official
`e2b-code-interpreter` Python SDK (the version scripts/test.sh pins), through its public sync
API only, as its users do: `Sandbox.create()` (the default `code-interpreter-v1` template),
`run_code` with callbacks, contexts, bash cells, per-call environment, a timeout that interrupts the
cell, reconnecting, a killed sandbox, a sandbox without public traffic, and what the server
refuses. The checks follow the SDK's own test suite (e2b-dev/E2B,
packages/code-interpreter-python/tests). Prints `ok: STEP` per step and `all ok` at the end;
a failed check is an AssertionError saying what was expected and what came.

Environment: E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY as for scenario.py; E2B_EXPECT_HOME
the sandbox's home (/home/user unless the template names another)."""
import http.client
import json
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

from e2b import (
    InvalidArgumentException,
    NotFoundException,
    SandboxException,
    TimeoutException,
)
from e2b_code_interpreter import Sandbox

HOME = os.environ.get("E2B_EXPECT_HOME", "/home/user")
URL = os.environ["E2B_SANDBOX_URL"].rstrip("/")


def eq(got, want, what):
    assert got == want, f"{what}: expected {want!r}, got {got!r}"


def raw(sbx, method, path, body=None, headers=None):
    """A request to the sandbox's port 49999 outside the SDK: (status, body text)."""
    h = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49999"}
    h.update(headers or {})
    data = None if body is None else json.dumps(body).encode()
    if data is not None:
        h["Content-Type"] = "application/json"
    req = urllib.request.Request(URL + path, data=data, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def basics(sbx):
    eq(sbx.run_code("x =1; x").text, "1", "x =1; x")
    ex = sbx.run_code("x+=1; x")
    eq(ex.text, "2", "state kept")
    eq(ex.execution_count, 2, "the second cell's count")
    eq(sbx.run_code("import os; os.getcwd()").text, HOME, "cwd (quotes stripped)")
    eq(sbx.run_code("!pwd").logs.stdout, [HOME + "\n"], "a shell line")


def callbacks(sbx):
    seen = {"stdout": [], "stderr": [], "result": [], "error": []}
    ex = sbx.run_code(
        'print("Hello from e2b")',
        on_stdout=lambda m: seen["stdout"].append(m.line),
        on_stderr=lambda m: seen["stderr"].append(m.line),
    )
    eq(ex.logs.stdout, ["Hello from e2b\n"], "stdout")
    eq(seen["stdout"], ["Hello from e2b\n"], "on_stdout")
    ex = sbx.run_code(
        'import sys; print("This is an error message", file=sys.stderr)',
        on_stderr=lambda m: seen["stderr"].append(m.line),
    )
    eq(ex.logs.stderr, ["This is an error message\n"], "stderr")
    eq(seen["stderr"], ["This is an error message\n"], "on_stderr")
    ex = sbx.run_code("xyz", on_error=lambda e: seen["error"].append(e))
    eq(ex.error.name, "NameError", "error name")
    eq(ex.error.value, "name 'xyz' is not defined", "error value")
    assert "xyz" in ex.error.traceback, ex.error.traceback
    eq(len(seen["error"]), 1, "on_error calls")
    code = "class H:\n    def _repr_html_(self): return '<b>h</b>'\ndisplay(H())\n40 + 2"
    ex = sbx.run_code(code, on_result=lambda r: seen["result"].append(r))
    eq(len(seen["result"]), 2, "on_result calls (a display and the value)")
    eq([r.is_main_result for r in ex.results], [False, True], "which is the main result")
    eq(ex.results[0].html, "<b>h</b>", "a display's HTML")
    eq(ex.text, "42", "the main result's text")
    ex = sbx.run_code('{"a": [1, 2]}')
    eq(ex.results[0].text, "{'a': [1, 2]}", "a dict's repr")


def contexts(sbx):
    ctx = sbx.create_code_context()
    eq((ctx.language, ctx.cwd), ("python", HOME), "a default context")
    other = sbx.create_code_context(language="python", cwd="/tmp")
    eq(other.cwd, "/tmp", "a context's cwd")
    eq(sbx.run_code("import os; os.getcwd()", context=other).text, "/tmp", "cwd in it")
    listed = sbx.list_code_contexts()
    eq(listed[-1].id, other.id, "the newest is listed last")
    sbx.run_code("only_here = 1", context=ctx)
    ex = sbx.run_code("only_here", context=other)
    eq(ex.error.name, "NameError", "contexts are independent")
    sbx.restart_code_context(ctx)
    ex = sbx.run_code("only_here", context=ctx)
    eq(ex.error.value, "name 'only_here' is not defined", "a restart forgets")
    sbx.remove_code_context(other)
    assert other.id not in [c.id for c in sbx.list_code_contexts()], "removed"
    try:
        sbx.run_code("1", context=other)
        raise AssertionError("a removed context ran code")
    except NotFoundException:
        pass
    try:
        sbx.run_code("1", context=ctx, language="python")
        raise AssertionError("context and language together were taken")
    except InvalidArgumentException:
        pass
    try:
        sbx.run_code("1", language="r")
        raise AssertionError("R ran")
    except SandboxException as e:
        assert "Python and bash" in str(e), str(e)


def env_vars(sbx_env):
    eq(sbx_env.run_code("import os; os.getenv('FOO')").text, "bar", "the sandbox's env")
    ex = sbx_env.run_code("import os; os.getenv('FOO')", envs={"FOO": "baz"})
    eq(ex.text, "baz", "a cell's env")
    eq(sbx_env.run_code("os.getenv('FOO')").text, "bar", "the sandbox's again")
    ex = sbx_env.run_code("os.getenv('ONLY')", envs={"ONLY": "1"})
    eq(ex.text, "1", "a new variable")
    eq(sbx_env.run_code("os.getenv('ONLY')").text, None, "gone after its cell")
    # E2B's env_vars/test_bash.py: the sandbox's, a cell's, then the sandbox's again.
    ex = sbx_env.run_code("echo $FOO", language="bash")
    eq(ex.logs.stdout, ["bar\n"], "bash: the sandbox's env")
    ex = sbx_env.run_code("echo $FOO", envs={"FOO": "baz"}, language="bash")
    eq(ex.logs.stdout, ["baz\n"], "bash: a cell's env")
    ex = sbx_env.run_code("echo ${FOO:-default} ${ONLY:-default}", language="bash")
    eq(ex.logs.stdout, ["bar default\n"], "bash: put back after its cell")


def bash(sbx):
    """`language="bash"`: one shell per context, its state kept; a failing cell's status is
    its error."""
    ex = sbx.run_code("pwd; n=41; cd /tmp", language="bash")
    eq(ex.logs.stdout, [HOME + "\n"], "bash starts in the home")
    ex = sbx.run_code("echo $((n + 1)) $PWD", language="bash")
    eq(ex.logs.stdout, ["42 /tmp\n"], "bash keeps its variables and directory")
    ex = sbx.run_code("echo oops >&2; false", language="bash")
    eq(ex.logs.stderr, ["oops\n"], "bash stderr")
    eq((ex.error.name, ex.error.value), ("ExitStatus", "1"), "a failing bash cell")
    ctx = sbx.create_code_context(language="bash")
    eq(ctx.language, "bash", "a bash context")
    ex = sbx.run_code("echo ${n:-unset}", context=ctx)
    eq(ex.logs.stdout, ["unset\n"], "bash contexts are apart")


def interrupt(sbx):
    sbx.run_code("kept = 5")
    start = time.monotonic()
    try:
        sbx.run_code("import time; time.sleep(300)", timeout=3)
        raise AssertionError("a 300 s cell ended within a 3 s timeout")
    except TimeoutException:
        pass
    assert time.monotonic() - start < 60, "the timeout took too long"
    # The client closed the stream: the cell was interrupted, the state is kept.
    ex = sbx.run_code("1 + 1")
    eq(ex.text, "2", f"the next cell ({ex})")
    eq(sbx.run_code("kept").text, "5", "the state after an interrupt")


def reconnect(sbx):
    sbx.run_code("again = 'yes'")
    same = Sandbox.connect(sbx.sandbox_id)
    eq(same.run_code("again").text, "yes", "through a reconnected handle")


def killed():
    sbx = Sandbox.create(timeout=60)
    threading.Timer(2, sbx.kill).start()
    try:
        sbx.run_code("import time; time.sleep(60)")
        raise AssertionError("a cell outlived its sandbox")
    except TimeoutException as e:
        assert "killed" in str(e), str(e)


def no_public_traffic():
    sbx = Sandbox.create(timeout=60, network={"allow_public_traffic": False})
    try:
        eq(sbx.run_code("3 * 3").text, "9", "with a traffic token")
        ctx = sbx.create_code_context()
        eq(sbx.run_code("4", context=ctx).text, "4", "its context")
        status, body = raw(sbx, "POST", "/execute", {"code": "1"})
        eq(status, 401, f"execute without tokens ({body})")
        status, body = raw(sbx, "GET", "/contexts")
        eq(status, 401, f"contexts without its traffic token ({body})")
        status, _ = raw(
            sbx,
            "GET",
            "/contexts",
            headers={"E2B-Traffic-Access-Token": sbx.traffic_access_token},
        )
        eq(status, 200, "contexts with its traffic token")
    finally:
        sbx.kill()


def refusals(sbx):
    status, body = raw(sbx, "POST", "/execute", {"code": "open('/tmp/x', 'w')"})
    eq(status, 401, f"execute without the envd token ({body})")
    status, _ = raw(
        sbx, "GET", "/contexts", headers={"X-Access-Token": "e2b_not_the_token"}
    )
    eq(status, 401, "contexts with a wrong token")
    status, body = raw(sbx, "GET", "/health")
    eq((status, body), (200, '"OK"'), "health")


def queue(sbx):
    """A context runs one cell at a time; at most 8 more wait, each holding its code: the
    ninth is a 429. Waiting clients that leave give their places back, and a client that
    leaves a running cell interrupts it."""
    url = urllib.parse.urlparse(URL)

    def execute(code):
        c = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
        headers = {
            "E2b-Sandbox-Id": sbx.sandbox_id,
            "E2b-Sandbox-Port": "49999",
            "X-Access-Token": sbx._envd_access_token,
            "Content-Type": "application/json",
        }
        c.request("POST", "/execute", body=json.dumps({"code": code}), headers=headers)
        return c, c.getresponse()

    busy = execute("import time; time.sleep(120)")
    eq(busy[1].status, 200, "the running cell's answer")
    waiting = [execute("1") for _ in range(8)]
    eq([r.status for _, r in waiting], [200] * 8, "eight waiting cells")
    over = execute("1")
    eq(over[1].status, 429, "a ninth waiting cell")
    assert "wait" in over[1].read().decode(), "the 429 says why"
    # A response keeps its connection's socket open: both are closed.
    for c, r in [over, *waiting, busy]:
        r.close()
        c.close()
    ex = sbx.run_code("'free'", timeout=60)
    eq(ex.text, "free", "the context after its clients left")


def main():
    sbx = Sandbox.create(timeout=120)
    sbx_env = Sandbox.create(timeout=120, envs={"FOO": "bar"})
    try:
        for step in (basics, callbacks, contexts, bash, interrupt, reconnect, refusals, queue):
            step(sbx)
            print("ok:", step.__name__, flush=True)
        env_vars(sbx_env)
        print("ok: env_vars", flush=True)
    finally:
        sbx.kill()
        sbx_env.kill()
    killed()
    print("ok: killed", flush=True)
    no_public_traffic()
    print("ok: no_public_traffic", flush=True)
    print("all ok")


if __name__ == "__main__":
    main()

"""Drives `agent-sandbox serve`'s E2B-compatible API with the official E2B Python SDK (`e2b`
from PyPI, the version scripts/test.sh pins), through its public sync API only, as an E2B user
would: `python scenario.py [STEP...]` with E2B_API_URL and E2B_SANDBOX_URL set to the server's
base URL and E2B_API_KEY to "e2b_" + its bearer token.

Every step runs by default, in the order of STEPS; naming some runs only those (in that same
order), to narrow a failure. Each passed step prints `ok: STEP`, the whole run `all ok`; a
failed check is an AssertionError saying what was expected and what came.

The sandbox's home, where commands start and relative paths resolve, is whatever `pwd` says;
E2B_EXPECT_HOME, when set, is what it must be (E2B's /home/user, every template's unless the
operator names another)."""
import os
import json
import posixpath
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone

from e2b import (
    AuthenticationException,
    CommandExitException,
    FileNotFoundException,
    FilesystemEventType,
    FileType,
    PtySize,
    Sandbox,
    SandboxException,
    SandboxNotFoundException,
    SandboxQuery,
    SandboxState,
)

METADATA = {"suite": "e2b"}


class Run:
    """The sandbox the steps share, made on first use and killed at the end (by the lifecycle
    step, or else by `close`)."""

    def __init__(self):
        self._sandbox = None
        self._home = None
        self.killed = False

    @property
    def sandbox(self):
        if self._sandbox is None:
            sb = Sandbox.create(timeout=120, metadata=METADATA, envs={"GREETING": "hi"})
            assert sb.sandbox_id, f"created a sandbox without an id: {sb!r}"
            self._sandbox = sb
            print(f"ok: create ({sb.sandbox_id})", flush=True)
        return self._sandbox

    @property
    def home(self):
        """The sandbox's home: where commands start and relative paths resolve."""
        if self._home is None:
            pwd = self.sandbox.commands.run("pwd").stdout.strip()
            assert pwd.startswith("/"), f"pwd printed {pwd!r}, not an absolute path"
            self._home = pwd
        return self._home

    def close(self):
        if self._sandbox is not None and not self.killed:
            try:
                self._sandbox.kill()
            except Exception as e:  # the run's own failure, if any, is what matters
                print(f"(could not kill {self._sandbox.sandbox_id}: {e!r})", file=sys.stderr)


def expect(exc_type, what, fn, *args, **kwargs):
    """`fn(*args, **kwargs)` must raise `exc_type`; returns the exception."""
    try:
        got = fn(*args, **kwargs)
    except exc_type as e:
        return e
    except Exception as e:
        raise AssertionError(f"{what}: expected {exc_type.__name__}, got {e!r}") from e
    raise AssertionError(f"{what}: expected {exc_type.__name__}, got a result: {got!r}")


def ids(paginator):
    """The ids of every sandbox a `Sandbox.list()` paginator yields, all pages."""
    return [info.sandbox_id for info in listed(paginator)]


def listed(paginator):
    items = []
    while paginator.has_next:
        items.extend(paginator.next_items())
    return items


def step_commands(run):
    """Foreground commands: the sandbox's environment variables, its home, a command's own
    environment and working directory, stdout and stderr apart, a non-zero exit."""
    sb = run.sandbox
    r = sb.commands.run("echo $GREETING; pwd")
    assert r.exit_code == 0, f"exit code {r.exit_code}: {r!r}"
    lines = r.stdout.splitlines()
    assert len(lines) == 2, f"expected two lines (GREETING, pwd), got {r.stdout!r}"
    assert lines[0] == "hi", f"the sandbox's envs= did not reach the command: {r.stdout!r}"
    assert lines[1] == run.home, f"pwd said {lines[1]!r}, then {run.home!r}"
    if os.environ.get("E2B_EXPECT_HOME"):
        # A template with E2B's own home: where programs written for E2B put their files.
        assert run.home == os.environ["E2B_EXPECT_HOME"], f"home {run.home!r}"
        w = sb.files.write(f"{run.home}/e2b-home.txt", "here")
        assert w.path == f"{run.home}/e2b-home.txt", f"{w!r}"
        assert sb.commands.run("cat ~/e2b-home.txt").stdout == "here"

    r = sb.commands.run('echo "$FOO"; pwd', envs={"FOO": "bar"}, cwd="/tmp")
    assert r.stdout == "bar\n/tmp\n", f"envs=/cwd= of the command: {r.stdout!r}"

    out, err = [], []
    r = sb.commands.run(
        "echo out; echo err >&2", on_stdout=out.append, on_stderr=err.append
    )
    assert (r.stdout, r.stderr) == ("out\n", "err\n"), f"stdout/stderr: {r!r}"
    assert ("".join(out), "".join(err)) == ("out\n", "err\n"), f"callbacks: {out!r} {err!r}"

    e = expect(
        CommandExitException, "exit 3", sb.commands.run, "echo oops >&2; exit 3"
    )
    assert e.exit_code == 3, f"exit code {e.exit_code}, not 3: {e!r}"
    assert e.stderr == "oops\n", f"stderr of the failed command: {e.stderr!r}"


def step_files(run):
    """The filesystem: text and bytes in and out, a multi-file upload, listing, existence,
    entry info, directories, renaming, removing, a missing file; and the same files seen by
    commands, relative paths resolving to the same home."""
    files, home = run.sandbox.files, run.home

    w = files.write("hello.txt", "hello e2b\n")
    assert w.name == "hello.txt", f"write returned {w!r}"
    assert w.path == posixpath.join(home, "hello.txt"), f"write returned {w!r} (home {home})"
    assert files.read("hello.txt") == "hello e2b\n"

    # A signed download URL: fetched with no token at all, as a browser would; expired, 401.
    url = run.sandbox.download_url("hello.txt", use_signature_expiration=120)
    with urllib.request.urlopen(url, timeout=30) as resp:
        assert resp.read() == b"hello e2b\n", f"the signed URL {url}"
    expired = run.sandbox.download_url("hello.txt", use_signature_expiration=-120)
    try:
        urllib.request.urlopen(expired, timeout=30)
        raise AssertionError(f"an expired signed URL was served: {expired}")
    except urllib.error.HTTPError as e:
        assert e.code == 401, f"an expired signed URL: {e.code}"

    blob = bytes(range(256))
    files.write("blob.bin", blob)
    got = files.read("blob.bin", format="bytes")
    assert bytes(got) == blob, f"bytes came back as {bytes(got)!r}"

    # Two files in one upload, one of them into a directory that did not exist.
    written = files.write_files(
        [
            {"path": "multi/one.txt", "data": "one"},
            {"path": "multi/two.bin", "data": b"\x00two"},
        ]
    )
    assert sorted(w.name for w in written) == ["one.txt", "two.bin"], f"{written!r}"
    assert files.read("multi/one.txt") == "one"
    assert bytes(files.read("multi/two.bin", format="bytes")) == b"\x00two"

    top = {e.name: e for e in files.list(".")}
    for name in ("hello.txt", "blob.bin", "multi"):
        assert name in top, f"{name} not listed in {sorted(top)}"
    assert top["hello.txt"].type == FileType.FILE, f"{top['hello.txt']!r}"
    assert top["multi"].type == FileType.DIR, f"{top['multi']!r}"
    inner = sorted(e.name for e in files.list("multi"))
    assert inner == ["one.txt", "two.bin"], f"multi/ lists {inner}"

    assert files.exists("hello.txt") is True
    assert files.exists("multi") is True
    assert files.exists("nope.txt") is False

    info = files.get_info("blob.bin")
    assert info.type == FileType.FILE, f"{info!r}"
    assert info.size == 256, f"size {info.size}, not 256: {info!r}"
    assert info.name == "blob.bin", f"{info!r}"
    assert info.path == posixpath.join(home, "blob.bin"), f"{info!r} (home {home})"

    assert files.make_dir("d/e") is True, "make_dir of a new directory"
    assert files.make_dir("d/e") is False, "make_dir of an existing directory"
    assert files.get_info("d/e").type == FileType.DIR

    moved = files.rename("hello.txt", "d/e/moved.txt")
    assert moved.name == "moved.txt", f"rename returned {moved!r}"
    assert moved.path == posixpath.join(home, "d/e/moved.txt"), f"{moved!r}"
    assert files.exists("hello.txt") is False, "the old name is still there"
    assert files.read("d/e/moved.txt") == "hello e2b\n"

    # Commands see what the files API wrote, and the other way round.
    r = run.sandbox.commands.run("cat d/e/moved.txt multi/one.txt")
    assert r.stdout == "hello e2b\none", f"cat saw {r.stdout!r}"
    run.sandbox.commands.run("echo made > made.txt; echo abs > /tmp/abs.txt")
    assert files.read("made.txt") == "made\n"
    assert files.read("/tmp/abs.txt") == "abs\n", "an absolute path"

    files.remove("blob.bin")
    assert files.exists("blob.bin") is False, "a removed file"
    files.remove("d")  # a directory with what is in it
    assert files.exists("d") is False, "a removed directory"

    expect(FileNotFoundException, "reading a missing file", files.read, "missing.txt")


def step_watch(run):
    """A directory of the home watched: the SDK's polled watcher sees a file created and
    written through the file API and removed by a command, a recursive one sees a file in a
    subdirectory; a missing directory is FileNotFound, a file is refused."""
    sb = run.sandbox
    files = sb.files
    d = f"{run.home}/watched"  # the home: the workspace, or its alias
    files.make_dir(f"{d}/sub")

    def seen(handle):
        return {(e.type, e.name) for e in handle.get_new_events()}

    h = files.watch_dir(d)
    files.write(f"{d}/a.txt", "one")
    got = seen(h)
    for want in [(FilesystemEventType.CREATE, "a.txt"), (FilesystemEventType.WRITE, "a.txt")]:
        assert want in got, f"{want} not among {got}"
    r = sb.commands.run(f"mv {d}/a.txt {d}/b.txt && rm {d}/b.txt")  # by code inside
    assert r.exit_code == 0, f"{r!r}"
    got = seen(h)
    for want in [
        (FilesystemEventType.RENAME, "a.txt"),
        (FilesystemEventType.CREATE, "b.txt"),
        (FilesystemEventType.REMOVE, "b.txt"),
    ]:
        assert want in got, f"{want} not among {got}"
    h.stop()

    deep = files.watch_dir(d, recursive=True)
    files.write(f"{d}/sub/c.txt", "two")
    got = seen(deep)
    assert (FilesystemEventType.CREATE, "sub/c.txt") in got, f"recursive: {got}"
    deep.stop()

    expect(FileNotFoundException, "watching a missing directory", files.watch_dir, f"{d}/nope")
    expect(SandboxException, "watching a file", files.watch_dir, f"{d}/sub/c.txt")


def step_network(run):
    """An allow list with a denied host: the sandbox may ask for one name and is refused
    another (nothing leaves this machine: the refused name is never looked up outside); the
    refusal is in the sandbox's log beside its commands (E2B's logs endpoint, which the SDK
    does not wrap: read over HTTP with the API key, as E2B's CLI reads it)."""
    sb = Sandbox.create(
        timeout=120,
        metadata=METADATA,
        network={"allow_out": ["allowed.example"], "deny_out": ["0.0.0.0/0"]},
    )
    try:
        r = sb.commands.run("getent hosts denied.example || echo refused")
        assert r.stdout.strip().endswith("refused"), f"denied.example was resolved: {r!r}"

        def logs(query):
            req = urllib.request.Request(
                f"{os.environ['E2B_API_URL']}/v2/sandboxes/{sb.sandbox_id}/logs?{query}",
                headers={"X-API-Key": os.environ["E2B_API_KEY"]},
            )
            with urllib.request.urlopen(req, timeout=30) as resp:
                return json.load(resp)["logs"]

        warned = logs("level=warn")
        refused = [
            entry
            for entry in warned
            if entry["message"] == "egress refused"
            and entry["fields"].get("host") == "denied.example"
        ]
        assert refused, f"no refusal of denied.example in the log: {warned}"
        assert all(e["level"] in ("warn", "error") for e in warned), f"level=warn: {warned}"
        everything = [e["message"] for e in logs("direction=forward")]
        for want in ["sandbox created", "process started", "process ended", "egress refused"]:
            assert want in everything, f"{want!r} not in the log: {everything}"
        assert everything[0] == "sandbox created", f"not oldest first: {everything}"
    finally:
        sb.kill()


def step_background(run):
    """A background command: listed while it runs, killed, its end an error, then gone."""
    cmds = run.sandbox.commands
    h = cmds.run("sleep 30", background=True)
    assert isinstance(h.pid, int) and h.pid > 0, f"pid {h.pid!r}"
    mine = [p for p in cmds.list() if p.pid == h.pid]
    assert mine, f"pid {h.pid} not in commands.list()"
    assert any("sleep 30" in a for a in [mine[0].cmd, *mine[0].args]), f"{mine[0]!r}"

    assert cmds.kill(h.pid) is True, "kill of a running command"
    e = expect(CommandExitException, "wait for a killed command", h.wait)
    assert e.exit_code != 0, f"{e!r}"
    assert h.pid not in [p.pid for p in cmds.list()], "a killed command is still listed"
    assert cmds.kill(h.pid) is False, "kill of a command that is gone"


def step_stdin(run):
    """A command's stdin: written to, then closed (EOF), the command's output its input."""
    cmds = run.sandbox.commands
    h = cmds.run("cat", background=True, stdin=True)
    cmds.send_stdin(h.pid, "hello\n")
    cmds.close_stdin(h.pid)
    r = h.wait()
    assert r.stdout == "hello\n", f"cat echoed {r.stdout!r}"


def step_connect(run):
    """A background command outlives its stream: disconnected, it keeps running, and a new
    stream to it sees the rest of its output and its end."""
    cmds = run.sandbox.commands
    h = cmds.run("for i in 1 2 3; do echo $i; sleep 1; done", background=True)
    pid = h.pid
    h.disconnect()
    assert pid in [p.pid for p in cmds.list()], "a disconnected command stopped running"
    h2 = cmds.connect(pid)
    assert h2.pid == pid, f"connected to {h2.pid}, not {pid}"
    r = h2.wait()
    assert r.exit_code == 0, f"{r!r}"
    lines = r.stdout.splitlines()
    assert lines and set(lines) <= {"1", "2", "3"} and lines[-1] == "3", f"{r.stdout!r}"


def step_pty(run):
    """A PTY: an interactive shell whose terminal has the size asked for, resized, exiting."""
    sb = run.sandbox
    h = sb.pty.create(PtySize(rows=24, cols=80), timeout=30)
    seen = bytearray()
    resized_at = None
    sb.pty.send_stdin(h.pid, b"stty size\n")
    try:
        for _, _, chunk in h:
            if chunk:
                seen += chunk
            if resized_at is None and b"24 80" in seen:
                sb.pty.resize(h.pid, PtySize(rows=30, cols=100))
                resized_at = len(seen)
                sb.pty.send_stdin(h.pid, b"stty size; exit\n")
    except Exception as e:
        raise AssertionError(f"the PTY's stream ended with {e!r}; it printed {bytes(seen)!r}")
    assert resized_at is not None, f"no '24 80' from stty size: {bytes(seen)!r}"
    assert b"30 100" in seen[resized_at:], f"no '30 100' after resize: {bytes(seen)!r}"
    r = h.wait()
    assert r.exit_code == 0, f"the PTY's shell exited with {r!r}"


def step_lifecycle(run):
    """The sandbox as an API object: listed (with metadata, filtered by it), its timeout set,
    its info, running; connected to; paused and resumed by connecting, its files kept; killed,
    and then not found."""
    sb = run.sandbox
    sid = sb.sandbox_id

    found = [i for i in listed(Sandbox.list()) if i.sandbox_id == sid]
    assert found, f"{sid} not in Sandbox.list()"
    assert found[0].metadata.get("suite") == "e2b", f"listed with {found[0].metadata!r}"
    assert found[0].state == SandboxState.RUNNING, f"listed as {found[0].state!r}"
    assert sid in ids(Sandbox.list(query=SandboxQuery(metadata=METADATA))), "metadata filter"
    other = ids(Sandbox.list(query=SandboxQuery(metadata={"suite": "other"})))
    assert sid not in other, "listed under metadata it does not have"

    sb.set_timeout(60)
    info = sb.get_info()
    assert info.sandbox_id == sid, f"{info!r}"
    assert info.state == SandboxState.RUNNING, f"{info!r}"
    assert info.metadata.get("suite") == "e2b", f"{info!r}"
    assert info.end_at.tzinfo is not None, f"endAt without a time zone: {info.end_at!r}"
    left = (info.end_at - datetime.now(timezone.utc)).total_seconds()
    assert 0 < left <= 65, f"{left:.0f} s left after set_timeout(60): {info!r}"
    assert sb.is_running() is True

    # Connecting to a running sandbox, as from elsewhere: the same one.
    same = Sandbox.connect(sid)
    assert same.sandbox_id == sid
    assert same.commands.run("echo $GREETING").stdout == "hi\n"

    sb.files.write("kept.txt", "kept")
    assert sb.pause() is True, "pause of a running sandbox"
    assert Sandbox.get_info(sid).state == SandboxState.PAUSED
    assert sb.pause() is False, "pause of a paused sandbox"
    resumed = Sandbox.connect(sid)
    assert resumed.sandbox_id == sid
    assert resumed.get_info().state == SandboxState.RUNNING, "connect did not resume it"
    r = resumed.commands.run("cat kept.txt")
    assert r.stdout == "kept", f"after resume: {r.stdout!r}"

    assert resumed.kill() is True, "kill of a sandbox"
    run.killed = True
    expect(SandboxNotFoundException, "get_info of a killed sandbox", Sandbox.get_info, sid)
    expect(SandboxNotFoundException, "connect to a killed sandbox", Sandbox.connect, sid)
    assert Sandbox.kill(sid) is False, "kill of a killed sandbox"
    assert sid not in ids(Sandbox.list()), "a killed sandbox is still listed"


def step_auth(run):
    """Another key (well-formed, not the server's) is refused."""
    key = os.environ["E2B_API_KEY"]
    assert key.startswith("e2b_"), "E2B_API_KEY must be e2b_ + the server's hex token"
    hexdigits = "0123456789abcdef"
    wrong = "e2b_" + "".join(hexdigits[(hexdigits.index(c) + 1) % 16] for c in key[4:])
    try:
        made = Sandbox.create(timeout=30, api_key=wrong)
    except AuthenticationException:
        pass
    else:
        Sandbox.kill(made.sandbox_id)
        raise AssertionError("a sandbox was created with a wrong API key")
    expect(
        AuthenticationException,
        "listing with a wrong API key",
        lambda: Sandbox.list(api_key=wrong).next_items(),
    )


# A WebSocket server's handshake, then an echo of whatever comes: what the forwarding must
# carry is the upgrade and the bytes after it, in both directions.
UPGRADE_ECHO = r"""
import base64, hashlib, socket, threading
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 8002))
s.listen(128)
def serve(c):
    head = b""
    while b"\r\n\r\n" not in head:
        more = c.recv(4096)
        if not more:
            return
        head += more
    key = [l.split(b":", 1)[1].strip() for l in head.split(b"\r\n")
           if l.lower().startswith(b"sec-websocket-key:")][0]
    accept = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
    c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
              b"Connection: Upgrade\r\nSec-WebSocket-Accept: " + accept + b"\r\n\r\n")
    while True:
        b = c.recv(4096)
        if not b:
            return
        c.sendall(b)
def handle(c):
    try:
        serve(c)
    except OSError:
        pass  # a client gone mid-way
    c.close()
while True:
    c, _ = s.accept()
    threading.Thread(target=handle, args=(c,), daemon=True).start()
"""


def upgrade_request(netloc, headers):
    """A WebSocket handshake's request to the server at `netloc`, with `headers` (the ones
    that route it to a sandbox's port)."""
    lines = ["GET /ws HTTP/1.1", f"Host: {netloc}", "Connection: Upgrade",
             "Upgrade: websocket", "Sec-WebSocket-Version: 13",
             "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ=="]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def upgrade_round_trip(base, headers, payload):
    """A WebSocket handshake through the server to the sandbox's port, then `payload` sent
    and read back: (the status line, the bytes echoed)."""
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(base)
    c = socket.create_connection((u.hostname, u.port), timeout=10)
    c.sendall(upgrade_request(u.netloc, headers))
    head = b""
    while b"\r\n\r\n" not in head:
        more = c.recv(4096)
        if not more:
            break
        head += more
    status = head.split(b"\r\n", 1)[0].decode()
    if " 101 " not in status + " ":
        c.close()
        return status, b""
    body = head.split(b"\r\n\r\n", 1)[1]
    c.sendall(payload)
    while len(body) < len(payload):
        more = c.recv(4096)
        if not more:
            break
        body += more
    c.close()
    return status, body


def step_ports(run):
    """A server the sandbox runs, reached the way the SDK reaches envd: the sandbox URL with
    `E2b-Sandbox-Id` and `E2b-Sandbox-Port` naming its port (`get_host`'s port, routed by
    header); a port nothing listens on is a 502 that says so; a WebSocket's upgrade goes
    through, and the bytes after it both ways."""
    import httpx  # a dependency of the SDK

    sb = run.sandbox
    cmds = sb.commands
    run.sandbox.files.write("site/index.html", "served from the sandbox\n")
    h = cmds.run("python3 -m http.server 8000 --bind 127.0.0.1", background=True, cwd="site")
    url = os.environ["E2B_SANDBOX_URL"].rstrip("/") + "/index.html"
    to = {"E2b-Sandbox-Id": sb.sandbox_id, "E2b-Sandbox-Port": "8000"}
    deadline = time.monotonic() + 30
    while True:
        r = httpx.get(url, headers=to, timeout=10)
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert r.status_code == 200, f"port 8000: {r.status_code} {r.text!r}"
    assert r.text == "served from the sandbox\n", f"port 8000 answered {r.text!r}"
    # By host name, as `get_host` names it (`PORT-ID.DOMAIN`), when the server was told the
    # domain (`serve --e2b-domain`, the SDK's E2B_DOMAIN) and a name under it reaches it:
    # here the request goes to the server's address with that host name.
    if os.environ.get("E2B_DOMAIN"):
        host = sb.get_host(8000)
        assert host == f"8000-{sb.sandbox_id}.{os.environ['E2B_DOMAIN']}", host
        r = httpx.get(url, headers={"Host": host}, timeout=10)
        assert r.text == "served from the sandbox\n", f"by host name: {r.status_code} {r.text!r}"
    r = httpx.get(url, headers={**to, "E2b-Sandbox-Port": "8001"}, timeout=10)
    assert r.status_code == 502, f"port 8001 (nothing there): {r.status_code} {r.text!r}"
    assert "8001" in r.json()["message"], f"the 502 does not say which port: {r.text!r}"
    assert cmds.kill(h.pid) is True

    run.sandbox.files.write("upgrade_echo.py", UPGRADE_ECHO)
    ws = cmds.run("python3 upgrade_echo.py", background=True)
    base = os.environ["E2B_SANDBOX_URL"].rstrip("/")
    to = {"E2b-Sandbox-Id": sb.sandbox_id, "E2b-Sandbox-Port": "8002"}
    payload = bytes(range(256)) * 64  # 16 KiB: more than one read each way
    deadline = time.monotonic() + 30
    while True:
        status, echoed = upgrade_round_trip(base, to, payload)
        if " 101 " in status + " " or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert " 101 " in status + " ", f"the upgrade through port 8002: {status!r}"
    assert echoed == payload, f"{len(echoed)} bytes came back of {len(payload)}"
    tunnels_are_bounded(base, to)
    assert cmds.kill(ws.pid) is True
    tunnels_end_with_their_sandbox(base)


def tunnels_end_with_their_sandbox(base):
    """An upgraded connection to a sandbox that is then killed is let go by the server (its
    socket closed, not left half open for a client that never closes), as E2B_SERVER_PID's
    open descriptors show."""
    import socket
    from urllib.parse import urlsplit

    sb = Sandbox.create(timeout=120, metadata=METADATA, allow_internet_access=False)
    try:
        sb.files.write("upgrade_echo.py", UPGRADE_ECHO)
        sb.commands.run("python3 upgrade_echo.py", background=True)
        to = {"E2b-Sandbox-Id": sb.sandbox_id, "E2b-Sandbox-Port": "8002"}
        u = urlsplit(base)
        deadline = time.monotonic() + 30
        while True:
            c = socket.create_connection((u.hostname, u.port), timeout=10)
            c.sendall(upgrade_request(u.netloc, to))
            head = c.recv(4096)
            if head.startswith(b"HTTP/1.1 101") or time.monotonic() > deadline:
                break
            c.close()
            time.sleep(0.2)
        assert head.startswith(b"HTTP/1.1 101"), f"the upgrade: {head[:60]!r}"
    finally:
        sb.kill()
    # The client stays silent; the server must close its side by itself.
    port = c.getsockname()[1]
    deadline = time.monotonic() + 30
    while server_holds(port) and time.monotonic() < deadline:
        time.sleep(0.2)
    held = server_holds(port)
    c.close()
    assert not held, "the server still holds the upgraded connection of a killed sandbox"


def server_holds(client_port):
    """Whether the server (E2B_SERVER_PID) has a socket open to `client_port` on this host."""
    pid = os.environ["E2B_SERVER_PID"]
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if int(cols[2].rsplit(":", 1)[1], 16) == client_port and cols[9] != "0":
                    inodes.add(f"socket:[{cols[9]}]")
    fds = f"/proc/{pid}/fd"
    for fd in os.listdir(fds):
        try:
            if os.readlink(f"{fds}/{fd}") in inodes:
                return True
        except OSError:
            pass  # closed meanwhile
    return False


def tunnels_are_bounded(base, to):
    """A client holding 64 upgraded connections open gets a 429 for the next, and its
    places back once it lets them go."""
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(base)
    head = upgrade_request(u.netloc, to)

    def answer(c):
        got = b""
        while b"\r\n\r\n" not in got:
            more = c.recv(4096)
            assert more, f"an upgrade closed before its answer: {got!r}"
            got += more
        return got

    # One at a time, each answered before the next: a place an earlier connection held is
    # given back by the server a moment after its client closed, so a 429 before the 64th
    # means "not yet": all of them again, until a deadline.
    held = []
    try:
        deadline = time.monotonic() + 30
        while True:
            for c in held:
                c.close()
            held, got = [], b""
            for _ in range(64):
                c = socket.create_connection((u.hostname, u.port), timeout=10)
                c.sendall(head)
                held.append(c)
                got = answer(c)
                if not got.startswith(b"HTTP/1.1 101"):
                    break
            if got.startswith(b"HTTP/1.1 101") or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert got.startswith(b"HTTP/1.1 101"), f"upgrade {len(held)} of 64: {got[:40]!r}"
        status, _ = upgrade_round_trip(base, to, b"x")
        assert " 429 " in status + " ", f"a 65th upgrade: {status!r}"
    finally:
        for c in held:
            c.close()
    deadline = time.monotonic() + 30
    while True:
        status, echoed = upgrade_round_trip(base, to, b"again")
        if echoed == b"again" or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert echoed == b"again", f"after the 64 closed: {status!r} {echoed!r}"


def step_snapshots(run):
    """A snapshot restored as a template, then forked twice: each sandbox starts with the
    files of the moment it was taken and goes its own way. (A sandbox of its own, with the
    internet off: a tier may refuse to checkpoint one with a network path out.)"""
    sb = Sandbox.create(
        timeout=120,
        allow_internet_access=False,
        metadata=METADATA,
        network={"allow_public_traffic": False},
    )
    assert sb.traffic_access_token, "a private sandbox without a traffic token"
    made = []
    try:
        sb.files.write("state.txt", "before")
        snap = sb.create_snapshot()
        assert snap.snapshot_id, f"snapshot without an id: {snap!r}"
        listed = [s.snapshot_id for s in Sandbox.list_snapshots().next_items()]
        assert snap.snapshot_id in listed, f"{snap.snapshot_id} not in {listed}"
        sb.files.write("state.txt", "after")
        restored = Sandbox.create(snap.snapshot_id, timeout=60)
        made.append(restored)
        assert restored.files.read("state.txt") == "before", "the restored sandbox's file"
        forks = sb.fork(count=2)
        made.extend(forks)
        assert len(forks) == 2, f"fork(count=2) made {forks!r}"
        # Forks are as private as their source; a create from the snapshot is as asked.
        assert all(f.traffic_access_token for f in forks), "a fork of a private sandbox is public"
        assert restored.traffic_access_token is None, "a public create got a traffic token"
        assert len({f.sandbox_id for f in forks} | {sb.sandbox_id}) == 3, "fork ids"
        forks[0].files.write("state.txt", "changed in fork 0")
        assert forks[1].files.read("state.txt") == "after", "a fork saw another's write"
        assert sb.files.read("state.txt") == "after", "the original saw a fork's write"
        assert Sandbox.delete_snapshot(snap.snapshot_id) is True
        assert Sandbox.delete_snapshot(snap.snapshot_id) is False, "deleted twice"
    finally:
        for s in made + [sb]:
            s.kill()


def step_metrics(run):
    """Metrics from the tier's own accounting, where it has them (E2B_EXPECT_METRICS=1):
    CPU, memory against the limit, disk of the home's file system; elsewhere a clear 501."""
    from e2b import SandboxException

    sb = run.sandbox
    if os.environ.get("E2B_EXPECT_METRICS") != "1":
        try:
            sb.get_metrics()
        except SandboxException as e:
            assert "501" in str(e) and "usage" in str(e), f"not a clear 501: {e}"
            return
        raise AssertionError("metrics came from a tier said to have none")
    sb.files.write("metrics.bin", b"m" * 200_000)
    sb.commands.run("i=0; while [ $i -lt 50000 ]; do i=$((i+1)); done")
    ms = sb.get_metrics()
    assert ms, "no metrics"
    m = ms[-1]
    assert m.cpu_count >= 1, f"{m!r}"
    assert 0 <= m.cpu_used_pct <= 100, f"{m!r}"
    assert 0 < m.mem_used <= m.mem_total, f"{m!r}"
    assert 0 < m.disk_used <= m.disk_total, f"{m!r}"
    # A second sample: both are kept, in order.
    later = sb.get_metrics()
    assert len(later) >= 2 and later[-1].timestamp >= later[-2].timestamp, f"{later!r}"


STEPS = {
    "commands": step_commands,
    "files": step_files,
    "watch": step_watch,
    "background": step_background,
    "stdin": step_stdin,
    "connect": step_connect,
    "pty": step_pty,
    "ports": step_ports,
    "metrics": step_metrics,
    "network": step_network,
    "snapshots": step_snapshots,
    "lifecycle": step_lifecycle,  # kills the shared sandbox: last of those that use it
    "auth": step_auth,
}


def main(argv):
    unknown = [a for a in argv if a not in STEPS]
    if unknown:
        sys.exit(f"unknown step(s) {unknown}; the steps: {' '.join(STEPS)}")
    for var in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY"):
        assert os.environ.get(var), f"{var} is not set"
    chosen = [name for name in STEPS if not argv or name in argv]
    run = Run()
    try:
        for name in chosen:
            STEPS[name](run)
            print(f"ok: {name}", flush=True)
    finally:
        run.close()
    print("all ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

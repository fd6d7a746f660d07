# The Python driver of an interpreter context on the process tiers (container, gVisor,
# microVM): one long-lived `python3` per context, run after the shared cell code
# (PYTHON_CELLS; see interpreter/mod.rs). The host writes one JSON request a line on the
# driver's stdin, which the driver keeps to itself (the cells' stdin is /dev/null). The
# cells' stdout and stderr stay the process's own, so programs a cell starts write there
# too; the driver's frames go on the same streams, each line `MARK + JSON + "\n"`, with
# the mark the host chose. After each cell: a `done` frame on both streams, so the host
# knows both are drained.
def __agent_sandbox_main():
    import ast, builtins, json, linecache, os, signal, sys, warnings

    control = os.fdopen(os.dup(0), "rb", buffering=0)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    # Whole lines reach the host as one chunk each (and everything at a cell's end).
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    hello = json.loads(control.readline())
    MARK = hello["mark"].encode("ascii")
    state = {"left": 0}

    def frame(fd, obj):
        data = MARK + json.dumps(obj).encode("ascii") + b"\n"
        while data:
            data = data[os.write(fd, data):]

    def send(kind, obj):
        """One frame on stdout; False once the cell's output budget is spent."""
        sys.stdout.flush()
        obj["t"] = kind
        size = len(json.dumps(obj))
        if size > state["left"]:
            state["left"] = 0
            return False
        state["left"] -= size
        frame(1, obj)
        return True

    cells = __agent_sandbox_cells(send)
    builtins.display = cells.display
    module = type(sys)("_agent_sandbox")
    module.display = cells.display
    sys.modules["_agent_sandbox"] = module
    warnings.filterwarnings("ignore", message=".*(non-GUI backend|non-interactive).*")
    os.environ.setdefault("MPLBACKEND", "Agg")
    cwd = hello.get("cwd")
    if cwd:
        os.chdir(cwd)
    glob = {"__name__": "__main__", "__builtins__": builtins}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    frame(1, {"t": "ready", "version": sys.version.split()[0]})

    def system(command):
        """A shell line (`!ls`, as in IPython): its output is the cell's."""
        import subprocess

        sys.stdout.flush()
        sys.stderr.flush()
        subprocess.run(command, shell=True)

    module.system = system

    def parse(code, name):
        """The cell as Python; lines starting with `!` run in the shell, as IPython's do
        (only in cells that are not Python without them)."""
        try:
            return ast.parse(code, name, "exec")
        except SyntaxError as first:
            lines, shell = [], False
            for line in code.splitlines():
                body = line.lstrip()
                if body.startswith("!"):
                    indent = line[: len(line) - len(body)]
                    line = "%s__import__('_agent_sandbox').system(%r)" % (indent, body[1:])
                    shell = True
                lines.append(line)
            if not shell:
                raise
            try:
                return ast.parse("\n".join(lines), name, "exec")
            except SyntaxError:
                raise first from None

    def run(count, code, env, saved):
        name = "<cell-%d>" % count
        linecache.cache[name] = (len(code), None, code.splitlines(True), name)
        try:
            for k, v in env.items():
                saved.setdefault(k, os.environ.get(k))
                os.environ[k] = v
            tree = parse(code, name)
            last = None
            if tree.body and isinstance(tree.body[-1], ast.Expr):
                last = ast.Expression(tree.body.pop().value)
            exec(compile(tree, name, "exec"), glob)
            if last is not None:
                value = eval(compile(last, name, "eval"), glob)
                if value is not None:
                    glob["_"] = value
                    cells.result(value)
        except BaseException as e:
            tb = e.__traceback__
            # The driver's own frames are not the cell's.
            while tb is not None and not tb.tb_frame.f_code.co_filename.startswith("<cell-"):
                tb = tb.tb_next
            cells.error(type(e), e, tb)
            import traceback

            sys.stderr.write("".join(traceback.format_exception(type(e), e, tb)))

    while True:
        try:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
            line = control.readline()
            if not line:
                break
            req = json.loads(line)
            count, code = int(req["n"]), str(req["code"])
            env = {str(k): str(v) for k, v in dict(req.get("env") or {}).items()}
            state["left"] = int(req.get("cap", 1 << 20))
        except (KeyboardInterrupt, ValueError, KeyError, TypeError):
            continue
        saved = {}
        try:
            run(count, code, env, saved)
            cells.flush()
        except BaseException:
            pass
        finally:
            # An interrupt now would cut the frames short: it waits for the next read.
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            for k, v in saved.items():
                try:
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
                except Exception:
                    pass
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            except BaseException:
                pass
            frame(2, {"t": "done", "n": count})
            frame(1, {"t": "done", "n": count})


__agent_sandbox_main()

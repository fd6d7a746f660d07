"""One long-lived client of E2B's official Python SDK (`e2b`), driven by benches/server.rs so
that the interpreter's start and the SDK's import are not what is timed.

Reads one command a line on stdin and answers one line each on stdout, `ok ...` or
`err WHAT`:

    ping                         ok                      (the pipe's own round trip)
    lifecycle TEMPLATE INTERNET  ok CREATE RUN KILL CPU  create + commands.run("true") + kill
    create TEMPLATE INTERNET     ok ID CREATE            Sandbox.create, kept for run and kill
    run                          ok RUN CPU              commands.run("true") on the kept one
    kill                         ok KILL                 kill of the kept sandbox

INTERNET is `internet` (the SDK's default, `allow_internet_access=True`) or `nointernet`
(`allow_internet_access=False`: no network, the v1 API's default). The numbers are each
call's own time inside Python, in microseconds (`time.perf_counter_ns`), to tell where a
round trip is spent; CPU is the CPU time this process spent on the whole command (all its
threads, the SDK's HTTP transport's included: `time.process_time_ns`).

E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY point the SDK at the server, as they point it
at a self-hosted E2B."""
import sys
import time

from e2b import Sandbox


def us(ns):
    return str(ns // 1000)


def create(template, internet):
    if internet not in ("internet", "nointernet"):
        raise ValueError(f"INTERNET is `internet` or `nointernet`, not {internet!r}")
    return Sandbox.create(template, allow_internet_access=internet == "internet")


def run(sb):
    r = sb.commands.run("true")
    if r.exit_code != 0:
        raise RuntimeError(f"`true` exited {r.exit_code}: {r!r}")


def main():
    kept = None
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        try:
            cmd, args = words[0], words[1:]
            if cmd == "ping":
                reply = "ok"
            elif cmd == "lifecycle":
                c0 = time.process_time_ns()
                t0 = time.perf_counter_ns()
                sb = create(*args)
                t1 = time.perf_counter_ns()
                try:
                    run(sb)
                    t2 = time.perf_counter_ns()
                finally:
                    sb.kill()
                t3 = time.perf_counter_ns()
                cpu = time.process_time_ns() - c0
                reply = f"ok {us(t1 - t0)} {us(t2 - t1)} {us(t3 - t2)} {us(cpu)}"
            elif cmd == "create":
                if kept is not None:
                    raise RuntimeError("a sandbox is kept already: `kill` it first")
                t0 = time.perf_counter_ns()
                kept = create(*args)
                reply = f"ok {kept.sandbox_id} {us(time.perf_counter_ns() - t0)}"
            elif cmd == "run":
                if kept is None:
                    raise RuntimeError("no sandbox kept: `create` one first")
                c0 = time.process_time_ns()
                t0 = time.perf_counter_ns()
                run(kept)
                t1 = time.perf_counter_ns()
                reply = f"ok {us(t1 - t0)} {us(time.process_time_ns() - c0)}"
            elif cmd == "kill":
                if kept is None:
                    raise RuntimeError("no sandbox kept: `create` one first")
                sb, kept = kept, None
                t0 = time.perf_counter_ns()
                sb.kill()
                reply = f"ok {us(time.perf_counter_ns() - t0)}"
            else:
                raise ValueError(f"unknown command {cmd!r}")
        except Exception as e:  # the bench says what failed; the worker goes on
            reply = "err " + " ".join(f"{type(e).__name__}: {e}".split())
        out.write(reply + "\n")
        out.flush()
    if kept is not None:
        kept.kill()


if __name__ == "__main__":
    main()

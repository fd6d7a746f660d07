#!/usr/bin/env bash
# The microVM tier, end to end, on a host whose KVM can boot Linux (hardware virtualization):
# installs what it needs, runs the Linux-guest suites through our own VMM and prints one
# summary of the tier's figures beside Firecracker's published ones.
#
#   sudo scripts/kvm-proof.sh            # as root: KVM, network namespaces, nftables
#
# 1. asks the probe first: where Linux guests cannot boot (no /dev/kvm, or nested KVM that
#    emulates guest kernel mode, as on the machine this project is developed on) it stops
#    with the probe's reason and exit code 2, before building anything else;
# 2. installs the Debian packages the suites use and the guest (Debian's kernel + our
#    initramfs) into $MICROVM_GUEST_DIR;
# 3. runs tests/linux_guest.rs and tests/backend.rs of backend-microvm (the full-path tests:
#    boot, exec, env, secrets, files, limits, snapshot/restore, an image's Python, teardown,
#    the network through the real egress enforcer, a published port, starts from the boot
#    snapshot), the microVM rows of the egress table (agent-sandbox/tests/egress.rs, from the
#    Python image scripts/test-image.sh builds) and the microVM column of the conformance
#    suite;
# 4. runs the proof harness (backend-microvm/examples/kvm_proof.rs): boot to agent ready,
#    start from the boot snapshot to the first command's output, exec round trip, restore to
#    the first command's output, memory per live sandbox.
#
# Written to finish well inside 8 minutes on a 16-core machine with a warm cargo cache
# (a cold release build of the workspace's microVM parts is the longest step).
set -euo pipefail
cd "$(dirname "$0")/.."

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/tmp/agent-sandbox-target}"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
export MICROVM_GUEST_DIR="${MICROVM_GUEST_DIR:-/var/tmp/agent-sandbox-kvm-proof-guest}"
step() { printf '\n==> %s\n' "$*"; }
start=$(date +%s)

step "probe (does this host's KVM boot Linux guests?)"
set +e
cargo run --release --locked -q -p backend-microvm --example kvm_proof -- --check
probe=$?
set -e
if [ "$probe" -ne 0 ]; then
  echo "kvm-proof: stopped: the microVM tier's Linux-guest path cannot run on this host" >&2
  exit "$probe"
fi

if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
  step "packages"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends \
    busybox-static iproute2 nftables gcc e2fsprogs python3 mmdebstrap >/dev/null
fi

step "the guest in $MICROVM_GUEST_DIR"
cargo run --release --locked -q -p agent-sandbox-cli -- install microvm-guest --dir "$MICROVM_GUEST_DIR"

step "the Python test image (for the egress table and the secrets test)"
scripts/test-image.sh

step "Linux-guest suites through our VMM"
cargo test --release --locked -p backend-microvm --test linux_guest --test backend -- --test-threads=1
step "egress table, microVM rows"
cargo test --release --locked -p agent-sandbox --test egress microvm -- --test-threads=1
step "proxy-held secrets, microVM"
cargo test --release --locked -p agent-sandbox --test secrets microvm -- --test-threads=1
step "conformance, microVM column"
cargo test --release --locked -p sandbox-conformance --test tiers microvm

step "figures"
cargo run --release --locked -q -p backend-microvm --example kvm_proof -- --guest-dir "$MICROVM_GUEST_DIR"
echo
echo "kvm-proof: done in $(( $(date +%s) - start )) s"

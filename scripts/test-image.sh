#!/usr/bin/env bash
# Builds, once, the real Debian userland the image tests and benchmarks use: bookworm
# `minbase` plus python3 (mmdebstrap, from Debian's mirror), wrapped as a one-layer OCI image
# layout tagged `python3` in $AGENT_SANDBOX_TEST_IMAGES (default /var/tmp/agent-sandbox-images,
# outside the clone so CI builds it once per machine). Prints the layout's path.
set -euo pipefail
dir="${AGENT_SANDBOX_TEST_IMAGES:-/var/tmp/agent-sandbox-images}"
out="$dir/debian-python3"
if [ ! -f "$out/index.json" ]; then
  mkdir -p "$dir"
  tar="$dir/debian-python3.tar"
  if [ ! -f "$tar" ]; then
    mmdebstrap --quiet --variant=minbase --include=python3 bookworm "$tar.tmp" >&2
    mv "$tar.tmp" "$tar"
  fi
  rm -rf "$out.tmp"
  python3 "$(dirname "$0")/oci-from-rootfs.py" "$tar" "$out.tmp" python3 python3
  mv "$out.tmp" "$out"
fi
echo "$out"

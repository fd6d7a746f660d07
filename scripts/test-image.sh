#!/usr/bin/env bash
# Builds, once, the real Debian userland the image tests and benchmarks use: trixie (Debian 13)
# `minbase` plus python3 (3.13, where the host has 3.11), made by mmdebstrap from Debian's
# mirror (~15 s) and wrapped as a one-layer OCI image
# layout tagged `python3` in $AGENT_SANDBOX_TEST_IMAGES (default /var/tmp/agent-sandbox-images,
# outside the clone so CI builds it once per machine). Prints the layout's path.
set -euo pipefail
dir="${AGENT_SANDBOX_TEST_IMAGES:-/var/tmp/agent-sandbox-images}"
out="$dir/trixie-python3"
if [ ! -f "$out/index.json" ]; then
  mkdir -p "$dir"
  tar="$dir/trixie-python3.tar"
  if [ ! -f "$tar" ]; then
    # mmdebstrap picks the output format from the file name: keep the `.tar`.
    mmdebstrap --quiet --variant=minbase --include=python3 trixie "$dir/partial.tar" >&2
    mv "$dir/partial.tar" "$tar"
  fi
  rm -rf "$out.tmp"
  python3 "$(dirname "$0")/oci-from-rootfs.py" "$tar" "$out.tmp" python3 python3
  mv "$out.tmp" "$out"
fi
echo "$out"

#!/usr/bin/env bash
# Builds, once, the real Debian userland the image tests, the image_python example and the
# benchmarks use: trixie (Debian 13) `minbase` plus python3 (3.13, where the host has 3.11)
# and numpy (which the host lacks), made by mmdebstrap from Debian's mirror (~20 s), wrapped as
# a one-layer OCI image layout tagged `python3` in $AGENT_SANDBOX_TEST_IMAGES (default
# /var/tmp/agent-sandbox-images, outside the clone so a CI machine builds it once). Prints
# the layout's path.
set -euo pipefail
dir="${AGENT_SANDBOX_TEST_IMAGES:-/var/tmp/agent-sandbox-images}"
out="$dir/trixie-numpy"
# Another user (root) built it: read theirs; else a user other than root builds their own.
if [ -z "${AGENT_SANDBOX_TEST_IMAGES:-}" ] && [ ! -f "$out/index.json" ] && [ "$(id -u)" -ne 0 ]; then
  dir="$dir-$(id -un)"
  out="$dir/trixie-numpy"
fi
if [ ! -f "$out/index.json" ]; then
  mkdir -p "$dir"
  tar="$dir/trixie-numpy.tar"
  if [ ! -f "$tar" ]; then
    # mmdebstrap picks the output format from the file name: keep the `.tar`.
    mmdebstrap --quiet --variant=minbase --include=python3,python3-numpy trixie "$dir/partial.tar" >&2
    mv "$dir/partial.tar" "$tar"
  fi
  rm -rf "$out.tmp"
  python3 "$(dirname "$0")/oci-from-rootfs.py" "$tar" "$out.tmp" python3 python3
  mv "$out.tmp" "$out"
fi
echo "$out"

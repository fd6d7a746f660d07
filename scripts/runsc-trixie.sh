#!/usr/bin/env bash
# Debian 13's runsc (a 2024 release, with the systrap platform), for the gVisor suites that run
# against a newer runsc than Debian 12's. Prints the directory that holds its `runsc`.
#
# Verified as apt would: trixie's InRelease against the Debian archive keyring (gpgv), the
# package index against InRelease's SHA-256, the package against the index's. Unpacked once
# into $AGENT_SANDBOX_RUNSC_CACHE (default /var/tmp/agent-sandbox-runsc/VERSION), outside
# the clone; a cached copy is used without the network.
set -euo pipefail

cache=${AGENT_SANDBOX_RUNSC_CACHE:-/var/tmp/agent-sandbox-runsc}
mirror=${AGENT_SANDBOX_DEBIAN_MIRROR:-http://deb.debian.org/debian}
keyring=/usr/share/keyrings/debian-archive-keyring.gpg

cached=$(ls -d "$cache"/*/usr/bin/runsc 2>/dev/null | sort | tail -n 1 || true)
if [ -n "$cached" ] && [ -x "$cached" ]; then
  dirname "$cached"
  exit 0
fi

mkdir -p "$cache"
tmp=$(mktemp -d "$cache/.fetch.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

curl -fsSL -m 120 -o "$tmp/InRelease" "$mirror/dists/trixie/InRelease"
gpgv --keyring "$keyring" --output "$tmp/Release" "$tmp/InRelease" 2>/dev/null \
  || { echo "trixie's InRelease: bad signature" >&2; exit 1; }

# The SHA-256 section's line for the amd64 index: " <sha256> <size> main/binary-amd64/Packages.xz".
index_sum=$(awk '/^SHA256:/ { in_sha = 1; next } /^[^ ]/ { in_sha = 0 }
  in_sha && $3 == "main/binary-amd64/Packages.xz" { print $1 }' "$tmp/Release")
[ -n "$index_sum" ] || { echo "no amd64 index in trixie's Release" >&2; exit 1; }
curl -fsSL -m 300 -o "$tmp/Packages.xz" "$mirror/dists/trixie/main/binary-amd64/Packages.xz"
echo "$index_sum  $tmp/Packages.xz" | sha256sum -c --status \
  || { echo "trixie's package index: checksum mismatch" >&2; exit 1; }

# awk reads the whole index (an early exit would fail the pipe under pipefail).
stanza=$(xz -dc "$tmp/Packages.xz" | awk '/^Package: runsc$/ && !seen { on = seen = 1 } on && /^$/ { on = 0 } on')
version=$(sed -n 's/^Version: //p' <<<"$stanza")
file=$(sed -n 's/^Filename: //p' <<<"$stanza")
sum=$(sed -n 's/^SHA256: //p' <<<"$stanza")
[ -n "$version" ] && [ -n "$file" ] && [ -n "$sum" ] \
  || { echo "no runsc in trixie's index" >&2; exit 1; }
case $file in pool/*.deb) ;; *) echo "unexpected runsc path $file" >&2; exit 1 ;; esac

curl -fsSL -m 300 -o "$tmp/runsc.deb" "$mirror/$file"
echo "$sum  $tmp/runsc.deb" | sha256sum -c --status \
  || { echo "$file: checksum mismatch" >&2; exit 1; }
dpkg-deb -x "$tmp/runsc.deb" "$tmp/root"
[ -x "$tmp/root/usr/bin/runsc" ] || { echo "$file has no usr/bin/runsc" >&2; exit 1; }

dest="$cache/${version//[^A-Za-z0-9.+~-]/_}"
rm -rf "$dest"
mv "$tmp/root" "$dest"
echo "$dest/usr/bin"

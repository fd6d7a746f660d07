#!/usr/bin/env bash
# Debian 13's runsc (a 2024 release, with the systrap platform), for the gVisor suites that run
# against a newer runsc than Debian 12's. Prints the directory that holds its `runsc`.
#
# Verified as apt would: trixie's InRelease against the Debian archive keyring (gpgv: at
# least one good signature by a key of that keyring, none bad, so a key newer than the
# keyring does not fail it), the package index against InRelease's SHA-256, the package
# against the index's. Unpacked once into $AGENT_SANDBOX_RUNSC_CACHE (default
# /var/tmp/agent-sandbox-runsc/VERSION), outside the clone, and used from there without the
# network, but only from a directory this user owns that nobody else can write (it is run
# as root: a world-writable /var/tmp must not hand it someone else's binary).
set -euo pipefail

cache=${AGENT_SANDBOX_RUNSC_CACHE:-/var/tmp/agent-sandbox-runsc}
mirror=${AGENT_SANDBOX_DEBIAN_MIRROR:-http://deb.debian.org/debian}
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
arch=$(dpkg --print-architecture)

# The cache and everything in it that we run: ours, and writable by us alone.
private() { # path: fails unless owned by this user and not writable by group or others
  [ -O "$1" ] && [ -z "$(find "$1" -maxdepth 0 -perm /022)" ]
}
(umask 022 && mkdir -p "$cache") 2>/dev/null || true
if ! { [ -d "$cache" ] && private "$cache"; }; then
  # Someone else's (or shared): never run from it; a cache of this user's own instead.
  echo "$cache is not this user's alone: using ~/.cache/agent-sandbox/runsc" >&2
  cache=$HOME/.cache/agent-sandbox/runsc
  (umask 077 && mkdir -p "$cache")
  private "$cache" || { echo "$cache is not this user's alone either" >&2; exit 1; }
fi
exec 9>"$cache/.lock"
flock -w 900 9 || { echo "$cache: another fetch holds its lock" >&2; exit 1; }

cached=$(ls -d "$cache"/*/usr/bin/runsc 2>/dev/null | sort | tail -n 1 || true)
if [ -n "$cached" ] && [ -x "$cached" ]; then
  entry=${cached%/usr/bin/runsc}
  for p in "$entry" "$entry/usr" "$entry/usr/bin" "$cached"; do
    private "$p" || { echo "$p is not this user's alone: refusing to run it" >&2; exit 1; }
  done
  dirname "$cached"
  exit 0
fi

tmp=$(mktemp -d "$cache/.fetch.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

fetch() { curl -fsSL --retry 3 --retry-all-errors --retry-delay 2 -m 300 -o "$1" "$2"; }
fetch "$tmp/InRelease" "$mirror/dists/trixie/InRelease"
status=$(gpgv --status-fd 1 --keyring "$keyring" --output "$tmp/Release" "$tmp/InRelease" \
  2>/dev/null || true)
if ! grep -q '^\[GNUPG:\] VALIDSIG ' <<<"$status" || grep -q '^\[GNUPG:\] BADSIG ' <<<"$status"; then
  echo "trixie's InRelease: no good signature by Debian's archive keys" >&2
  exit 1
fi
grep -qx 'Codename: trixie' "$tmp/Release" || { echo "InRelease is not trixie's" >&2; exit 1; }

# The SHA-256 section's line for this architecture's index:
# " <sha256> <size> main/binary-ARCH/Packages.xz".
index="main/binary-$arch/Packages.xz"
index_sum=$(awk -v index_path="$index" '/^SHA256:/ { in_sha = 1; next } /^[^ ]/ { in_sha = 0 }
  in_sha && $3 == index_path { print $1 }' "$tmp/Release")
[ -n "$index_sum" ] || { echo "no $arch index in trixie's Release" >&2; exit 1; }
fetch "$tmp/Packages.xz" "$mirror/dists/trixie/$index"
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

fetch "$tmp/runsc.deb" "$mirror/$file"
echo "$sum  $tmp/runsc.deb" | sha256sum -c --status \
  || { echo "$file: checksum mismatch" >&2; exit 1; }
dpkg-deb -x "$tmp/runsc.deb" "$tmp/root"
[ -x "$tmp/root/usr/bin/runsc" ] || { echo "$file has no usr/bin/runsc" >&2; exit 1; }

dest="$cache/${version//[^A-Za-z0-9.+~-]/_}"
rm -rf "$dest"
mv "$tmp/root" "$dest"
echo "$dest/usr/bin"

#!/usr/bin/env python3
"""Wraps a root filesystem tarball (mmdebstrap, debootstrap + tar) into a one-layer OCI image
layout, the way `docker import` would: usage oci-from-rootfs.py ROOTFS.tar OUT_DIR TAG [CMD...]

Used by scripts/test-image.sh to give the image tests and benchmarks a real Debian userland.
"""
import gzip
import hashlib
import json
import os
import shutil
import sys


def main() -> None:
    src, out, tag, *cmd = sys.argv[1:]
    os.makedirs(os.path.join(out, "blobs", "sha256"), exist_ok=True)

    def put(data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        with open(os.path.join(out, "blobs", "sha256", digest), "wb") as f:
            f.write(data)
        return "sha256:" + digest

    diff = hashlib.sha256()
    tmp = os.path.join(out, "layer.tmp")
    with open(src, "rb") as f, open(tmp, "wb") as raw:
        with gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6, mtime=0) as gz:
            while chunk := f.read(1 << 20):
                diff.update(chunk)
                gz.write(chunk)
    blob = hashlib.sha256()
    with open(tmp, "rb") as f:
        while chunk := f.read(1 << 20):
            blob.update(chunk)
    layer_digest = "sha256:" + blob.hexdigest()
    shutil.move(tmp, os.path.join(out, "blobs", "sha256", blob.hexdigest()))
    config = json.dumps({
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                    "LANG=C.UTF-8"],
            "Cmd": cmd or ["/bin/sh"],
        },
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + diff.hexdigest()]},
    }).encode()
    manifest = json.dumps({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": put(config), "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": layer_digest,
                    "size": os.path.getsize(os.path.join(out, "blobs", "sha256", blob.hexdigest()))}],
    }).encode()
    index = {"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "digest": put(manifest), "size": len(manifest),
        "annotations": {"org.opencontainers.image.ref.name": tag},
    }]}
    with open(os.path.join(out, "index.json"), "w") as f:
        json.dump(index, f)
    with open(os.path.join(out, "oci-layout"), "w") as f:
        json.dump({"imageLayoutVersion": "1.0.0"}, f)


if __name__ == "__main__":
    main()

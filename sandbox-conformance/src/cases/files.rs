//! The file API, path escapes and snapshots.

use sandbox_core::{
    EntryKind, Error, ExecRequest, MapSecretSource, ObjectSnapshotStore, ResolvedSecrets, Sandbox,
};

use super::{expect, run};
use crate::{variant, Checked, Ctx, Need, SECRET_NAME, SECRET_VALUE};

/// Bytes of every value, a few times over.
fn binary() -> Vec<u8> {
    (0..1024u32).map(|i| (i % 256) as u8).collect()
}

fn names(entries: &[sandbox_core::DirEntry]) -> Vec<String> {
    entries.iter().map(|e| e.name.clone()).collect()
}

/// Waits (up to 60 s) until `w` has reported every `(kind, path)` of `want`.
async fn await_events(
    w: &mut sandbox_core::Watch,
    want: &[(sandbox_core::FsEventKind, &str)],
) -> Checked {
    let mut seen = Vec::new();
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(60);
    while !want.iter().all(|(k, p)| {
        seen.iter()
            .any(|e: &sandbox_core::FsEvent| e.kind == *k && e.path == *p)
    }) {
        match tokio::time::timeout_at(deadline, w.next()).await {
            Ok(Some(Ok(ev))) => seen.push(ev),
            Ok(other) => return Err(format!("watch: {other:?} after {seen:?}, wanted {want:?}")),
            Err(_) => return Err(format!("watch: only {seen:?} within 60 s, wanted {want:?}")),
        }
    }
    Ok(())
}

pub(super) async fn watch(cx: &Ctx<'_>) -> Checked {
    use sandbox_core::FsEventKind::{Create, Remove, Write};
    let sb = cx.create(cx.spec()).await?;
    let r = async {
        if !cx.caps.watch {
            return expect_unsupported("watch", sb.watch("", false).await);
        }
        sb.write_file("w/sub/keep", b"")
            .await
            .map_err(|e| format!("write_file: {e}"))?;
        let mut flat = sb
            .watch("w", false)
            .await
            .map_err(|e| format!("watch w: {e}"))?;
        let mut deep = sb
            .watch("/workspace/w", true)
            .await
            .map_err(|e| format!("watch /workspace/w, recursive: {e}"))?;
        // Changed by code inside, as agents do (relative paths: the working directory is
        // the workspace in every tier, the unisolated one included).
        let code = cx.code(
            "echo hi > w/new.txt && echo there > w/sub/deep.txt \
             && rm w/new.txt",
            "import os\nopen('w/new.txt', 'w').write('hi')\n\
             open('w/sub/deep.txt', 'w').write('there')\n\
             os.remove('w/new.txt')",
        );
        let r = sb
            .exec(ExecRequest::code(code))
            .await
            .map_err(|e| format!("exec: {e}"))?;
        if r.exit_code != Some(0) {
            return Err(format!("the writes failed: {r:?}"));
        }
        await_events(
            &mut flat,
            &[(Create, "new.txt"), (Write, "new.txt"), (Remove, "new.txt")],
        )
        .await?;
        await_events(&mut deep, &[(Create, "new.txt"), (Create, "sub/deep.txt")]).await?;
        if let Some(e) = flat
            .try_events()
            .map_err(|e| format!("try_events: {e}"))?
            .iter()
            .find(|e| e.path.contains('/'))
        {
            return Err(format!("a watch that is not recursive reported {e:?}"));
        }
        for p in ["../x", "/etc", "w/missing"] {
            match sb.watch(p, false).await {
                Err(Error::PathEscape { .. } | Error::NotFound { .. }) => {}
                other => {
                    return Err(format!(
                        "watch {p}: {:?}, not PathEscape/NotFound",
                        other.map(|_| ())
                    ))
                }
            }
        }
        sb.destroy().await.map_err(|e| format!("destroy: {e}"))?;
        match tokio::time::timeout(std::time::Duration::from_secs(60), async {
            while let Some(Ok(_)) = flat.next().await {}
        })
        .await
        {
            Ok(()) => {}
            Err(_) => return Err("the watch did not end within 60 s of destroy".into()),
        }
        match sb.watch("w", false).await {
            Err(Error::SandboxGone { .. }) => Ok(()),
            other => Err(format!(
                "watch after destroy: {:?}, not SandboxGone",
                other.map(|_| ())
            )),
        }
    }
    .await;
    cx.finish(sb, r).await
}

fn expect_unsupported<T>(what: &str, r: Result<T, Error>) -> Checked {
    match r {
        Err(Error::Unsupported { .. }) => Ok(()),
        Err(e) => Err(format!("{what}: {} ({e}), not Unsupported", variant(&e))),
        Ok(_) => Err(format!("{what} succeeded though not claimed")),
    }
}

pub(super) async fn api_roundtrip(cx: &Ctx<'_>) -> Checked {
    let sb = cx.create(cx.spec()).await?;
    let r = async {
        let data = binary();
        sb.write_file("dir/sub/bin.dat", &data)
            .await
            .map_err(|e| format!("write_file dir/sub/bin.dat: {e}"))?;
        let back = sb
            .read_file("dir/sub/bin.dat")
            .await
            .map_err(|e| format!("read_file: {e}"))?;
        if back != data {
            return Err(format!(
                "read back {} bytes, not the 1024 written",
                back.len()
            ));
        }
        let back = sb
            .read_file("/workspace/dir/sub/bin.dat")
            .await
            .map_err(|e| format!("read_file by its /workspace path: {e}"))?;
        if back != data {
            return Err("the /workspace path reads other bytes".into());
        }
        sb.write_file("dir/sub/bin.dat", b"short")
            .await
            .map_err(|e| format!("overwrite: {e}"))?;
        let back = sb
            .read_file("dir/sub/bin.dat")
            .await
            .map_err(|e| e.to_string())?;
        if back != b"short" {
            return Err(format!(
                "an overwrite left {:?}",
                String::from_utf8_lossy(&back)
            ));
        }
        let top = sb.list("").await.map_err(|e| format!("list \"\": {e}"))?;
        let top2 = sb
            .list("/workspace")
            .await
            .map_err(|e| format!("list /workspace: {e}"))?;
        let dir = top.iter().find(|e| e.name == "dir");
        if dir.map(|e| e.kind) != Some(EntryKind::Dir) || names(&top) != names(&top2) {
            return Err(format!(
                "list \"\" gave {:?}, list /workspace {:?}",
                names(&top),
                names(&top2)
            ));
        }
        let sub = sb
            .list("dir/sub")
            .await
            .map_err(|e| format!("list dir/sub: {e}"))?;
        match sub.iter().find(|e| e.name == "bin.dat") {
            Some(e) if e.kind == EntryKind::File && e.size == 5 => Ok(()),
            other => Err(format!("list dir/sub: bin.dat is {other:?}")),
        }
    }
    .await;
    cx.finish(sb, r).await
}

pub(super) async fn inside(cx: &Ctx<'_>) -> Checked {
    let sb = cx.create(cx.spec()).await?;
    let r = async {
        sb.write_file("from-api.txt", b"api-data")
            .await
            .map_err(|e| format!("write_file: {e}"))?;
        let code = cx.code(
            "cat from-api.txt && printf inside-data > made-inside.txt",
            "import sys\n_ = sys.stdout.write(open('from-api.txt').read())\n\
             _ = open('made-inside.txt', 'w').write('inside-data')",
        );
        let r = run(sb.as_ref(), "files inside", ExecRequest::code(code)).await?;
        expect(
            r.success() && r.stdout_str() == "api-data",
            "the API's file read inside",
            &r,
        )?;
        let back = sb
            .read_file("made-inside.txt")
            .await
            .map_err(|e| format!("read_file of a file made inside: {e}"))?;
        if back == b"inside-data" {
            Ok(())
        } else {
            Err(format!("read {:?}", String::from_utf8_lossy(&back)))
        }
    }
    .await;
    cx.finish(sb, r).await
}

pub(super) async fn alias(cx: &Ctx<'_>) -> Checked {
    let spec = cx
        .spec()
        .workspace_alias("/home/agent")
        .build()
        .map_err(|e| format!("spec refused: {e}"))?;
    if !cx.caps.workspace_alias {
        let source = MapSecretSource::new();
        let secrets = ResolvedSecrets::resolve(&spec.secrets, &source)
            .map_err(|e| format!("secrets: {e}"))?;
        return expect_unsupported("a workspace alias", cx.backend.create(&spec, secrets).await);
    }
    let sb = cx.create_spec(&spec).await?;
    let r = async {
        sb.write_file("from-api.txt", b"api-data")
            .await
            .map_err(|e| format!("write_file: {e}"))?;
        // Absolute paths: the alias, not the working directory.
        let code = cx.code(
            "cat /home/agent/from-api.txt && mkdir -p /home/agent/d \
             && printf alias-data > /home/agent/d/made-inside.txt",
            "import os, sys\n_ = sys.stdout.write(open('/home/agent/from-api.txt').read())\n\
             os.makedirs('/home/agent/d', exist_ok=True)\n\
             _ = open('/home/agent/d/made-inside.txt', 'w').write('alias-data')",
        );
        let r = run(sb.as_ref(), "files at the alias", ExecRequest::code(code)).await?;
        expect(
            r.success() && r.stdout_str() == "api-data",
            "the API's file read at the alias",
            &r,
        )?;
        let back = sb
            .read_file("/workspace/d/made-inside.txt")
            .await
            .map_err(|e| format!("read_file of a file made at the alias: {e}"))?;
        if back != b"alias-data" {
            return Err(format!("read {:?}", String::from_utf8_lossy(&back)));
        }
        // The file API itself stays the workspace's: the alias is not one of its paths.
        match sb.read_file("/home/agent/from-api.txt").await {
            Err(Error::PathEscape { .. }) => Ok(()),
            other => Err(format!(
                "read_file of the alias's path: {:?}, not PathEscape",
                other.map(|_| ())
            )),
        }
    }
    .await;
    cx.finish(sb, r).await
}

pub(super) async fn not_found(cx: &Ctx<'_>) -> Checked {
    let sb = cx.create(cx.spec()).await?;
    let r = match sb.read_file("conformance-missing.txt").await {
        Err(Error::NotFound { .. }) => Ok(()),
        Err(e) => Err(format!("a missing file gave {}: {e}", variant(&e))),
        Ok(_) => Err("a missing file was read".into()),
    };
    cx.finish(sb, r).await
}

/// Every file call on `path` must be `PathEscape`.
async fn refused(sb: &dyn Sandbox, path: &str, write: bool) -> Checked {
    let want = |what: &str, r: Result<(), Error>| match r {
        Err(Error::PathEscape { .. }) => Ok(()),
        Err(e) => Err(format!(
            "{what} `{path}` gave {} ({e}), not PathEscape",
            variant(&e)
        )),
        Ok(()) => Err(format!("{what} `{path}` succeeded")),
    };
    want("read_file", sb.read_file(path).await.map(|_| ()))?;
    want("list", sb.list(path).await.map(|_| ()))?;
    if write {
        want("write_file", sb.write_file(path, b"escaped").await)?;
    }
    Ok(())
}

pub(super) async fn dotdot(cx: &Ctx<'_>) -> Checked {
    let sb = cx.create(cx.spec()).await?;
    let r = async {
        for p in [
            "..",
            "../etc/passwd",
            "a/../../etc/passwd",
            "/workspace/../etc/passwd",
        ] {
            refused(sb.as_ref(), p, false).await?;
        }
        for p in [
            "../conformance-escape.txt",
            "d/../../conformance-escape.txt",
        ] {
            refused(sb.as_ref(), p, true).await?;
        }
        Ok(())
    }
    .await;
    cx.finish(sb, r).await
}

pub(super) async fn absolute(cx: &Ctx<'_>) -> Checked {
    let sb = cx.create(cx.spec()).await?;
    let r = async {
        for p in ["/etc/passwd", "/etc", "/"] {
            refused(sb.as_ref(), p, false).await?;
        }
        refused(sb.as_ref(), "/tmp/conformance-escape.txt", true).await?;
        sb.write_file("/workspace/inside.txt", b"ok")
            .await
            .map_err(|e| format!("write_file /workspace/inside.txt: {e}"))?;
        match sb.read_file("inside.txt").await {
            Ok(b) if b == b"ok" => Ok(()),
            other => Err(format!("a /workspace path: {other:?}")),
        }
    }
    .await;
    cx.finish(sb, r).await
}

pub(super) async fn symlink(cx: &Ctx<'_>) -> Checked {
    // A host folder as the workspace, with links out of it to a folder of our own (never
    // to a host file: a tier that followed them would write there).
    let outer = tempfile::tempdir().map_err(|e| format!("temp dir: {e}"))?;
    let ws = outer.path().join("ws");
    let target = outer.path().join("outside");
    let setup = || -> std::io::Result<()> {
        std::fs::create_dir(&ws)?;
        std::fs::create_dir(&target)?;
        std::fs::write(target.join("secret.txt"), "outside")?;
        std::os::unix::fs::symlink(&target, ws.join("abs-dir"))?;
        std::os::unix::fs::symlink("../outside", ws.join("rel-dir"))?;
        std::os::unix::fs::symlink(target.join("secret.txt"), ws.join("file-link"))?;
        Ok(())
    };
    setup().map_err(|e| format!("setting up the links: {e}"))?;
    let sb = cx.create(cx.spec().workspace_dir(&ws, false)).await?;
    let r = async {
        for p in [
            "abs-dir/secret.txt",
            "rel-dir/secret.txt",
            "abs-dir",
            "rel-dir",
        ] {
            refused(sb.as_ref(), p, false).await?;
        }
        for p in ["file-link", "abs-dir/new.txt", "rel-dir/new.txt"] {
            refused(sb.as_ref(), p, true).await?;
        }
        let left = std::fs::read_to_string(target.join("secret.txt")).map_err(|e| e.to_string())?;
        let others = std::fs::read_dir(&target)
            .map_err(|e| e.to_string())?
            .count();
        if left != "outside" || others != 1 {
            return Err("the folder outside the workspace was written".into());
        }
        // A link made by the code itself, where the tier lets code make links.
        if Need::Code.missing(&cx.caps).is_none() {
            let code = cx.code("ln -s / rootlink", "import os; os.symlink('/', 'rootlink')");
            let r = run(sb.as_ref(), "ln -s", ExecRequest::code(code)).await?;
            if r.success() {
                refused(sb.as_ref(), "rootlink/etc/passwd", false).await?;
                refused(sb.as_ref(), "rootlink/tmp/conformance-escape.txt", true).await?;
            }
        }
        Ok(())
    }
    .await;
    cx.finish(sb, r).await
}

pub(super) async fn snapshot_restore(cx: &Ctx<'_>) -> Checked {
    let dir = tempfile::tempdir().map_err(|e| format!("temp dir: {e}"))?;
    let store = ObjectSnapshotStore::local(dir.path()).map_err(|e| e.to_string())?;
    let sb = cx.create(cx.spec()).await?;
    let data = binary();
    let made = async {
        sb.write_file("a.txt", b"alpha")
            .await
            .map_err(|e| e.to_string())?;
        sb.write_file("d/b.bin", &data)
            .await
            .map_err(|e| e.to_string())?;
        if Need::Code.missing(&cx.caps).is_none() {
            let code = cx.code(
                "printf gamma > c.txt",
                "_ = open('c.txt', 'w').write('gamma')",
            );
            let r = run(sb.as_ref(), "write inside", ExecRequest::code(code)).await?;
            expect(r.success(), "writing c.txt inside", &r)?;
        } else {
            sb.write_file("c.txt", b"gamma")
                .await
                .map_err(|e| e.to_string())?;
        }
        let before = names(&sb.list("").await.map_err(|e| e.to_string())?);
        let id = sb
            .snapshot(&store)
            .await
            .map_err(|e| format!("snapshot: {e}"))?;
        Ok::<_, String>((id, before))
    }
    .await;
    let (id, before) = match made {
        Ok(v) => v,
        Err(e) => return cx.finish(sb, Err(e)).await,
    };
    cx.finish(sb, Ok(())).await?;
    let source = MapSecretSource::new().with(SECRET_NAME, SECRET_VALUE);
    let secrets = ResolvedSecrets::resolve(&[], &source).map_err(|e| e.to_string())?;
    let restored = cx
        .backend
        .restore(&store, &id, secrets)
        .await
        .map_err(|e| format!("restore: {e}"))?;
    let r = async {
        let after = names(&restored.list("").await.map_err(|e| e.to_string())?);
        if after != before {
            return Err(format!("files {before:?} before, {after:?} after"));
        }
        for (path, want) in [
            ("a.txt", &b"alpha"[..]),
            ("d/b.bin", &data),
            ("c.txt", b"gamma"),
        ] {
            let got = restored
                .read_file(path)
                .await
                .map_err(|e| format!("read_file {path} after restore: {e}"))?;
            if got != want {
                return Err(format!("{path} differs after restore"));
            }
        }
        Ok(())
    }
    .await;
    cx.finish(restored, r).await
}

//! Files: write, read and list, confined to the workspace.

use super::*;

pub(crate) type FileError = (ErrorKind, String);

pub(crate) fn io_err(what: &str, path: &str, e: &io::Error) -> FileError {
    let kind = match e.kind() {
        io::ErrorKind::NotFound => ErrorKind::NotFound,
        _ => ErrorKind::Io,
    };
    (kind, format!("{what} {path}: {e}"))
}

/// Maps a protocol path (relative to the workspace, or absolute under `/workspace`) to a path
/// under `ws`, lexically normalised; refuses anything that leaves the workspace.
pub(crate) fn ws_path(ws: &Path, path: &str) -> Result<PathBuf, FileError> {
    if path.contains('\0') {
        return Err((ErrorKind::Invalid, "NUL byte in path".into()));
    }
    let rel = if path.starts_with('/') {
        match path.strip_prefix(WORKSPACE) {
            Some(r) if r.is_empty() || r.starts_with('/') => r,
            _ => return Err((ErrorKind::PathEscape, format!("{path}: outside /workspace"))),
        }
    } else {
        path
    };
    let mut parts: Vec<&OsStr> = Vec::new();
    for c in Path::new(rel).components() {
        match c {
            Component::Normal(p) => parts.push(p),
            Component::ParentDir => {
                if parts.pop().is_none() {
                    return Err((ErrorKind::PathEscape, format!("{path}: outside /workspace")));
                }
            }
            Component::CurDir | Component::RootDir | Component::Prefix(_) => {}
        }
    }
    let mut full = ws.to_path_buf();
    full.extend(parts);
    Ok(full)
}

/// Refuses a path whose existing part resolves (through symlinks) outside the workspace.
pub(crate) fn check_inside(ws: &Path, full: &Path, shown: &str) -> Result<(), FileError> {
    let root = fs::canonicalize(ws).map_err(|e| io_err("workspace", shown, &e))?;
    let mut p = full.to_path_buf();
    loop {
        match fs::canonicalize(&p) {
            Ok(c) if c.starts_with(&root) => return Ok(()),
            Ok(_) => break,
            Err(_) => {
                if fs::symlink_metadata(&p).is_ok() {
                    // A dangling symlink: where it would lead is unknown; refuse.
                    break;
                }
                if !p.pop() {
                    break;
                }
            }
        }
    }
    Err((
        ErrorKind::PathEscape,
        format!("{shown}: outside /workspace"),
    ))
}

pub(crate) fn write_file(
    ws: &Path,
    user: Option<(u32, u32)>,
    path: &str,
    mode: u32,
    append: bool,
    data: &[u8],
) -> Result<(), FileError> {
    let full = ws_path(ws, path)?;
    if full == ws {
        return Err((ErrorKind::Invalid, format!("{path}: is the workspace")));
    }
    check_inside(ws, &full, path)?;
    if let Some(parent) = full.parent() {
        fs::create_dir_all(parent).map_err(|e| io_err("create", path, &e))?;
        check_inside(ws, &full, path)?;
        // The directories between the workspace and the file belong to the commands' user.
        if let (Some((uid, gid)), Ok(rel)) = (user, parent.strip_prefix(ws)) {
            let mut d = ws.to_path_buf();
            for c in rel.components() {
                d.push(c);
                std::os::unix::fs::lchown(&d, Some(uid), Some(gid))
                    .map_err(|e| io_err("chown", path, &e))?;
            }
        }
    }
    let mode = if mode & 0o7777 == 0 {
        0o644
    } else {
        mode & 0o7777
    };
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .append(append)
        .truncate(!append)
        .mode(mode)
        .custom_flags(0o400000 /* O_NOFOLLOW */)
        .open(&full)
        .map_err(|e| io_err("write", path, &e))?;
    if let Some((uid, gid)) = user {
        std::os::unix::fs::fchown(&f, Some(uid), Some(gid))
            .map_err(|e| io_err("chown", path, &e))?;
    }
    f.write_all(data).map_err(|e| io_err("write", path, &e))
}

pub(crate) fn read_file(st: &State, id: u32, path: &str, max: u64) -> Result<(), FileError> {
    let ws = &st.workspace;
    let full = ws_path(ws, path)?;
    check_inside(ws, &full, path)?;
    let mut f = File::open(&full).map_err(|e| io_err("read", path, &e))?;
    let meta = f.metadata().map_err(|e| io_err("read", path, &e))?;
    if meta.is_dir() {
        return Err((ErrorKind::Invalid, format!("{path}: is a directory")));
    }
    if meta.len() > max {
        return Err((
            ErrorKind::TooLarge,
            format!("{path}: {} bytes, over the limit of {max}", meta.len()),
        ));
    }
    let mut buf = vec![0u8; proto::CHUNK];
    let mut total: u64 = 0;
    loop {
        let n = match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(io_err("read", path, &e)),
        };
        total = total.saturating_add(n as u64);
        if total > max {
            return Err((
                ErrorKind::TooLarge,
                format!("{path}: grew over {max} bytes"),
            ));
        }
        st.chan.send(
            id,
            &Response::Data(buf.get(..n).unwrap_or_default().to_vec()),
        );
    }
    st.chan.send(id, &Response::Ok);
    Ok(())
}

pub(crate) fn list(ws: &Path, path: &str) -> Result<Vec<Entry>, FileError> {
    let full = ws_path(ws, path)?;
    check_inside(ws, &full, path)?;
    let rd = fs::read_dir(&full).map_err(|e| io_err("list", path, &e))?;
    let mut v = Vec::new();
    for e in rd {
        let e = e.map_err(|e| io_err("list", path, &e))?;
        let Ok(meta) = fs::symlink_metadata(e.path()) else {
            continue;
        };
        let ft = meta.file_type();
        let kind = if ft.is_symlink() {
            EntryKind::Symlink
        } else if ft.is_dir() {
            EntryKind::Dir
        } else if ft.is_file() {
            EntryKind::File
        } else {
            EntryKind::Other
        };
        v.push(Entry {
            name: e.file_name().to_string_lossy().into_owned(),
            kind,
            size: meta.len(),
        });
    }
    v.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(v)
}

//! envd's `filesystem.Filesystem` service: stat, list (to a depth), make a directory,
//! move, remove; watching (`watch.rs`).
//!
//! E2B's file API names any path of the sandbox's file system (`/tmp/x`, `~/y`, relative
//! to the home), with owners, modes and times. Each operation runs *inside* the sandbox as a
//! small POSIX shell program ([`HELPER`]) under the sandbox's own user and isolation, so a
//! client's path is resolved by the sandbox's kernel view and never by the server's host:
//! no host path is formed from it. It needs `/bin/sh` and `stat`, `readlink`, `mkdir`,
//! `mv`, `rm`, `cat` (coreutils or busybox), as the tiers' userlands and common images have.

use axum::extract::{FromRequest, Path, Request};
use axum::response::{IntoResponse, Response};
use sandbox_core::ExecRequest;
use serde::Deserialize;

use super::connect::{self, Code, RpcError, StreamRequest, Unary};
use super::watch::{self, WatchReq, WatcherReq};
use super::Envd;

/// The file operations, in the sandbox. Exit codes: 3 no such path, 4 a directory where a
/// file is wanted, 5 a directory exists already, 6 something else exists there already,
/// 7 not a directory. Each entry printed is three NUL-terminated fields: its path, its
/// `stat` line (`type|size|octal mode|permissions|owner|group|mtime`), and its symlink's
/// target (empty unless it is one).
const HELPER: &str = r#"
entry() {
  if [ -L "$1" ]; then
    t=$(readlink -f -- "$1" 2>/dev/null || true)
    s=$(stat -L -c '%F|%s|%a|%A|%U|%G|%Y' -- "$1" 2>/dev/null) || s=$(stat -c '%F|%s|%a|%A|%U|%G|%Y' -- "$1") || return 1
  else
    t=
    s=$(stat -c '%F|%s|%a|%A|%U|%G|%Y' -- "$1") || return 1
  fi
  printf '%s\0%s\0%s\0' "$1" "$s" "$t"
}
walk() {
  for f in "$1"/* "$1"/.[!.]* "$1"/..?*; do
    [ -e "$f" ] || [ -L "$f" ] || continue
    entry "$f"
    if [ "$2" -gt 1 ] && [ -d "$f" ] && [ ! -L "$f" ]; then walk "$f" $(($2 - 1)); fi
  done
}
exists() { [ -e "$1" ] || [ -L "$1" ]; }
op=$1; shift
case $op in
  stat) exists "$1" || exit 3; entry "$1" ;;
  list) exists "$1" || exit 3; [ -d "$1" ] || exit 7; walk "${1%/}" "$2" ;;
  mkdir) if exists "$1"; then [ -d "$1" ] && exit 5; exit 6; fi
         mkdir -p -- "$1" && entry "$1" ;;
  move) exists "$1" || exit 3; mkdir -p -- "$(dirname -- "$2")" && mv -f -- "$1" "$2" && entry "$2" ;;
  remove) exists "$1" || exit 0; rm -rf -- "$1" ;;
  write) [ -d "$1" ] && exit 4; mkdir -p -- "$(dirname -- "$1")" && cat > "$1" && entry "$1" ;;
  read) exists "$1" || exit 3; [ -d "$1" ] && exit 4; cat -- "$1" ;;
  *) exit 64 ;;
esac
"#;

/// Runs file operation `op` on `args` in the sandbox; its standard output, or the error its
/// exit code means.
pub(crate) async fn helper(
    e: &Envd,
    op: &str,
    args: &[&str],
    stdin: Option<Vec<u8>>,
) -> Result<Vec<u8>, RpcError> {
    let mut argv = vec!["/bin/sh", "-c", HELPER, "envd", op];
    argv.extend_from_slice(args);
    let mut req = ExecRequest::argv(argv).cwd(e.meta.home.clone());
    if let Some(data) = stdin {
        req = req.stdin(data);
    }
    let r = e.entry.sandbox.exec(req).await?;
    let path = args.first().copied().unwrap_or("");
    let stderr = String::from_utf8_lossy(&r.stderr);
    let stderr = stderr.trim();
    match r.exit_code {
        _ if r.limit == Some(sandbox_core::LimitKind::Output) => Err(RpcError::new(
            Code::ResourceExhausted,
            format!(
                "{path}: the answer is over the sandbox's output limit (`limits.output_bytes`)"
            ),
        )),
        _ if r.limit.is_some() => Err(RpcError::new(
            Code::DeadlineExceeded,
            format!(
                "{op} {path} was stopped by the sandbox's {} limit",
                r.limit.map_or("", |l| l.name())
            ),
        )),
        Some(0) if r.truncated => Err(RpcError::new(
            Code::ResourceExhausted,
            format!(
                "{path}: the answer is over the sandbox's output limit (`limits.output_bytes`)"
            ),
        )),
        Some(0) => Ok(r.stdout),
        Some(3) => Err(RpcError::new(
            Code::NotFound,
            format!("path '{path}' does not exist"),
        )),
        Some(4) => Err(RpcError::invalid(format!("path '{path}' is a directory"))),
        Some(5) | Some(6) => Err(RpcError::new(
            Code::AlreadyExists,
            format!("path '{path}' already exists"),
        )),
        Some(7) => Err(RpcError::invalid(format!(
            "path '{path}' is not a directory"
        ))),
        Some(c) if stderr.contains("Permission denied") || stderr.contains("Read-only") => {
            Err(RpcError::new(
                Code::PermissionDenied,
                format!("{path}: {stderr} (exit {c})"),
            ))
        }
        other => Err(RpcError::new(
            Code::Internal,
            format!(
                "{op} {path} failed in the sandbox ({}): {stderr}",
                other.map_or("killed".to_string(), |c| format!("exit {c}"))
            ),
        )),
    }
}

/// The entries the helper printed, as envd's `EntryInfo`s.
pub(crate) fn entries(out: &[u8]) -> Result<Vec<serde_json::Value>, RpcError> {
    let fields: Vec<&[u8]> = out.split(|b| *b == 0).collect();
    let mut v = Vec::new();
    // Three fields per entry, and the empty rest after the last NUL.
    for chunk in fields.chunks(3) {
        let [path, stat, target] = chunk else { break };
        v.push(entry(
            &String::from_utf8_lossy(path),
            &String::from_utf8_lossy(stat),
            &String::from_utf8_lossy(target),
        )?);
    }
    Ok(v)
}

fn entry(path: &str, stat: &str, target: &str) -> Result<serde_json::Value, RpcError> {
    let bad = || RpcError::new(Code::Internal, format!("{path}: unreadable stat `{stat}`"));
    let f: Vec<&str> = stat.split('|').collect();
    let [kind, size, mode, perms, owner, group, mtime] = f[..] else {
        return Err(bad());
    };
    let kind = match kind {
        "directory" => "FILE_TYPE_DIRECTORY",
        "symbolic link" => "FILE_TYPE_SYMLINK",
        k if k.contains("file") => "FILE_TYPE_FILE",
        _ => "FILE_TYPE_UNSPECIFIED",
    };
    let mode = u32::from_str_radix(mode, 8).map_err(|_| bad())?;
    let mtime = mtime
        .parse::<i64>()
        .ok()
        .and_then(|t| time::OffsetDateTime::from_unix_timestamp(t).ok())
        .ok_or_else(bad)?;
    let name = path.rsplit('/').next().unwrap_or(path);
    let mut v = serde_json::json!({
        "name": name,
        "type": kind,
        "path": path,
        "size": size,
        "mode": mode,
        "permissions": perms,
        "owner": owner,
        "group": group,
        "modifiedTime": super::rfc3339(mtime),
    });
    if let (false, Some(o)) = (target.is_empty(), v.as_object_mut()) {
        o.insert("symlinkTarget".into(), target.into());
    }
    Ok(v)
}

async fn one(e: &Envd, op: &str, args: &[&str]) -> Result<serde_json::Value, RpcError> {
    let out = helper(e, op, args, None).await?;
    entries(&out)?
        .into_iter()
        .next_back()
        .ok_or_else(|| RpcError::new(Code::Internal, format!("{op}: no entry came back")))
}

#[derive(Deserialize, Default)]
struct PathReq {
    #[serde(default)]
    path: String,
    #[serde(default)]
    depth: Option<u32>,
}

#[derive(Deserialize, Default)]
struct MoveReq {
    #[serde(default)]
    source: String,
    #[serde(default)]
    destination: String,
}

/// Deepest listing served (E2B's SDKs ask for small depths).
const MAX_DEPTH: u32 = 64;

/// `POST /filesystem.Filesystem/{method}`.
pub(crate) async fn call(e: Envd, Path(method): Path<String>, req: Request) -> Response {
    let r = match method.as_str() {
        "Stat" | "MakeDir" | "Remove" | "ListDir" => {
            match Unary::<PathReq>::from_request(req, &()).await {
                Ok(Unary(p)) => path_call(&e, &method, p).await,
                Err(err) => Err(err),
            }
        }
        "Move" => match Unary::<MoveReq>::from_request(req, &()).await {
            Ok(Unary(m)) => move_call(&e, m).await,
            Err(err) => Err(err),
        },
        "WatchDir" => {
            return match StreamRequest::<WatchReq>::from_request(req, &()).await {
                Ok(r) => watch::watch_dir(e, r).await,
                Err(resp) => resp,
            }
        }
        "CreateWatcher" => match Unary::<WatchReq>::from_request(req, &()).await {
            Ok(Unary(w)) => watch::create(&e, w).await,
            Err(err) => Err(err),
        },
        "GetWatcherEvents" | "RemoveWatcher" => {
            match Unary::<WatcherReq>::from_request(req, &()).await {
                Ok(Unary(w)) if method == "RemoveWatcher" => watch::remove(&e, w),
                Ok(Unary(w)) => watch::events(&e, w).await,
                Err(err) => Err(err),
            }
        }
        other => Err(RpcError::new(
            Code::Unimplemented,
            format!("filesystem.Filesystem/{other} is not a method of envd's filesystem service"),
        )),
    };
    match r {
        Ok(v) => connect::unary(v),
        Err(err) if method == "WatchDir" => connect::stream_error(err),
        Err(err) => err.into_response(),
    }
}

async fn path_call(e: &Envd, method: &str, p: PathReq) -> Result<serde_json::Value, RpcError> {
    let path = super::resolve(&e.meta.home, &p.path)?;
    match method {
        "Stat" => Ok(serde_json::json!({ "entry": one(e, "stat", &[&path]).await? })),
        "MakeDir" => Ok(serde_json::json!({ "entry": one(e, "mkdir", &[&path]).await? })),
        "Remove" => {
            helper(e, "remove", &[&path], None).await?;
            Ok(serde_json::json!({}))
        }
        _ => {
            let depth = p.depth.unwrap_or(1).clamp(1, MAX_DEPTH).to_string();
            let out = helper(e, "list", &[&path, &depth], None).await?;
            Ok(serde_json::json!({ "entries": entries(&out)? }))
        }
    }
}

async fn move_call(e: &Envd, m: MoveReq) -> Result<serde_json::Value, RpcError> {
    let from = super::resolve(&e.meta.home, &m.source)?;
    let to = super::resolve(&e.meta.home, &m.destination)?;
    Ok(serde_json::json!({ "entry": one(e, "move", &[&from, &to]).await? }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_lines_become_entries() {
        let out = b"/w/a.txt\0regular file|4|644|-rw-r--r--|user|user|1700000000\0\0\
/w/l\0directory|4096|755|drwxr-xr-x|root|root|1700000000\0/w/d\0";
        let v = entries(out).unwrap();
        assert_eq!(v.len(), 2);
        assert_eq!(v[0]["name"], "a.txt");
        assert_eq!(v[0]["type"], "FILE_TYPE_FILE");
        assert_eq!(v[0]["mode"], 0o644);
        assert_eq!(v[0]["size"], "4");
        assert_eq!(v[0]["modifiedTime"], "2023-11-14T22:13:20Z");
        assert!(v[0].get("symlinkTarget").is_none());
        assert_eq!(v[1]["type"], "FILE_TYPE_DIRECTORY");
        assert_eq!(v[1]["symlinkTarget"], "/w/d");
        assert!(entries(b"/x\0garbage\0\0").is_err());
        assert!(entries(b"").unwrap().is_empty());
    }
}

//! File watches (`Watch`) of the real agent binary: inotify events with paths relative to
//! the watched directory, directories made later (and what they hold), flow control by
//! grants, the end when the directory goes or the watch is stopped, and what it refuses.

use super::*;

use backend_microvm::agent_client::proto::MAX_WATCHES;
use backend_microvm::agent_client::{FsEvent, FsKind, WatchHandle};

/// Events until `until` matches one (which is included), at most `T` in all.
fn events_until(w: &mut WatchHandle, until: impl Fn(&FsEvent) -> bool) -> Vec<FsEvent> {
    let deadline = std::time::Instant::now() + T;
    let mut seen = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        assert!(!left.is_zero(), "no match in {seen:?}");
        match w.next_event(left) {
            Ok(Some(ev)) => {
                let done = until(&ev);
                seen.push(ev);
                if done {
                    return seen;
                }
            }
            other => panic!("{other:?} after {seen:?}"),
        }
    }
}

fn has(evs: &[FsEvent], kind: FsKind, path: &str, is_dir: bool) -> bool {
    evs.iter()
        .any(|e| e.kind == kind && e.path == path && e.is_dir == is_dir)
}

#[test]
fn a_watch_reports_changes_beneath_it_and_ends_with_its_directory() {
    let a = spawn();
    let d = a.ws.path().join("d");
    std::fs::create_dir(&d).unwrap();
    let mut w = a.client.start_watch("/workspace/d", true).unwrap();

    std::fs::write(d.join("f"), b"1").unwrap();
    std::fs::rename(d.join("f"), d.join("g")).unwrap();
    std::fs::set_permissions(d.join("g"), std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::remove_file(d.join("g")).unwrap();
    let evs = events_until(&mut w, |e| e.kind == FsKind::Remove && e.path == "g");
    for (kind, path) in [
        (FsKind::Create, "f"),
        (FsKind::Write, "f"),
        (FsKind::Rename, "f"),
        (FsKind::Create, "g"),
        (FsKind::Chmod, "g"),
        (FsKind::Remove, "g"),
    ] {
        assert!(has(&evs, kind, path, false), "{kind:?} {path}: {evs:?}");
    }

    // A directory made and filled at once: it is watched, and what it held is reported.
    let made = std::process::Command::new("sh")
        .arg("-c")
        .arg("mkdir -p sub/deeper && echo x > sub/deeper/h")
        .current_dir(&d)
        .status()
        .unwrap();
    assert!(made.success());
    let evs = events_until(&mut w, |e| e.path == "sub/deeper/h");
    assert!(has(&evs, FsKind::Create, "sub", true), "{evs:?}");
    std::fs::write(d.join("sub/deeper/later"), b"2").unwrap();
    events_until(&mut w, |e| {
        e.kind == FsKind::Create && e.path == "sub/deeper/later"
    });

    // The directory itself goes: its removal, then the end.
    std::fs::remove_dir_all(&d).unwrap();
    events_until(&mut w, |e| e.kind == FsKind::Remove && e.path.is_empty());
    assert_eq!(w.next_event(T).unwrap(), None);
    // The agent serves on.
    assert_eq!(
        a.client.ping(T).unwrap(),
        backend_microvm::agent_client::SOURCE_HASH
    );
}

#[test]
fn a_watch_not_recursive_sees_only_its_own_entries() {
    let a = spawn();
    std::fs::create_dir_all(a.ws.path().join("sub")).unwrap();
    let mut w = a.client.start_watch("", false).unwrap();
    std::fs::write(a.ws.path().join("sub/inner"), b"x").unwrap();
    std::fs::write(a.ws.path().join("top"), b"x").unwrap();
    let evs = events_until(&mut w, |e| e.path == "top");
    assert!(evs.iter().all(|e| !e.path.starts_with("sub/")), "{evs:?}");
}

#[test]
fn thousands_of_events_arrive_through_the_window() {
    let a = spawn();
    let mut w = a.client.start_watch("", false).unwrap();
    // Far more than one window's worth (64 KiB at 1 KiB an event): the host's grants keep
    // them coming.
    let n = 1000;
    let made = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "i=0; while [ $i -lt {n} ]; do : > f$i; i=$((i+1)); done"
        ))
        .current_dir(a.ws.path())
        .status()
        .unwrap();
    assert!(made.success());
    let last = format!("f{}", n - 1);
    let evs = events_until(&mut w, |e| e.kind == FsKind::Create && e.path == last);
    let created = evs.iter().filter(|e| e.kind == FsKind::Create).count();
    // Every file, unless the kernel's queue overflowed meanwhile (then the loss is said).
    assert!(
        created == n || evs.iter().any(|e| e.kind == FsKind::Lost),
        "{created} of {n}"
    );
}

#[test]
fn a_stopped_watch_ends_and_the_agent_goes_on() {
    let a = spawn();
    let mut w = a.client.start_watch("", true).unwrap();
    w.stop().unwrap();
    assert_eq!(w.next_event(T).unwrap(), None);
    // Dropping one unstopped stops it too: its place is free again.
    for _ in 0..MAX_WATCHES + 1 {
        drop(a.client.start_watch("", false).unwrap());
    }
    assert_eq!(
        a.client.ping(T).unwrap(),
        backend_microvm::agent_client::SOURCE_HASH
    );
}

#[test]
fn watches_outside_the_workspace_of_files_or_too_many_are_refused() {
    let a = spawn();
    let outside = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(outside.path(), a.ws.path().join("link")).unwrap();
    std::fs::write(a.ws.path().join("file"), b"x").unwrap();
    for (p, want) in [
        ("../x", ErrorKind::PathEscape),
        ("/etc", ErrorKind::PathEscape),
        ("link", ErrorKind::PathEscape),
        ("missing", ErrorKind::NotFound),
        ("file", ErrorKind::Invalid),
    ] {
        match a.client.start_watch(p, true) {
            Err(AgentError::Remote { kind, .. }) => assert_eq!(kind, want, "{p}"),
            other => panic!("{p}: {other:?}"),
        }
    }
    let held: Vec<WatchHandle> = (0..MAX_WATCHES)
        .map(|_| a.client.start_watch("", false).unwrap())
        .collect();
    match a.client.start_watch("", false) {
        Err(AgentError::Remote { kind, .. }) => assert_eq!(kind, ErrorKind::TooLarge),
        other => panic!("{other:?}"),
    }
    drop(held);
    assert_eq!(
        a.client.ping(T).unwrap(),
        backend_microvm::agent_client::SOURCE_HASH
    );
}

#[test]
fn a_recursive_watch_never_follows_a_link_out() {
    let a = spawn();
    let outside = tempfile::tempdir().unwrap();
    std::fs::create_dir(outside.path().join("inner")).unwrap();
    std::os::unix::fs::symlink(outside.path(), a.ws.path().join("out")).unwrap();
    let mut w = a.client.start_watch("", true).unwrap();
    // A directory swapped for a link after the watch began is not followed either.
    std::fs::create_dir(a.ws.path().join("later")).unwrap();
    std::fs::remove_dir(a.ws.path().join("later")).unwrap();
    std::os::unix::fs::symlink(outside.path(), a.ws.path().join("later")).unwrap();
    std::fs::write(outside.path().join("secret"), b"x").unwrap();
    std::fs::write(outside.path().join("inner/secret"), b"x").unwrap();
    std::fs::write(a.ws.path().join("marker"), b"x").unwrap();
    let evs = events_until(&mut w, |e| e.path == "marker");
    assert!(
        evs.iter().all(|e| !e.path.contains("secret")),
        "the watch reached outside: {evs:?}"
    );
}

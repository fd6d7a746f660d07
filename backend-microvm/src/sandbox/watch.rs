//! File watches: the guest agent's inotify watch ([`AgentClient::start_watch`]), relayed
//! to a [`sandbox_core::Watch`] by a thread of its own per watch.

use super::*;

impl Inner {
    pub(super) async fn watch(
        self: &Arc<Self>,
        path: &str,
        recursive: bool,
    ) -> Result<sandbox_core::Watch> {
        let (_, rel) = guest_path(path)?;
        // The host's bounds first (per sandbox, per process): a refused watch starts nothing
        // in the guest.
        let (watch, feed) = self.watches.fed()?;
        // The guest's own bound (as many watches as the host's per sandbox) is the same
        // `ResourceExhausted` as the host's.
        let handle = self
            .call(Some(path), move |a| match a.start_watch(&rel, recursive) {
                Err(AgentError::Remote {
                    kind: ErrorKind::TooLarge,
                    message,
                }) => Ok(Err(message)),
                r => r.map(Ok),
            })
            .await?
            .map_err(|what| Error::ResourceExhausted { what })?;
        // A reader that drops its watch stops it in the guest at once; the guest's `Exit`
        // then ends the relay.
        feed.on_reader_gone(handle.stopper());
        std::thread::Builder::new()
            .name("microvm-watch".into())
            .spawn(move || relay_watch(handle, &feed))
            .map_err(|e| Error::io("start a file watch", e))?;
        Ok(watch)
    }
}

/// How often a relayed watch with no events looks whether its reader is still there (a
/// guest that does not end a stopped watch is left after this long).
const WATCH_CHECK: Duration = Duration::from_secs(1);

/// Relays the guest's events of `handle` to `feed` until either ends (the watch stops in the
/// guest when `handle` drops; the reader sees the end when `feed` does).
fn relay_watch(mut handle: crate::agent_client::WatchHandle, feed: &sandbox_core::WatchFeed) {
    use crate::agent_client::FsKind as K;
    use sandbox_core::{FsEvent, FsEventKind};
    loop {
        let ev = match handle.next_event(WATCH_CHECK) {
            Ok(Some(ev)) => ev,
            Err(AgentError::Timeout(_)) if feed.is_open() => continue,
            Ok(None) | Err(_) => return,
        };
        let kind = match ev.kind {
            K::Create => FsEventKind::Create,
            K::Write => FsEventKind::Write,
            K::Remove => FsEventKind::Remove,
            K::Rename => FsEventKind::Rename,
            K::Chmod => FsEventKind::Chmod,
            K::Lost => {
                if !feed.lost() {
                    return;
                }
                continue;
            }
        };
        let open = feed.push(FsEvent {
            kind,
            path: ev.path,
            is_dir: ev.is_dir,
        });
        if !open {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use sandbox_core::{FsEventKind, Sandbox};

    use super::super::tests::over_a_host_agent::{sandbox, spec};
    use super::*;

    /// The next event, within a hang guard.
    async fn next(w: &mut sandbox_core::Watch) -> Option<sandbox_core::FsEvent> {
        tokio::time::timeout(Duration::from_secs(30), w.next())
            .await
            .expect("no event")
            .map(|r| r.unwrap())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_guests_events_come_through_the_watch() {
        let (s, ws) = sandbox(spec());
        std::fs::create_dir(ws.path().join("d")).unwrap();
        let mut w = s.watch("/workspace/d", true).await.unwrap();
        let r = s
            .exec(ExecRequest::code("mkdir d/sub && echo x > d/sub/f"))
            .await
            .unwrap();
        assert_eq!(r.exit_code, Some(0), "{r:?}");
        let mut seen = Vec::new();
        while !seen
            .iter()
            .any(|(_, p): &(FsEventKind, String)| p == "sub/f")
        {
            let ev = next(&mut w).await.unwrap();
            seen.push((ev.kind, ev.path));
        }
        assert_eq!(
            seen[0],
            (FsEventKind::Create, "sub".to_string()),
            "{seen:?}"
        );

        for (bad, what) in [("../x", "escape"), ("/etc", "escape"), ("nope", "missing")] {
            match (s.watch(bad, false).await, what) {
                (Err(Error::PathEscape { .. }), "escape")
                | (Err(Error::NotFound { .. }), "missing") => {}
                (other, _) => panic!("{bad}: {other:?}"),
            }
        }
        // The sandbox's end is the watch's end.
        s.destroy().await.unwrap();
        loop {
            if next(&mut w).await.is_none() {
                break;
            }
        }
    }
}

//! File watches in the guest ([`proto::Request::Watch`]): the agent's inotify events, within
//! a window this side grants back as it reads them.

use super::*;
pub use proto::{FsEvent, FsKind};

/// The window a watch starts with and keeps: at most this many bytes of events (each
/// [`proto::event_cost`], at least [`proto::FRAME_COST`]) are in flight, well within the
/// reader's queue (`QUEUE_FRAMES` frames); granted back in halves as they are read.
pub const WATCH_WINDOW: u32 = 64 * 1024;

impl AgentClient {
    /// Starts watching directory `path` of the guest's workspace (and, `recursive`, every
    /// directory beneath it): read the events with [`WatchHandle::next_event`].
    /// [`ErrorKind::NotFound`], [`ErrorKind::PathEscape`], [`ErrorKind::Invalid`] (not a
    /// directory) and [`ErrorKind::TooLarge`] (too many watches) come as
    /// [`AgentError::Remote`].
    pub fn start_watch(&self, path: &str, recursive: bool) -> Result<WatchHandle, AgentError> {
        let call = self.start(&Request::Watch {
            path: path.to_string(),
            recursive,
            window: WATCH_WINDOW,
        })?;
        match call.recv(Some(SPAWN_TIMEOUT)) {
            Ok(Response::Ok) => {}
            Ok(r) => return Err(unexpected(&r)),
            Err(e) => {
                if matches!(e, AgentError::Timeout(_)) {
                    // Not left running in the guest, holding a place.
                    let _ = self.start(&Request::Kill { target: call.id });
                }
                return Err(e);
            }
        }
        Ok(WatchHandle {
            call,
            used: 0,
            done: false,
        })
    }
}

/// A running watch started by [`AgentClient::start_watch`]. Dropping it stops the watch.
///
/// What is read is granted back: the window bounds what the guest has in flight, not what
/// this side keeps (a guest that ignores it only fills its own request's queue, and the
/// reader of [`next_event`](Self::next_event) decides what it keeps: `sandbox_core`'s
/// watches keep a bounded queue).
pub struct WatchHandle {
    call: Call,
    /// Window consumed and not yet granted back.
    used: u32,
    done: bool,
}

impl std::fmt::Debug for WatchHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WatchHandle")
            .field("id", &self.call.id)
            .field("done", &self.done)
            .finish()
    }
}

impl WatchHandle {
    /// The next event, waiting at most `wait`: `Ok(None)` once the watch ended (its
    /// directory went, or it was stopped), [`AgentError::Timeout`] when none came in time
    /// (the watch goes on).
    pub fn next_event(&mut self, wait: Duration) -> Result<Option<FsEvent>, AgentError> {
        if self.done {
            return Ok(None);
        }
        let r = match self.call.recv(Some(wait)) {
            Ok(r) => r,
            Err(e @ AgentError::Timeout(_)) => return Err(e),
            Err(e) => {
                self.done = true;
                return Err(e);
            }
        };
        match r {
            Response::FsEvent(ev) => {
                let cost = proto::event_cost(ev.path.len());
                self.used = self.used.saturating_add(cost);
                if self.used >= WATCH_WINDOW / 2 {
                    self.call.client.grant(self.call.id, self.used)?;
                    self.used = 0;
                }
                Ok(Some(ev))
            }
            Response::Exit(_) => {
                self.done = true;
                Ok(None)
            }
            r => {
                self.done = true;
                Err(unexpected(&r))
            }
        }
    }

    /// A function that stops the watch from elsewhere (as [`stop`](Self::stop)).
    pub fn stopper(&self) -> impl Fn() + Send + Sync + 'static {
        let (client, target) = (self.call.client.clone(), self.call.id);
        move || {
            let _ = client.start(&Request::Kill { target });
        }
    }

    /// Stops the watch: its `Exit` follows what was sent before.
    pub fn stop(&self) -> Result<(), AgentError> {
        self.call.client.start(&Request::Kill {
            target: self.call.id,
        })?;
        Ok(())
    }
}

impl Drop for WatchHandle {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.stop();
        }
    }
}

//! Watching a workspace directory for changes ([`Sandbox::watch`](crate::Sandbox::watch)),
//! from the host, for tiers whose workspace is a host directory (container, gVisor, wasm).
//!
//! One inotify instance serves every watch of the process ([`Watches::watch`]): inotify
//! instances are few (`fs.inotify.max_user_instances`, 128 by default, counted per host user
//! across *all* of its processes), so one per watch would let a client starve the host's
//! other services. A thread reads it and hands each event to the watches of its directory.
//!
//! What code in the sandbox controls is the tree being watched, so every directory is
//! reached as [`beneath`] reaches files: opened beneath the workspace's handle
//! with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` (a name swapped for a symlink is
//! skipped, never followed to the host), then watched through that descriptor
//! (`/proc/self/fd/N`), never by a path the host resolves; a descriptor the kernel reuses for
//! another directory (after its first one went) is told apart by the directory's device and
//! inode. What it can make the host hold is bounded: [`MAX_DIRS`] directories and
//! [`MAX_DIR_BYTES`] of their names per watch, [`MAX_KERNEL_WATCHES`] directories watched in
//! the process, [`MAX_SCAN`] entries read per new directory tree (past any of these a
//! recursive watch reports [`Error::ResourceExhausted`] once and keeps what it has),
//! [`MAX_QUEUED`] events and [`MAX_QUEUED_BYTES`] of their names waiting per watch (more are
//! dropped, and the next read reports the loss), [`MAX_WATCHES`] watches per process.

use std::collections::{HashMap, VecDeque};
use std::ffi::OsStr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::Instant;

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, InotifyEvent, WatchDescriptor};
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

use crate::beneath;
use crate::error::{Error, Result};
use crate::path::WorkspacePath;

/// Most directories one watch holds (a recursive watch of a bigger tree watches this many).
pub const MAX_DIRS: usize = 4096;
/// Most bytes of directory names (relative paths) one watch holds.
pub const MAX_DIR_BYTES: usize = 512 * 1024;
/// Most directories watched in one process, every watch together (inotify watches count
/// against the host user's `fs.inotify.max_user_watches`, shared with its other programs).
pub const MAX_KERNEL_WATCHES: usize = 65536;
/// Most entries a recursive watch reads per second when it takes in new directory trees
/// (a sandbox that moves a big tree in and out again cannot make the host read it over and
/// over).
pub const MAX_SCAN: usize = 16384;
/// Most watches one sandbox ([`Watches`]) holds at once.
pub const MAX_WATCHES_PER_SANDBOX: usize = 64;
/// Most events waiting to be read per watch; more are dropped and the loss reported.
pub const MAX_QUEUED: usize = 4096;
/// Most bytes of entry names waiting to be read per watch.
pub const MAX_QUEUED_BYTES: usize = 512 * 1024;
/// Most watches open at once in one process (each sandbox's [`Watches`] together).
pub const MAX_WATCHES: usize = 1024;

/// What happened to an entry of a watched directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FsEventKind {
    /// Created, or moved in from elsewhere.
    Create,
    /// Its content changed.
    Write,
    /// Removed.
    Remove,
    /// Moved away (renamed: a [`Create`](Self::Create) names where to, when it stays in the
    /// watched tree).
    Rename,
    /// Its mode, owner or times changed.
    Chmod,
}

/// One change in a watched directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsEvent {
    /// What happened.
    pub kind: FsEventKind,
    /// The entry, relative to the watched directory (`sub/file.txt` in a recursive watch);
    /// empty for the watched directory itself (removed or moved away: the watch then ends).
    pub path: String,
    /// Whether the entry is a directory.
    pub is_dir: bool,
}

/// The watches of one sandbox: [`watch`](Self::watch) adds one, [`close_all`](Self::close_all)
/// (at the sandbox's end) ends them all.
/// Clones share the list; the last one dropped ends its watches.
#[derive(Debug, Default, Clone)]
pub struct Watches {
    reg: Arc<Mutex<Registry>>,
}

/// What [`Watches`] keeps.
#[derive(Debug, Default)]
struct Registry {
    /// The host watches made here (the hub's ids).
    ids: Vec<u64>,
    /// The fed ones ([`Watches::fed`]), while their readers hold them.
    fed: Vec<Weak<Sub>>,
    /// Whether [`close_all`](Watches::close_all) ran (then a new watch starts ended).
    closed: bool,
}

impl Registry {
    /// The watches still open, after forgetting those that ended.
    fn open(&mut self, hub: Option<&Hub>) -> usize {
        if let Some(hub) = hub {
            let st = hub.lock();
            self.ids.retain(|i| st.watches.contains_key(i));
        }
        self.fed.retain(|w| w.strong_count() > 0);
        self.ids.len() + self.fed.len()
    }
}

impl Watches {
    /// Watches `path` (a workspace path, as the file API takes: `sub/dir` or
    /// `/workspace/sub/dir`) beneath the workspace handle `ws`, and its subdirectories too
    /// when `recursive`.
    ///
    /// # Errors
    /// [`Error::PathEscape`] for a path that leaves the workspace (through `..` or a symlink),
    /// [`Error::NotFound`] for a missing one, [`Error::InvalidSpec`] for one that is not a
    /// directory, [`Error::ResourceExhausted`] past [`MAX_WATCHES`].
    pub fn watch(&self, ws: OwnedFd, path: &str, recursive: bool) -> Result<Watch> {
        let wp = WorkspacePath::parse(path)?;
        let shown = wp.in_sandbox();
        let root = wp.relative();
        let hub = hub()?;
        let sub = Arc::new(Sub::default());
        // Held while the watch is registered: a `close_all` either runs before (the watch
        // starts ended) or after (it ends the watch with the others).
        let mut reg = self.reg.lock().unwrap_or_else(|p| p.into_inner());
        if reg.open(Some(&hub)) >= MAX_WATCHES_PER_SANDBOX {
            return Err(per_sandbox());
        }
        if reg.closed {
            sub.flag(false, true);
            return Ok(Watch {
                source: Source::Hub { id: 0, hub },
                sub,
            });
        }
        let id = {
            let mut st = hub.lock();
            if st.watches.len() >= MAX_WATCHES {
                return Err(Error::ResourceExhausted {
                    what: format!("file watches ({MAX_WATCHES} open in this process)"),
                });
            }
            let dir = open_dir_beneath(ws.as_fd(), &root).map_err(|e| {
                if e.raw_os_error() == Some(libc::ENOTDIR) {
                    Error::invalid("path", format!("{shown} is not a directory"))
                } else {
                    beneath::map_err(e, &shown, "watch")
                }
            })?;
            st.next_id += 1;
            let id = st.next_id;
            st.watches.insert(
                id,
                Entry {
                    ws,
                    root,
                    recursive,
                    sub: Arc::downgrade(&sub),
                    dirs: HashMap::new(),
                    dir_bytes: 0,
                    scan_left: MAX_SCAN,
                    scan_at: Instant::now(),
                },
            );
            let added = st.add_dir(&hub.fd, id, PathBuf::new(), dir);
            let watched = st
                .watches
                .get(&id)
                .is_some_and(|w| w.dirs.contains_key(Path::new("")));
            if added.is_err() || !watched {
                st.remove(&hub.fd, id);
                return Err(match added {
                    Err(e) if e.raw_os_error() != Some(libc::ENOSPC) => {
                        beneath::map_err(e, &shown, "watch")
                    }
                    _ => Error::ResourceExhausted {
                        what: format!(
                            "inotify watches ({MAX_KERNEL_WATCHES} directories watched in this \
                             process, or the host's `fs.inotify.max_user_watches`)"
                        ),
                    },
                });
            }
            if recursive {
                st.add_tree(&hub.fd, id, Path::new(""), None);
            }
            id
        };
        reg.ids.push(id);
        drop(reg);
        Ok(Watch {
            source: Source::Hub { id, hub },
            sub,
        })
    }

    /// [`watch`](Self::watch) on a blocking thread (it reads directories and takes the
    /// process's watch lock): what a backend's async `Sandbox::watch` calls.
    ///
    /// # Errors
    /// As [`watch`](Self::watch).
    pub async fn watch_blocking(&self, ws: OwnedFd, path: &str, recursive: bool) -> Result<Watch> {
        let (me, path) = (self.clone(), path.to_string());
        tokio::task::spawn_blocking(move || me.watch(ws, &path, recursive))
            .await
            .map_err(|e| Error::io("start a file watch", std::io::Error::other(e)))?
    }

    /// Ends every watch made here: their readers see the end once they have read what
    /// came before.
    pub fn close_all(&self) {
        let (ids, fed) = {
            let mut reg = self.reg.lock().unwrap_or_else(|p| p.into_inner());
            reg.closed = true;
            (std::mem::take(&mut reg.ids), std::mem::take(&mut reg.fed))
        };
        for sub in fed.iter().filter_map(Weak::upgrade) {
            sub.flag(false, true);
            // Its feeder ends by itself now (its pushes fail): nothing to stop, nothing of
            // the sandbox's to keep.
            drop(sub.on_drop.lock().ok().and_then(|mut h| h.take()));
        }
        // No watch of the hub's: nothing to remove, and no hub (an inotify instance and
        // its thread) to start for it.
        if ids.is_empty() {
            return;
        }
        if let Ok(hub) = hub() {
            let mut st = hub.lock();
            for id in ids {
                st.remove(&hub.fd, id);
            }
        }
    }
}

impl Drop for Watches {
    fn drop(&mut self) {
        if Arc::strong_count(&self.reg) == 1 {
            self.close_all();
        }
    }
}

/// An open watch: its events, in order. Dropping it stops watching.
#[derive(Debug)]
pub struct Watch {
    source: Source,
    sub: Arc<Sub>,
}

/// Where a watch's events come from.
#[derive(Debug)]
enum Source {
    /// The process's inotify instance ([`Watches::watch`]).
    Hub { id: u64, hub: Arc<Hub> },
    /// A [`WatchFeed`] (a guest agent's watch, relayed by its tier).
    Fed,
}

/// Watches fed from elsewhere open in this process (each holds its feeder: a thread or a
/// task of its tier); at most [`MAX_WATCHES`].
static FED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// The sending side of a [`Watch`] whose events come from elsewhere: a tier that cannot
/// watch its workspace from the host (the microVM tier: its guest agent watches) relays them
/// here. The same bounds as host watches apply to what waits unread ([`MAX_QUEUED`],
/// [`MAX_QUEUED_BYTES`]: more are dropped and the loss reported). Dropping the feed ends the
/// watch (its reader sees the end after what came before).
#[derive(Debug)]
pub struct WatchFeed {
    sub: Weak<Sub>,
}

impl Watches {
    /// A watch of this sandbox fed by the returned [`WatchFeed`] (its events come from
    /// elsewhere: a guest agent's watch), counted among the sandbox's watches and ended by
    /// [`close_all`](Self::close_all) as the others are.
    ///
    /// # Errors
    /// [`Error::ResourceExhausted`] past [`MAX_WATCHES_PER_SANDBOX`] in this sandbox or
    /// [`MAX_WATCHES`] fed ones in this process.
    pub fn fed(&self) -> Result<(Watch, WatchFeed)> {
        use std::sync::atomic::Ordering;
        let mut reg = self.reg.lock().unwrap_or_else(|p| p.into_inner());
        if reg.open(None) >= MAX_WATCHES_PER_SANDBOX {
            return Err(per_sandbox());
        }
        FED.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < MAX_WATCHES).then_some(n + 1)
        })
        .map_err(|_| Error::ResourceExhausted {
            what: format!("file watches ({MAX_WATCHES} relayed ones open in this process)"),
        })?;
        let sub = Arc::new(Sub::default());
        if reg.closed {
            sub.flag(false, true);
        }
        reg.fed.push(Arc::downgrade(&sub));
        let feed = WatchFeed {
            sub: Arc::downgrade(&sub),
        };
        Ok((
            Watch {
                source: Source::Fed,
                sub,
            },
            feed,
        ))
    }
}

fn per_sandbox() -> Error {
    Error::ResourceExhausted {
        what: format!("file watches ({MAX_WATCHES_PER_SANDBOX} open in this sandbox)"),
    }
}

impl WatchFeed {
    /// Queues `ev` for the reader; `false` once the [`Watch`] was dropped or ended (by
    /// [`Watches::close_all`]): stop feeding.
    pub fn push(&self, ev: FsEvent) -> bool {
        self.sub.upgrade().is_some_and(|s| s.push(ev))
    }

    /// Runs `stop` when the reader drops the [`Watch`] (at once if it did already): a
    /// feeder waiting on its source learns it without polling.
    pub fn on_reader_gone(&self, stop: impl FnOnce() + Send + 'static) {
        match self.sub.upgrade() {
            Some(s) => {
                if let Ok(mut h) = s.on_drop.lock() {
                    *h = Some(Box::new(stop));
                }
            }
            None => stop(),
        }
    }

    /// Tells the reader that events were lost (it sees [`Error::ResourceExhausted`] once);
    /// `false` once the [`Watch`] was dropped.
    pub fn lost(&self) -> bool {
        match self.sub.upgrade() {
            Some(s) => {
                s.flag(true, false);
                true
            }
            None => false,
        }
    }

    /// Whether the [`Watch`] is still held by a reader and not ended.
    pub fn is_open(&self) -> bool {
        self.sub
            .upgrade()
            .is_some_and(|s| s.queue.lock().is_ok_and(|q| !q.ended))
    }
}

impl Drop for WatchFeed {
    fn drop(&mut self) {
        if let Some(s) = self.sub.upgrade() {
            s.flag(false, true);
        }
        FED.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// What [`Watch::take_one`] found.
enum Taken {
    Item(Result<FsEvent>),
    Empty,
    Ended,
}

impl Watch {
    /// The next event, waiting for one; `None` once the watch ended (its directory was
    /// removed or moved away, or the sandbox ended) and everything before was read.
    ///
    /// # Errors
    /// [`Error::ResourceExhausted`] (once, then the events go on) when events were lost:
    /// more than [`MAX_QUEUED`] waited unread, the kernel's queue overflowed, or a
    /// recursive watch reached [`MAX_DIRS`] directories.
    pub async fn next(&mut self) -> Option<Result<FsEvent>> {
        let sub = Arc::clone(&self.sub);
        loop {
            let notified = sub.notify.notified();
            match self.take_one() {
                Taken::Item(item) => return Some(item),
                Taken::Ended => return None,
                Taken::Empty => notified.await,
            }
        }
    }

    /// Every event up to now without waiting, including those of changes made just before
    /// this call (the kernel's queue is read first). A fed watch ([`Watches::fed`]) has what
    /// reached the host so far: a change made just before may still be on its way.
    ///
    /// # Errors
    /// As [`next`](Self::next); the events read before the loss was noticed are dropped
    /// with it only if none came before it.
    pub fn try_events(&mut self) -> Result<Vec<FsEvent>> {
        if let Source::Hub { hub, .. } = &self.source {
            hub.pump();
        }
        let mut out = Vec::new();
        while let Taken::Item(item) = self.take_one() {
            match item {
                Ok(ev) => out.push(ev),
                Err(e) if out.is_empty() => return Err(e),
                Err(_) => {
                    // Reported on the next call, after these.
                    if let Ok(mut q) = self.sub.queue.lock() {
                        q.lost = true;
                    }
                    break;
                }
            }
        }
        Ok(out)
    }

    /// Whether the watch ended (nothing more will come after what is queued).
    pub fn is_ended(&self) -> bool {
        self.sub.queue.lock().map(|q| q.ended).unwrap_or(true)
    }

    /// The next queued item, or whether the watch is merely empty or ended.
    fn take_one(&self) -> Taken {
        let Ok(mut q) = self.sub.queue.lock() else {
            return Taken::Ended;
        };
        if q.lost {
            q.lost = false;
            return Taken::Item(Err(Error::ResourceExhausted {
                what: format!(
                    "file watch events: some were lost (more than {MAX_QUEUED} unread, the \
                     kernel's queue overflowed, or more than {MAX_DIRS} directories)"
                ),
            }));
        }
        if let Some(ev) = q.events.pop_front() {
            q.bytes -= ev.path.len();
            return Taken::Item(Ok(ev));
        }
        if q.ended {
            Taken::Ended
        } else {
            Taken::Empty
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        match &self.source {
            Source::Hub { id, hub } => {
                let mut st = hub.lock();
                st.remove(&hub.fd, *id);
            }
            Source::Fed => {
                let hook = self.sub.on_drop.lock().ok().and_then(|mut h| h.take());
                if let Some(stop) = hook {
                    stop();
                }
            }
        }
    }
}

/// What a watch's reader and the hub (or its feed) share.
#[derive(Default)]
struct Sub {
    queue: Mutex<Queue>,
    notify: Notify,
    /// A fed watch's feeder's stop ([`WatchFeed::on_reader_gone`]).
    on_drop: Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

impl std::fmt::Debug for Sub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sub")
            .field("queue", &self.queue)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Default)]
struct Queue {
    events: VecDeque<FsEvent>,
    /// Bytes of the queued events' names.
    bytes: usize,
    lost: bool,
    ended: bool,
}

impl Sub {
    /// Queues `ev` (or records its loss); `false` once the watch ended.
    fn push(&self, ev: FsEvent) -> bool {
        if let Ok(mut q) = self.queue.lock() {
            if q.ended {
                return false;
            }
            if q.events.len() >= MAX_QUEUED || q.bytes + ev.path.len() > MAX_QUEUED_BYTES {
                q.lost = true;
            } else {
                q.bytes += ev.path.len();
                q.events.push_back(ev);
            }
        }
        self.notify.notify_one();
        true
    }

    fn flag(&self, lost: bool, ended: bool) {
        if let Ok(mut q) = self.queue.lock() {
            q.lost |= lost;
            q.ended |= ended;
        }
        self.notify.notify_one();
    }
}

/// One watch as the hub keeps it.
#[derive(Debug)]
struct Entry {
    /// The workspace's handle: every directory is opened beneath it.
    ws: OwnedFd,
    /// The watched directory, relative to the workspace.
    root: PathBuf,
    recursive: bool,
    sub: Weak<Sub>,
    /// The directories it watches (relative to `root`) and their descriptors.
    dirs: HashMap<PathBuf, WatchDescriptor>,
    /// Bytes of `dirs`' names.
    dir_bytes: usize,
    /// Entries it may still read this second ([`MAX_SCAN`] a second), and when it was last
    /// refilled.
    scan_left: usize,
    scan_at: Instant,
}

impl Entry {
    /// Records that this watch could not take in everything: its reader sees lost events.
    fn mark_full(&self) {
        if let Some(s) = self.sub.upgrade() {
            s.flag(true, false);
        }
    }

    /// Whether it holds all the directories it may.
    fn at_capacity(&self) -> bool {
        self.dirs.len() >= MAX_DIRS || self.dir_bytes >= MAX_DIR_BYTES
    }

    /// The entries it may read now (refilled at [`MAX_SCAN`] a second).
    fn scan_budget(&mut self) -> usize {
        let now = Instant::now();
        let refill = (now.duration_since(self.scan_at).as_secs_f64() * MAX_SCAN as f64) as usize;
        if refill > 0 {
            self.scan_left = (self.scan_left + refill).min(MAX_SCAN);
            self.scan_at = now;
        }
        self.scan_left
    }
}

#[derive(Debug, Default)]
struct State {
    next_id: u64,
    watches: HashMap<u64, Entry>,
    /// Who watches each descriptor, and as which directory (relative to its root). The
    /// same directory watched twice is one descriptor (inotify's rule).
    wds: HashMap<WatchDescriptor, Vec<(u64, PathBuf)>>,
    /// The directory (device, inode) each descriptor was given for: the kernel may give a
    /// freed descriptor to another directory, and its old watchers must not see that one.
    inodes: HashMap<WatchDescriptor, (u64, u64)>,
}

/// The process's inotify instance and who listens to it.
#[derive(Debug)]
struct Hub {
    fd: Inotify,
    state: Mutex<State>,
}

const MASK: AddWatchFlags = AddWatchFlags::from_bits_truncate(
    libc::IN_CREATE
        | libc::IN_MODIFY
        | libc::IN_DELETE
        | libc::IN_MOVED_FROM
        | libc::IN_MOVED_TO
        | libc::IN_ATTRIB
        | libc::IN_DELETE_SELF
        | libc::IN_MOVE_SELF
        | libc::IN_ONLYDIR
        | libc::IN_EXCL_UNLINK,
);

fn hub() -> Result<Arc<Hub>> {
    static HUB: OnceLock<std::result::Result<Arc<Hub>, String>> = OnceLock::new();
    HUB.get_or_init(|| {
        let fd = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)
            .map_err(|e| format!("inotify_init1: {e}"))?;
        let hub = Arc::new(Hub {
            fd,
            state: Mutex::new(State::default()),
        });
        let reader = Arc::clone(&hub);
        std::thread::Builder::new()
            .name("sandbox-watch".into())
            .spawn(move || reader.run())
            .map_err(|e| format!("start the watch thread: {e}"))?;
        Ok(hub)
    })
    .clone()
    .map_err(|e| Error::io("watch files", std::io::Error::other(e)))
}

impl Hub {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The reader thread: wait for the instance to be readable, then hand out what it has.
    fn run(&self) {
        loop {
            let mut pfd = libc::pollfd {
                fd: self.fd.as_fd().as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd, no timeout.
            let n = unsafe { libc::poll(&mut pfd, 1, -1) };
            if n < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                tracing::warn!(
                    "file watches stopped: poll: {}",
                    std::io::Error::last_os_error()
                );
                return;
            }
            self.pump();
        }
    }

    /// Reads every event the kernel has queued and hands each to its watches.
    fn pump(&self) {
        let mut st = self.lock();
        loop {
            match self.fd.read_events() {
                Ok(events) if !events.is_empty() => {
                    for ev in events {
                        st.dispatch(&self.fd, ev);
                    }
                }
                _ => return,
            }
        }
    }
}

impl State {
    /// Watches directory `dir` (an open handle) as `rel` of watch `id`.
    fn add_dir(
        &mut self,
        fd: &Inotify,
        id: u64,
        rel: PathBuf,
        dir: OwnedFd,
    ) -> std::io::Result<()> {
        let kernel_watches = self.wds.len();
        let Some(w) = self.watches.get_mut(&id) else {
            return Ok(());
        };
        if w.dirs.contains_key(&rel) {
            return Ok(());
        }
        let bytes = rel.as_os_str().len();
        if w.dirs.len() >= MAX_DIRS
            || w.dir_bytes + bytes > MAX_DIR_BYTES
            || kernel_watches >= MAX_KERNEL_WATCHES
        {
            w.mark_full();
            return Ok(());
        }
        // SAFETY: fstat on an open descriptor into a zeroed struct it fills.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above: a valid fd and a valid out pointer.
        if unsafe { libc::fstat(dir.as_raw_fd(), &mut st) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let inode = (st.st_dev, st.st_ino);
        // The directory is reached through its handle (a magic link of our own process),
        // never by a path: what the sandbox swaps in after the open changes nothing.
        let proc_path = format!("/proc/self/fd/{}", dir.as_raw_fd());
        let wd = fd.add_watch(proc_path.as_str(), MASK)?;
        drop(dir);
        if self.inodes.get(&wd).is_some_and(|i| *i != inode) {
            // A descriptor the kernel gave again, to another directory, before the first
            // one's end reached us (a lost `IN_IGNORED`): its old watchers lose it.
            for (old, old_rel) in self.wds.remove(&wd).unwrap_or_default() {
                if let Some(ow) = self.watches.get_mut(&old) {
                    if ow.dirs.remove(&old_rel).is_some() {
                        ow.dir_bytes -= old_rel.as_os_str().len();
                    }
                    if let Some(s) = ow.sub.upgrade() {
                        s.flag(true, false);
                    }
                }
            }
        }
        self.inodes.insert(wd, inode);
        let Some(w) = self.watches.get_mut(&id) else {
            return Ok(());
        };
        w.dirs.insert(rel.clone(), wd);
        w.dir_bytes += bytes;
        let subs = self.wds.entry(wd).or_default();
        if !subs.iter().any(|(i, r)| *i == id && *r == rel) {
            subs.push((id, rel));
        }
        Ok(())
    }

    /// Watches every directory beneath `rel` (relative to watch `id`'s root), breadth first,
    /// one name at a time, not following symlinks. With `report`, every entry found is
    /// reported as created: a directory that appears in a recursive watch may have been
    /// filled before its own watch was in place (`mkdir d && touch d/f`), and those entries
    /// would otherwise never be seen (one made in between is reported twice).
    fn add_tree(&mut self, fd: &Inotify, id: u64, rel: &Path, report: Option<&Sub>) {
        let mut todo = VecDeque::from([rel.to_path_buf()]);
        while let Some(dir_rel) = todo.pop_front() {
            let Some(w) = self.watches.get_mut(&id) else {
                return;
            };
            // A tree the sandbox made huge (or moves in and out again) costs at most the
            // watch's scan budget.
            let budget = w.scan_budget();
            if w.at_capacity() || budget == 0 {
                w.mark_full();
                return;
            }
            let Ok(dir) = open_dir_beneath(w.ws.as_fd(), &w.root.join(&dir_rel)) else {
                continue;
            };
            let Ok((names, more)) = beneath::names_bounded(dir.as_fd(), budget) else {
                continue;
            };
            w.scan_left -= names.len();
            if more {
                w.mark_full();
            }
            for n in names {
                let Ok(st) = beneath::lstat_at(dir.as_fd(), &n) else {
                    continue;
                };
                let is_dir = st.st_mode & libc::S_IFMT == libc::S_IFDIR;
                let child_rel = dir_rel.join(OsStr::from_bytes(n.to_bytes()));
                if let Some(sub) = report {
                    sub.push(FsEvent {
                        kind: FsEventKind::Create,
                        path: child_rel.to_string_lossy().into_owned(),
                        is_dir,
                    });
                }
                if !is_dir {
                    continue;
                }
                self.add_child(fd, id, child_rel, &mut todo);
            }
        }
    }

    /// Opens and watches `child_rel` of watch `id`, queueing it in `todo` for its own
    /// entries; a failure is reported as lost events.
    fn add_child(
        &mut self,
        fd: &Inotify,
        id: u64,
        child_rel: PathBuf,
        todo: &mut VecDeque<PathBuf>,
    ) {
        let Some(w) = self.watches.get(&id) else {
            return;
        };
        let Ok(child) = open_dir_beneath(w.ws.as_fd(), &w.root.join(&child_rel)) else {
            // Gone again, or swapped for a link: nothing to watch there.
            return;
        };
        match self.add_dir(fd, id, child_rel.clone(), child) {
            Ok(()) => todo.push_back(child_rel),
            Err(_) => {
                if let Some(w) = self.watches.get_mut(&id) {
                    w.mark_full();
                }
            }
        }
    }

    /// Stops watching `rel` and everything beneath it for watch `id`.
    fn drop_tree(&mut self, fd: &Inotify, id: u64, rel: &Path) {
        let Some(w) = self.watches.get_mut(&id) else {
            return;
        };
        let gone: Vec<(PathBuf, WatchDescriptor)> = w
            .dirs
            .iter()
            .filter(|(p, _)| p.starts_with(rel))
            .map(|(p, wd)| (p.clone(), *wd))
            .collect();
        for (p, _) in &gone {
            if w.dirs.remove(p).is_some() {
                w.dir_bytes -= p.as_os_str().len();
            }
        }
        for (p, wd) in gone {
            self.unsubscribe(fd, wd, id, &p);
        }
    }

    fn unsubscribe(&mut self, fd: &Inotify, wd: WatchDescriptor, id: u64, rel: &Path) {
        if let Some(subs) = self.wds.get_mut(&wd) {
            subs.retain(|(i, r)| !(*i == id && r == rel));
            if subs.is_empty() {
                self.wds.remove(&wd);
                self.inodes.remove(&wd);
                // Fails harmlessly when the directory is gone already (IN_IGNORED came).
                let _ = fd.rm_watch(wd);
            }
        }
    }

    /// Ends watch `id`: its descriptors go, its reader sees the end.
    fn remove(&mut self, fd: &Inotify, id: u64) {
        if let Some(w) = self.watches.remove(&id) {
            for (p, wd) in w.dirs {
                self.unsubscribe(fd, wd, id, &p);
            }
            if let Some(s) = w.sub.upgrade() {
                s.flag(false, true);
            }
        }
    }

    fn dispatch(&mut self, fd: &Inotify, ev: InotifyEvent) {
        let m = ev.mask.bits();
        if m & libc::IN_Q_OVERFLOW != 0 {
            for w in self.watches.values() {
                if let Some(s) = w.sub.upgrade() {
                    s.flag(true, false);
                }
            }
            return;
        }
        let Some(subs) = self.wds.get(&ev.wd).cloned() else {
            return;
        };
        if m & libc::IN_IGNORED != 0 {
            // The directory is gone (or unwatched): forget the descriptor.
            for (id, rel) in subs {
                if let Some(w) = self.watches.get_mut(&id) {
                    if w.dirs.remove(&rel).is_some() {
                        w.dir_bytes -= rel.as_os_str().len();
                    }
                }
            }
            self.wds.remove(&ev.wd);
            self.inodes.remove(&ev.wd);
            return;
        }
        let is_dir = m & libc::IN_ISDIR != 0;
        for (id, rel) in subs {
            let Some(w) = self.watches.get(&id) else {
                continue;
            };
            let Some(sub) = w.sub.upgrade() else {
                continue;
            };
            if m & (libc::IN_DELETE_SELF | libc::IN_MOVE_SELF) != 0 {
                // The parent reported the entry already; only the root's own end matters.
                if rel.as_os_str().is_empty() {
                    let kind = if m & libc::IN_DELETE_SELF != 0 {
                        FsEventKind::Remove
                    } else {
                        FsEventKind::Rename
                    };
                    sub.push(FsEvent {
                        kind,
                        path: String::new(),
                        is_dir: true,
                    });
                    self.remove(fd, id);
                }
                continue;
            }
            let Some(name) = ev.name.as_deref() else {
                continue;
            };
            let entry = rel.join(name);
            let kind = if m & (libc::IN_CREATE | libc::IN_MOVED_TO) != 0 {
                FsEventKind::Create
            } else if m & libc::IN_MODIFY != 0 {
                FsEventKind::Write
            } else if m & libc::IN_DELETE != 0 {
                FsEventKind::Remove
            } else if m & libc::IN_MOVED_FROM != 0 {
                FsEventKind::Rename
            } else if m & libc::IN_ATTRIB != 0 {
                FsEventKind::Chmod
            } else {
                continue;
            };
            sub.push(FsEvent {
                kind,
                path: entry.to_string_lossy().into_owned(),
                is_dir,
            });
            let recursive = w.recursive;
            if is_dir && recursive {
                match kind {
                    FsEventKind::Create => {
                        let mut added = VecDeque::new();
                        self.add_child(fd, id, entry.clone(), &mut added);
                        if !added.is_empty() {
                            self.add_tree(fd, id, &entry, Some(&sub));
                        }
                    }
                    FsEventKind::Remove | FsEventKind::Rename => self.drop_tree(fd, id, &entry),
                    _ => {}
                }
            }
        }
    }
}

/// Opens directory `rel` beneath `ws` for watching: `openat2` with `RESOLVE_BENEATH` and
/// `RESOLVE_NO_SYMLINKS` (no symlink followed anywhere on the way, even one that stays
/// inside: a recursive watch never wanders through links).
fn open_dir_beneath(ws: BorrowedFd<'_>, rel: &Path) -> std::io::Result<OwnedFd> {
    beneath::open_resolving(
        ws,
        rel,
        libc::O_PATH | libc::O_DIRECTORY,
        0,
        libc::RESOLVE_NO_SYMLINKS,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn ws() -> (tempfile::TempDir, Watches) {
        (tempfile::tempdir().unwrap(), Watches::default())
    }

    fn open(d: &tempfile::TempDir) -> OwnedFd {
        beneath::open_dir(d.path()).unwrap()
    }

    /// Reads `w` four times: how many events came, and whether a loss was reported.
    fn drain(w: &mut Watch) -> (usize, bool) {
        let (mut seen, mut lost) = (0, false);
        for _ in 0..4 {
            match w.try_events() {
                Ok(evs) => seen += evs.len(),
                Err(Error::ResourceExhausted { .. }) => lost = true,
                Err(e) => panic!("{e}"),
            }
        }
        (seen, lost)
    }

    fn kinds(evs: &[FsEvent]) -> Vec<(FsEventKind, &str)> {
        evs.iter().map(|e| (e.kind, e.path.as_str())).collect()
    }

    #[tokio::test]
    async fn a_fed_watch_passes_on_what_it_is_fed_and_ends_with_its_feed() {
        let sandbox = Watches::default();
        let (mut w, feed) = sandbox.fed().unwrap();
        let ev = |p: &str| FsEvent {
            kind: FsEventKind::Create,
            path: p.into(),
            is_dir: false,
        };
        assert!(feed.push(ev("a")));
        assert!(feed.lost());
        assert!(feed.push(ev("b")));
        // The loss is said once, first, then what was kept comes.
        assert!(matches!(
            w.next().await,
            Some(Err(Error::ResourceExhausted { .. }))
        ));
        assert_eq!(w.next().await.unwrap().unwrap(), ev("a"));
        assert_eq!(w.try_events().unwrap(), vec![ev("b")]);
        // What waits unread is bounded as for host watches.
        for i in 0..MAX_QUEUED + 10 {
            assert!(feed.push(ev(&i.to_string())));
        }
        assert!(w.try_events().is_err());
        assert_eq!(w.try_events().unwrap().len(), MAX_QUEUED);
        assert!(!w.is_ended());
        drop(feed);
        assert!(w.is_ended());
        assert!(w.next().await.is_none());
        drop(w);
        // A reader that went away tells its feeder to stop, at once through its hook.
        let (w, feed) = sandbox.fed().unwrap();
        assert!(feed.is_open());
        let (tx, rx) = std::sync::mpsc::channel();
        feed.on_reader_gone(move || tx.send(()).unwrap());
        assert!(rx.try_recv().is_err());
        drop(w);
        rx.try_recv().unwrap();
        assert!(!feed.is_open());
        assert!(!feed.push(ev("late")));
        assert!(!feed.lost());
        // Fed watches count among the sandbox's, and end with it.
        let held: Vec<_> = (0..MAX_WATCHES_PER_SANDBOX)
            .map(|_| sandbox.fed().unwrap())
            .collect();
        assert!(matches!(
            sandbox.fed(),
            Err(Error::ResourceExhausted { .. })
        ));
        sandbox.close_all();
        for (w, feed) in &held {
            assert!(w.is_ended());
            assert!(!feed.push(ev("after")));
        }
        drop(held);
        let (w, _feed) = sandbox.fed().unwrap();
        assert!(
            w.is_ended(),
            "a watch made after the sandbox's end starts ended"
        );
    }

    #[test]
    fn events_of_a_directory_in_order() {
        let (d, w) = ws();
        std::fs::create_dir(d.path().join("a")).unwrap();
        let mut watch = w.watch(open(&d), "/workspace/a", false).unwrap();
        std::fs::write(d.path().join("a/f"), b"x").unwrap();
        std::fs::rename(d.path().join("a/f"), d.path().join("a/g")).unwrap();
        std::fs::set_permissions(
            d.path().join("a/g"),
            std::os::unix::fs::PermissionsExt::from_mode(0o600),
        )
        .unwrap();
        std::fs::remove_file(d.path().join("a/g")).unwrap();
        let evs = watch.try_events().unwrap();
        assert_eq!(
            kinds(&evs),
            vec![
                (FsEventKind::Create, "f"),
                (FsEventKind::Write, "f"),
                (FsEventKind::Rename, "f"),
                (FsEventKind::Create, "g"),
                (FsEventKind::Chmod, "g"),
                (FsEventKind::Remove, "g"),
            ]
        );
        assert!(watch.try_events().unwrap().is_empty());
    }

    #[test]
    fn recursive_watches_follow_new_directories_but_not_symlinks() {
        let (d, w) = ws();
        let outside = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("r/old")).unwrap();
        std::os::unix::fs::symlink(outside.path(), d.path().join("r/link")).unwrap();
        let mut watch = w.watch(open(&d), "r", true).unwrap();
        std::fs::write(d.path().join("r/old/a"), b"1").unwrap();
        std::fs::create_dir(d.path().join("r/new")).unwrap();
        // The watch of `new` is in place once its CREATE was read.
        let first = watch.try_events().unwrap();
        assert!(first.contains(&FsEvent {
            kind: FsEventKind::Create,
            path: "new".into(),
            is_dir: true
        }));
        std::fs::write(d.path().join("r/new/b"), b"2").unwrap();
        std::fs::write(outside.path().join("c"), b"3").unwrap();
        let evs = watch.try_events().unwrap();
        let all: Vec<_> = first.iter().chain(&evs).cloned().collect();
        assert!(kinds(&all).contains(&(FsEventKind::Create, "old/a")));
        assert!(kinds(&all).contains(&(FsEventKind::Create, "new/b")));
        assert!(
            !all.iter().any(|e| e.path.contains('c')),
            "a symlink's target was watched: {all:?}"
        );
    }

    #[test]
    fn a_directory_filled_before_its_watch_is_reported() {
        let (d, w) = ws();
        let mut watch = w.watch(open(&d), "", true).unwrap();
        // Made and filled at once, before the hub can watch `fast`: its entries come from
        // the scan that follows the new directory's watch.
        std::fs::create_dir_all(d.path().join("fast/deeper")).unwrap();
        std::fs::write(d.path().join("fast/deeper/f"), b"x").unwrap();
        let mut all = watch.try_events().unwrap();
        // The scan happens when `fast`'s CREATE is handled; once read, everything is in.
        all.extend(watch.try_events().unwrap());
        for want in ["fast", "fast/deeper", "fast/deeper/f"] {
            assert!(
                all.iter()
                    .any(|e| e.kind == FsEventKind::Create && e.path == want),
                "{want} not reported: {all:?}"
            );
        }
    }

    #[test]
    fn a_sandbox_holds_its_share_of_watches_and_a_big_tree_moved_in_is_reported_in_part() {
        let (d, w) = ws();
        let held: Vec<_> = (0..MAX_WATCHES_PER_SANDBOX)
            .map(|_| w.watch(open(&d), "", false).unwrap())
            .collect();
        assert!(matches!(
            w.watch(open(&d), "", false).unwrap_err(),
            Error::ResourceExhausted { .. }
        ));
        drop(held);
        // A tree bigger than a second's scan, moved into a recursive watch at once.
        std::fs::create_dir_all(d.path().join("in")).unwrap();
        std::fs::create_dir_all(d.path().join("out/big")).unwrap();
        for i in 0..(MAX_SCAN + 10) {
            std::fs::write(d.path().join(format!("out/big/f{i}")), b"").unwrap();
        }
        let mut deep = w.watch(open(&d), "in", true).unwrap();
        std::fs::rename(d.path().join("out/big"), d.path().join("in/big")).unwrap();
        let (seen, lost) = drain(&mut deep);
        assert!(lost, "a partial scan was not reported ({seen} events)");
        assert!(seen <= MAX_SCAN + 1, "{seen} events from one scan");
    }

    #[test]
    fn escapes_and_missing_paths_are_refused() {
        let (d, w) = ws();
        std::os::unix::fs::symlink("/etc", d.path().join("etc")).unwrap();
        std::fs::write(d.path().join("file"), b"").unwrap();
        for (p, want) in [("../x", "escape"), ("/etc", "escape"), ("etc", "escape")] {
            let e = w.watch(open(&d), p, false).unwrap_err();
            assert!(matches!(e, Error::PathEscape { .. }), "{p} ({want}): {e}");
        }
        assert!(matches!(
            w.watch(open(&d), "missing", false).unwrap_err(),
            Error::NotFound { .. }
        ));
        assert!(matches!(
            w.watch(open(&d), "file", false).unwrap_err(),
            Error::InvalidSpec { .. }
        ));
    }

    #[tokio::test]
    async fn removing_the_directory_ends_the_watch_and_close_all_ends_the_rest() {
        let (d, w) = ws();
        std::fs::create_dir(d.path().join("gone")).unwrap();
        std::fs::create_dir(d.path().join("stays")).unwrap();
        let mut a = w.watch(open(&d), "gone", false).unwrap();
        let mut b = w.watch(open(&d), "stays", true).unwrap();
        std::fs::remove_dir(d.path().join("gone")).unwrap();
        let ev = tokio::time::timeout(Duration::from_secs(30), a.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!((ev.kind, ev.path.as_str()), (FsEventKind::Remove, ""));
        assert!(a.next().await.is_none());
        w.close_all();
        assert!(tokio::time::timeout(Duration::from_secs(30), b.next())
            .await
            .unwrap()
            .is_none());
        assert!(b.is_ended());
    }

    #[test]
    fn a_flood_of_events_is_bounded_and_reported() {
        let (d, w) = ws();
        let mut watch = w.watch(open(&d), "", false).unwrap();
        // Distinct names: the kernel merges an event identical to the last one queued.
        for i in 0..(MAX_QUEUED + 10) {
            std::fs::write(d.path().join(format!("f{i}")), b"x").unwrap();
        }
        let (total, lost) = drain(&mut watch);
        assert!(lost, "the loss was not reported");
        assert!(total <= MAX_QUEUED, "{total} events queued");
    }
}

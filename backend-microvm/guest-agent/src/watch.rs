//! File watches (`Watch`): inotify on workspace directories, inside the guest (the host
//! cannot watch a guest's file system), each watch its own instance and thread, its events
//! sent within a window the host refills, as a background process's output is.
//!
//! What the host can be made to hold is bounded there (its queue per watch); here the
//! window bounds what is in flight, and what waits beyond it waits in the guest kernel's
//! inotify queue, whose overflow is reported as a `Lost` event. A directory that appears in
//! a recursive watch is watched and what it already holds reported as created (it may have
//! been filled before its watch was in place); at most [`MAX_WATCH_DIRS`] directories (and
//! [`MAX_WATCH_DIR_BYTES`] of their names) per watch.
//!
//! Commands may run as another user than the agent (`agent.user=`, an image's `User`) and
//! change the watched tree at will, so no path is looked up twice: every directory is opened
//! beneath the workspace's descriptor with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`
//! (a name swapped for a link is refused, never followed), then listed and watched through
//! that descriptor (`/proc/self/fd/N`).

use std::collections::VecDeque;

use super::*;
use crate::interactive::Window;
use crate::proto::{event_cost, FsEvent, FsKind, MAX_WATCHES, MAX_WATCH_DIRS, MAX_WATCH_DIR_BYTES};

extern "C" {
    fn inotify_init1(flags: c_int) -> c_int;
    fn inotify_add_watch(fd: c_int, path: *const c_char, mask: u32) -> c_int;
    fn inotify_rm_watch(fd: c_int, wd: c_int) -> c_int;
}

const IN_NONBLOCK: c_int = 0o4000;
const IN_CLOEXEC: c_int = 0o2_000_000;
const IN_MODIFY: u32 = 0x2;
const IN_ATTRIB: u32 = 0x4;
const IN_MOVED_FROM: u32 = 0x40;
const IN_MOVED_TO: u32 = 0x80;
const IN_CREATE: u32 = 0x100;
const IN_DELETE: u32 = 0x200;
const IN_DELETE_SELF: u32 = 0x400;
const IN_MOVE_SELF: u32 = 0x800;
const IN_Q_OVERFLOW: u32 = 0x4000;
const IN_IGNORED: u32 = 0x8000;
const IN_ONLYDIR: u32 = 0x0100_0000;
const IN_EXCL_UNLINK: u32 = 0x0400_0000;
const IN_ISDIR: u32 = 0x4000_0000;
const MASK: u32 = IN_CREATE
    | IN_MODIFY
    | IN_DELETE
    | IN_MOVED_FROM
    | IN_MOVED_TO
    | IN_ATTRIB
    | IN_DELETE_SELF
    | IN_MOVE_SELF
    | IN_ONLYDIR
    | IN_EXCL_UNLINK;
/// `struct inotify_event` without its name.
const EVENT_HEADER: usize = 16;
/// `errno` of a path that is not a directory.
const ENOTDIR: i32 = 20;
/// `errno` of a symbolic link refused on the way (`RESOLVE_NO_SYMLINKS`).
const ELOOP: i32 = 40;
/// `errno` of a path that leaves the directory (`RESOLVE_BENEATH`).
const EXDEV: i32 = 18;
/// `openat2(2)`'s number (x86_64 and the generic table alike).
const SYS_OPENAT2: i64 = 437;
const O_RDONLY_DIR_CLOEXEC: u64 = 0o200_000 | 0o2_000_000; // O_DIRECTORY | O_CLOEXEC
const RESOLVE_NO_SYMLINKS: u64 = 0x04;
const RESOLVE_BENEATH: u64 = 0x08;
/// Most watch threads alive in the guest: stopped ones end within [`STOP_CHECK_MS`], and
/// a client that starts and stops watches faster waits for them.
const MAX_THREADS: usize = 2 * MAX_WATCHES;
static THREADS: AtomicU64 = AtomicU64::new(0);

/// `struct open_how`.
#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

/// Opens directory `rel` beneath `dir` without following any symbolic link on the way.
fn open_beneath(dir: &File, rel: &Path) -> io::Result<File> {
    let name = if rel.as_os_str().is_empty() {
        CString::new(".")
    } else {
        CString::new(rel.as_os_str().as_bytes())
    }
    .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let how = OpenHow {
        flags: O_RDONLY_DIR_CLOEXEC,
        mode: 0,
        resolve: RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS,
    };
    // SAFETY: a valid descriptor, NUL-terminated path and `open_how` of the size passed,
    // all alive for the call; the descriptor returned is ours alone.
    let fd = unsafe {
        syscall(
            SYS_OPENAT2,
            i64::from(dir.as_raw_fd()),
            name.as_ptr(),
            &how as *const OpenHow,
            std::mem::size_of::<OpenHow>(),
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = i32::try_from(fd).map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
    // SAFETY: `fd` was just opened and is owned by nothing else.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// The magic link of an open descriptor: reaches exactly that directory.
fn fd_path(f: &File) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", f.as_raw_fd()))
}
/// How often a watch with nothing to report looks whether it was stopped.
const STOP_CHECK_MS: c_int = 200;

/// A running watch's controls.
pub(crate) struct Watching {
    window: Window,
    stopped: AtomicBool,
}

impl Watching {
    /// More window (a `Grant`).
    pub(crate) fn give(&self, bytes: u64) {
        self.window.give(bytes);
    }

    /// Ends the watch (a `Kill`, or the agent's shutdown).
    pub(crate) fn stop(&self) {
        self.stopped.store(true, Ordering::SeqCst);
        self.window.close();
    }
}

/// The running watches: request id -> controls.
pub(crate) type Table = Arc<Mutex<HashMap<u32, Arc<Watching>>>>;

/// An inotify instance, closed on drop.
struct Inotify(File);

impl Inotify {
    fn new() -> io::Result<Inotify> {
        // SAFETY: no pointers; the descriptor returned is ours alone.
        let fd = unsafe { inotify_init1(IN_NONBLOCK | IN_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just opened and is owned by nothing else.
        Ok(Inotify(unsafe { File::from_raw_fd(fd) }))
    }

    fn add(&self, dir: &Path) -> io::Result<i32> {
        let c = CString::new(dir.as_os_str().as_bytes())
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: a valid NUL-terminated path for the duration of the call.
        let wd = unsafe { inotify_add_watch(self.0.as_raw_fd(), c.as_ptr(), MASK) };
        if wd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(wd)
    }

    fn remove(&self, wd: i32) {
        // SAFETY: no pointers; fails harmlessly for a descriptor already gone.
        unsafe { inotify_rm_watch(self.0.as_raw_fd(), wd) };
    }

    /// Waits up to [`STOP_CHECK_MS`] for events.
    fn wait(&self) {
        crate::interactive::wait_readable_for(&self.0, STOP_CHECK_MS);
    }
}

/// Starts watch `id` of `path`: the directory is opened and watched here (or one `Error`
/// answers), then its thread takes in the tree beneath it (`recursive`), answers `Ok`, and
/// sends the events and the final `Exit`.
pub(crate) fn start(st: &Arc<State>, id: u32, path: &str, recursive: bool, window: u32) {
    let (ws, rel, wd, ino, me) = match open(st, id, path, window) {
        Ok(x) => x,
        Err((kind, message)) => return st.chan.error(id, kind, message),
    };
    let (chan, table) = (st.chan.clone(), st.watches.clone());
    let mut w = Run {
        ino,
        ws,
        root: rel,
        recursive,
        dirs: HashMap::from([(wd, PathBuf::new())]),
        dir_bytes: 0,
        ready: false,
        lost: false,
        me,
        chan: chan.clone(),
        id,
    };
    THREADS.fetch_add(1, Ordering::SeqCst);
    let spawned = thread::Builder::new().spawn(move || {
        // What the tree already holds is watched before `Ok`: a change made after the host
        // has it is seen.
        let scanned = !w.recursive || w.add_tree(Path::new(""), false);
        if scanned && !w.stopped() {
            w.chan.send(id, &Response::Ok);
            w.ready = true;
            if !w.lost || w.send(FsKind::Lost, String::new(), true) {
                w.run();
            }
        }
        remove_if_same(&table, id, &w.me);
        w.chan.send(id, &Response::Exit(ExitInfo::default()));
        drop(w);
        THREADS.fetch_sub(1, Ordering::SeqCst);
    });
    if let Err(e) = spawned {
        THREADS.fetch_sub(1, Ordering::SeqCst);
        lock(&st.watches).remove(&id);
        st.chan
            .error(id, ErrorKind::Io, format!("watch thread: {e}"));
    }
}

/// Forgets watch `id` if it is still `me` (a `Kill` may have freed its place already).
fn remove_if_same(table: &Table, id: u32, me: &Arc<Watching>) {
    let mut t = lock(table);
    if t.get(&id).is_some_and(|w| Arc::ptr_eq(w, me)) {
        t.remove(&id);
    }
}

/// The workspace's descriptor, the watched directory (relative to it), its watch
/// descriptor in the new instance, the instance, and the watch's controls (registered).
#[allow(clippy::type_complexity)]
fn open(
    st: &State,
    id: u32,
    path: &str,
    window: u32,
) -> Result<(File, PathBuf, i32, Inotify, Arc<Watching>), FileError> {
    let full = ws_path(&st.workspace, path)?;
    let rel = full
        .strip_prefix(&st.workspace)
        .map_err(|_| (ErrorKind::PathEscape, format!("{path}: outside /workspace")))?
        .to_path_buf();
    let mut table = lock(&st.watches);
    if table.len() >= MAX_WATCHES || THREADS.load(Ordering::SeqCst) >= MAX_THREADS as u64 {
        return Err((
            ErrorKind::TooLarge,
            format!("file watches: {MAX_WATCHES} open in this sandbox"),
        ));
    }
    let ws = File::open(&st.workspace).map_err(|e| io_err("watch", path, &e))?;
    let dir = open_beneath(&ws, &rel).map_err(|e| match e.raw_os_error() {
        Some(ENOTDIR) => (ErrorKind::Invalid, format!("{path}: not a directory")),
        Some(ELOOP | EXDEV) => (
            ErrorKind::PathEscape,
            format!("{path}: a symbolic link on the way (not followed)"),
        ),
        _ => io_err("watch", path, &e),
    })?;
    let ino = Inotify::new().map_err(|e| io_err("watch", path, &e))?;
    let wd = ino
        .add(&fd_path(&dir))
        .map_err(|e| io_err("watch", path, &e))?;
    let me = Arc::new(Watching {
        window: Window::new(window),
        stopped: AtomicBool::new(false),
    });
    table.insert(id, me.clone());
    Ok((ws, rel, wd, ino, me))
}

/// One watch's thread.
struct Run {
    ino: Inotify,
    /// The workspace: every directory is opened beneath it.
    ws: File,
    /// The watched directory, relative to the workspace.
    root: PathBuf,
    recursive: bool,
    /// Watched directories: descriptor -> path relative to `root`.
    dirs: HashMap<i32, PathBuf>,
    /// Bytes of `dirs`' names.
    dir_bytes: usize,
    /// Whether `Ok` went: events may follow.
    ready: bool,
    /// A loss found before `Ok` (the tree taken in was too big), said right after it.
    lost: bool,
    me: Arc<Watching>,
    chan: Chan,
    id: u32,
}

impl Run {
    fn stopped(&self) -> bool {
        self.me.stopped.load(Ordering::SeqCst)
    }

    fn run(&mut self) {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            if self.stopped() {
                return;
            }
            let n = match (&self.ino.0).read(&mut buf) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.ino.wait();
                    continue;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => return,
            };
            let mut at = 0;
            while at + EVENT_HEADER <= n {
                let word = |i: usize| {
                    let b = buf.get(at + i..at + i + 4).unwrap_or(&[0; 4]);
                    u32::from_ne_bytes([b[0], b[1], b[2], b[3]])
                };
                let (wd, mask, len) = (word(0) as i32, word(4), word(12) as usize);
                let name_bytes = buf.get(at + EVENT_HEADER..at + EVENT_HEADER + len);
                at += EVENT_HEADER + len;
                let name = name_bytes.map(|b| {
                    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
                    OsStr::from_bytes(b.get(..end).unwrap_or_default()).to_os_string()
                });
                if !self.event(wd, mask, name.filter(|n| !n.is_empty())) {
                    return;
                }
            }
        }
    }

    /// Handles one kernel event; `false` once the watch is over.
    fn event(&mut self, wd: i32, mask: u32, name: Option<std::ffi::OsString>) -> bool {
        if mask & IN_Q_OVERFLOW != 0 {
            return self.send(FsKind::Lost, String::new(), true);
        }
        let Some(rel) = self.dirs.get(&wd).cloned() else {
            return true;
        };
        let is_root = rel.as_os_str().is_empty();
        if mask & IN_IGNORED != 0 {
            self.forget(wd);
            if is_root {
                // The directory's watch went without its removal being reported (its file
                // system was unmounted): nothing is watched any more.
                self.send(FsKind::Remove, String::new(), true);
                return false;
            }
            return true;
        }
        if mask & (IN_DELETE_SELF | IN_MOVE_SELF) != 0 {
            // The parent reported the entry already; only the root's own end matters.
            if is_root {
                let kind = if mask & IN_DELETE_SELF != 0 {
                    FsKind::Remove
                } else {
                    FsKind::Rename
                };
                self.send(kind, String::new(), true);
                return false;
            }
            return true;
        }
        let Some(name) = name else {
            return true;
        };
        let entry = rel.join(name);
        let kind = if mask & (IN_CREATE | IN_MOVED_TO) != 0 {
            FsKind::Create
        } else if mask & IN_MODIFY != 0 {
            FsKind::Write
        } else if mask & IN_DELETE != 0 {
            FsKind::Remove
        } else if mask & IN_MOVED_FROM != 0 {
            FsKind::Rename
        } else if mask & IN_ATTRIB != 0 {
            FsKind::Chmod
        } else {
            return true;
        };
        let is_dir = mask & IN_ISDIR != 0;
        if !self.send(kind, entry.to_string_lossy().into_owned(), is_dir) {
            return false;
        }
        if is_dir && self.recursive {
            match kind {
                FsKind::Create => match self.add_dir(&entry) {
                    Some(true) => return self.add_tree(&entry, true),
                    Some(false) => {}
                    None => return false,
                },
                FsKind::Remove | FsKind::Rename => self.drop_tree(&entry),
                _ => {}
            }
        }
        true
    }

    /// Watches directory `rel` (opened beneath the workspace, never through a link):
    /// `Some(true)` if it now is, `Some(false)` if it could not be (gone, a link, or the
    /// watch is full: then the loss is reported), `None` once the watch is over.
    fn add_dir(&mut self, rel: &Path) -> Option<bool> {
        let bytes = rel.as_os_str().len();
        if self.dirs.len() >= MAX_WATCH_DIRS || self.dir_bytes + bytes > MAX_WATCH_DIR_BYTES {
            if !self.ready {
                self.lost = true;
                return Some(false);
            }
            return self
                .send(FsKind::Lost, String::new(), true)
                .then_some(false);
        }
        let Ok(dir) = open_beneath(&self.ws, &self.root.join(rel)) else {
            return Some(false);
        };
        match self.ino.add(&fd_path(&dir)) {
            Ok(wd) => {
                if let Some(old) = self.dirs.insert(wd, rel.to_path_buf()) {
                    // The same directory again (moved within the tree): one entry.
                    self.dir_bytes -= old.as_os_str().len();
                }
                self.dir_bytes += bytes;
                Some(true)
            }
            Err(_) => Some(false),
        }
    }

    /// Watches every directory beneath `rel`, breadth first, each opened beneath the
    /// workspace (never through a link); with `report`, every entry found is sent as
    /// created. `false` once the watch is over.
    fn add_tree(&mut self, rel: &Path, report: bool) -> bool {
        let mut todo = VecDeque::from([rel.to_path_buf()]);
        while let Some(dir) = todo.pop_front() {
            let Ok(handle) = open_beneath(&self.ws, &self.root.join(&dir)) else {
                continue;
            };
            let Ok(rd) = fs::read_dir(fd_path(&handle)) else {
                continue;
            };
            for e in rd.flatten() {
                if self.stopped() {
                    return false;
                }
                let child = dir.join(e.file_name());
                let is_dir = e.file_type().map(|t| t.is_dir()).unwrap_or(false);
                let shown = child.to_string_lossy().into_owned();
                if report && !self.send(FsKind::Create, shown, is_dir) {
                    return false;
                }
                if is_dir {
                    match self.add_dir(&child) {
                        Some(true) => todo.push_back(child),
                        Some(false) => {}
                        None => return false,
                    }
                }
            }
        }
        true
    }

    /// Forgets descriptor `wd` (its directory went).
    fn forget(&mut self, wd: i32) {
        if let Some(p) = self.dirs.remove(&wd) {
            self.dir_bytes -= p.as_os_str().len();
        }
    }

    /// Stops watching `rel` and everything beneath it.
    fn drop_tree(&mut self, rel: &Path) {
        let gone: Vec<i32> = self
            .dirs
            .iter()
            .filter(|(_, p)| p.starts_with(rel))
            .map(|(wd, _)| *wd)
            .collect();
        for wd in gone {
            self.forget(wd);
            self.ino.remove(wd);
        }
    }

    /// Sends one event once the window allows; `false` once the watch was stopped.
    fn send(&self, kind: FsKind, path: String, is_dir: bool) -> bool {
        let cost = event_cost(path.len()) as usize;
        let mut got = 0;
        while got < cost {
            match self.me.window.take(cost - got) {
                Some(n) => got += n,
                None => return false,
            }
        }
        self.chan
            .send(self.id, &Response::FsEvent(FsEvent { kind, path, is_dir }));
        true
    }
}

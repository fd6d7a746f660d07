//! Commands: `exec` and background processes' start (a new process group, the exact
//! environment, stdin, the timeout, output streamed in chunks, the exit status).

use super::*;

pub(crate) fn pipe() -> io::Result<(File, File)> {
    let mut fds = [0 as c_int; 2];
    // SAFETY: fds is a writable array of two ints.
    if unsafe { pipe2(fds.as_mut_ptr(), O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: pipe2 returned two new descriptors that we now own.
    Ok(unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) })
}

/// Finds `prog` in `path` like execvp does (`sandbox_agent_proto::path`).
pub(crate) fn lookup(prog: &str, path: &str, cwd: &Path) -> Option<PathBuf> {
    sandbox_agent_proto::path::lookup(prog, path, cwd)
}

pub(crate) fn exit_info(status: i32) -> ExitInfo {
    let sig = status & 0x7f;
    if sig == 0 {
        ExitInfo {
            code: Some((status >> 8) & 0xff),
            ..ExitInfo::default()
        }
    } else {
        ExitInfo {
            signal: Some(sig),
            ..ExitInfo::default()
        }
    }
}

/// Pumps one output pipe to the channel, within the shared output budget.
pub(crate) fn pump(
    mut r: File,
    chan: Chan,
    id: u32,
    stderr: bool,
    sent: Arc<AtomicU64>,
    max: u64,
    truncated: Arc<AtomicBool>,
) {
    let mut buf = vec![0u8; proto::CHUNK];
    loop {
        let n = match r.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => return,
        };
        let mut take = n;
        if max > 0 {
            let before = sent.fetch_add(n as u64, Ordering::SeqCst);
            let left = max.saturating_sub(before);
            take = usize::try_from(left.min(n as u64)).unwrap_or(n);
            if take < n {
                truncated.store(true, Ordering::SeqCst);
            }
        }
        if take > 0 {
            let data = buf.get(..take).unwrap_or_default().to_vec();
            chan.send(id, &Response::output(stderr, data));
        }
    }
}

pub(crate) fn resolve_cwd(ws: &Path, cwd: &str) -> PathBuf {
    if cwd.is_empty() {
        return ws.to_path_buf();
    }
    if let Some(rest) = cwd.strip_prefix(WORKSPACE) {
        if rest.is_empty() || rest.starts_with('/') {
            return ws.join(rest.trim_start_matches('/'));
        }
    }
    let p = Path::new(cwd);
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        ws.join(p)
    }
}

/// Runs `x` for request `id`: an exec, or with `spawn` (its terminal, if any, and its
/// initial output window) a background process (see [`interactive`]).
/// Removes a request from [`State::starting`] when its exec thread is done with it.
struct Starting<'a>(&'a State, u32);

impl Drop for Starting<'_> {
    fn drop(&mut self) {
        lock(&self.0.starting).remove(&self.1);
    }
}

pub(crate) fn exec(st: &State, id: u32, x: ExecRequest, spawn: Option<(Option<(u16, u16)>, u32)>) {
    // However this ends before the fork, the request is no longer starting.
    let _starting = Starting(st, id);
    let chan = &st.chan;
    let Some(prog) = x.argv.first() else {
        return chan.error(id, ErrorKind::Invalid, "empty argv");
    };
    let cwd = resolve_cwd(&st.workspace, &x.cwd);
    let path_var = x
        .env
        .iter()
        .rev()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| v.clone());
    let mut env: Vec<String> = x.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
    if path_var.is_none() {
        env.push(format!("PATH={DEFAULT_PATH}"));
    }
    let path_var = path_var.unwrap_or_else(|| DEFAULT_PATH.to_string());
    let Some(exe) = lookup(prog, &path_var, &cwd) else {
        if spawn.is_some() {
            // A background process is answered `Ok` when it starts, before its output.
            chan.send(id, &Response::Ok);
        }
        chan.send(
            id,
            &Response::Stderr(format!("agent: {prog}: command not found\n").into_bytes()),
        );
        return chan.send(
            id,
            &Response::Exit(ExitInfo {
                code: Some(127),
                ..ExitInfo::default()
            }),
        );
    };
    // Everything the child needs, prepared before fork: it may not allocate afterwards.
    let to_c = |s: &[u8]| CString::new(s).ok();
    let exe_c = to_c(exe.as_os_str().as_bytes());
    let cwd_c = to_c(cwd.as_os_str().as_bytes());
    let argv_c: Option<Vec<CString>> = x.argv.iter().map(|a| to_c(a.as_bytes())).collect();
    let env_c: Option<Vec<CString>> = env.iter().map(|a| to_c(a.as_bytes())).collect();
    let (Some(exe_c), Some(cwd_c), Some(argv_c), Some(env_c)) = (exe_c, cwd_c, argv_c, env_c)
    else {
        return chan.error(id, ErrorKind::Invalid, "NUL byte in argv, env or cwd");
    };
    let mut argv_p: Vec<*const c_char> = argv_c.iter().map(|c| c.as_ptr()).collect();
    argv_p.push(std::ptr::null());
    let mut env_p: Vec<*const c_char> = env_c.iter().map(|c| c.as_ptr()).collect();
    env_p.push(std::ptr::null());

    let pipes = (|| Ok::<_, io::Error>((pipe()?, pipe()?, pipe()?, pipe()?)))();
    let ((in_r, in_w), (out_r, out_w), (err_r, err_w), (fail_r, fail_w)) = match pipes {
        Ok(p) => p,
        Err(e) => return chan.error(id, ErrorKind::Io, format!("pipe: {e}")),
    };
    // A terminal instead of the pipes: the child's stdin, stdout, stderr and controlling
    // terminal (of a session of its own).
    let pty = match spawn.and_then(|(tty, _)| tty) {
        Some((rows, cols)) => match interactive::open_pty(rows, cols) {
            Ok(p) => Some(p),
            Err(e) => return chan.error(id, ErrorKind::Io, format!("terminal: {e}")),
        },
        None => None,
    };
    let slave_fd = pty.as_ref().map_or(-1, |(_, slave)| slave.as_raw_fd());
    let user = st.user;
    let (tx, rx) = mpsc::channel();
    let (m, cv) = &*st.procs;
    let pid = {
        // Hold the table while forking so the reaper cannot see the child's exit before the
        // child is registered.
        let mut g = lock(m);
        // SAFETY: fork; the child below only makes async-signal-safe calls on data prepared
        // before the fork, then execs or exits.
        let pid = unsafe { fork() };
        if pid == 0 {
            // SAFETY: child side, async-signal-safe calls only; all pointers were prepared
            // before fork and stay valid until execve or _exit.
            unsafe {
                // Every signal at its default, none blocked: not the agent's ignored
                // `SIGPIPE`, not what its own parent ignored or blocked (in test mode), nor
                // the forking thread's mask.
                reset_signals();
                if slave_fd >= 0 {
                    setsid();
                    interactive::ioctl(slave_fd, interactive::TIOCSCTTY, 0);
                    dup2(slave_fd, 0);
                    dup2(slave_fd, 1);
                    dup2(slave_fd, 2);
                } else {
                    setpgid(0, 0);
                    dup2(in_r.as_raw_fd(), 0);
                    dup2(out_w.as_raw_fd(), 1);
                    dup2(err_w.as_raw_fd(), 2);
                }
                // The image's user: groups, then gid, then uid (after which none can change).
                let dropped = match user {
                    None => true,
                    Some((uid, gid)) => {
                        setgroups(0, std::ptr::null()) == 0 && setgid(gid) == 0 && setuid(uid) == 0
                    }
                };
                if dropped && chdir(cwd_c.as_ptr()) == 0 {
                    execve(exe_c.as_ptr(), argv_p.as_ptr(), env_p.as_ptr());
                }
                let e = (*__errno_location()).to_le_bytes();
                write(fail_w.as_raw_fd(), e.as_ptr(), e.len());
                _exit(127);
            }
        }
        if pid > 0 {
            g.waiters.insert(pid, tx);
            g.generation = g.generation.wrapping_add(1);
            cv.notify_all();
        }
        pid
    };
    if pid < 0 {
        return chan.error(
            id,
            ErrorKind::Io,
            format!("fork: {}", io::Error::last_os_error()),
        );
    }
    // Also set the group from the parent side (whichever runs first wins; same result). Not
    // for a terminal's session leader: `setsid` fails in a process that leads a group.
    if pty.is_none() {
        // SAFETY: no pointers.
        unsafe { setpgid(pid, pid) };
    }
    // Running from now on; a signal that came while it was starting goes now.
    let pending = {
        let mut running = lock(&st.running);
        running.insert(id, pid);
        lock(&st.starting).remove(&id).flatten()
    };
    if let Some(signo) = pending {
        // SAFETY: kill on the group (and the process) we just made; no pointers.
        unsafe {
            kill(-pid, signo);
            kill(pid, signo);
        }
    }
    drop((in_r, out_w, err_w, fail_w));
    // Our copy of the terminal's slave goes: its reads end when the process's copies do.
    let master = pty.map(|(m, _slave)| m);

    // A background process is registered before anything can fail, so its `Input`s find it.
    let mut input = None;
    if let Some((_, window)) = spawn {
        let (tx, rx) = mpsc::channel();
        let tty = master.as_ref().and_then(|m| m.try_clone().ok());
        let w = match &master {
            Some(m) => m.try_clone().ok(),
            None => Some(in_w.try_clone().ok()).flatten(),
        };
        let p = Arc::new(interactive::Spawned {
            input: Mutex::new(Some(tx)),
            tty,
            window: Arc::new(interactive::Window::new(window)),
        });
        lock(&st.spawned).insert(id, Arc::clone(&p));
        input = Some((p, rx, w));
        // Started and registered: the host's `Input`s and `Signal`s find it from here on.
        chan.send(id, &Response::Ok);
    }

    let mut fail = [0u8; 4];
    let mut fail_r = fail_r;
    let exec_failed = matches!(fail_r.read(&mut fail), Ok(4));
    let stdin = x.stdin;
    let sent = Arc::new(AtomicU64::new(0));
    let truncated = Arc::new(AtomicBool::new(false));
    let (writer, readers): (_, Vec<_>) = match input {
        // A background process: its input thread, and its output within the window (a
        // terminal's output, stdout and stderr merged, is stdout).
        Some((p, rx, w)) => {
            let (c, tty) = (chan.clone(), master.is_some());
            let writer = thread::spawn(move || {
                if let Some(w) = w {
                    let sink = if tty {
                        interactive::Sink::Tty(w)
                    } else {
                        interactive::Sink::Pipe(w)
                    };
                    interactive::input_thread(sink, stdin, rx, c);
                }
            });
            drop(in_w);
            let outputs: Vec<(File, bool)> = match master {
                Some(m) => vec![(m, false)],
                None => vec![(out_r, false), (err_r, true)],
            };
            let readers = outputs
                .into_iter()
                .map(|(r, is_err)| {
                    let (c, win) = (chan.clone(), Arc::clone(&p.window));
                    thread::spawn(move || interactive::pump_windowed(r, c, id, is_err, win))
                })
                .collect();
            (writer, readers)
        }
        None => {
            let writer = thread::spawn(move || {
                let mut w = in_w;
                let _ = w.write_all(&stdin);
            });
            let readers = [(out_r, false), (err_r, true)]
                .into_iter()
                .map(|(r, is_err)| {
                    let (c, s, t) = (chan.clone(), sent.clone(), truncated.clone());
                    let max = x.max_output;
                    thread::spawn(move || pump(r, c, id, is_err, s, max, t))
                })
                .collect();
            (writer, readers)
        }
    };

    let mut timed_out = false;
    let status = if x.timeout_ms > 0 {
        match rx.recv_timeout(Duration::from_millis(x.timeout_ms)) {
            Ok(s) => Some(s),
            Err(RecvTimeoutError::Timeout) => {
                timed_out = true;
                // SAFETY: kill on the child's own process group; no pointers.
                unsafe { kill(-pid, SIGKILL) };
                rx.recv().ok()
            }
            Err(RecvTimeoutError::Disconnected) => None,
        }
    } else {
        rx.recv().ok()
    };
    // Whatever the command left behind in its group goes too (it would hold the pipes open).
    // SAFETY: as above.
    unsafe { kill(-pid, SIGKILL) };
    for r in readers {
        let _ = r.join();
    }
    // A background process's input thread ends with the last sender of its queue.
    lock(&st.spawned).remove(&id);
    let _ = writer.join();
    lock(&st.running).remove(&id);
    if exec_failed {
        let e = io::Error::from_raw_os_error(i32::from_le_bytes(fail));
        chan.send(
            id,
            &Response::Stderr(format!("agent: {prog}: {e}\n").into_bytes()),
        );
    }
    let mut info = status.map(exit_info).unwrap_or_default();
    info.timed_out = timed_out;
    info.truncated = truncated.load(Ordering::SeqCst);
    if exec_failed {
        info = ExitInfo {
            code: Some(if fail_errno_is_noent(&fail) { 127 } else { 126 }),
            ..info
        };
    }
    chan.send(id, &Response::Exit(info));
}

pub(crate) fn fail_errno_is_noent(fail: &[u8; 4]) -> bool {
    i32::from_le_bytes(*fail) == 2
}

//! The VM's threads: one per vCPU and the I/O thread (virtio queues, the deadline), spawned
//! early under their seccomp filters and handed their jobs when the VM starts.

use super::*;

/// What the I/O thread gets when the VM starts.
struct IoJob {
    shared: Arc<Shared>,
    transports: Vec<Arc<Mutex<MmioTransport>>>,
    deadline: Option<Instant>,
}

/// A VM's threads. They are spawned when the VM is built, install their seccomp filters at
/// once and wait for their job, so that thread creation and filter installation (~0.1 ms
/// each here) overlap the rest of the set-up instead of delaying the guest's start. A
/// thread whose job sender goes away (the VM is dropped unstarted) just ends.
#[derive(Default)]
pub(super) struct Threads {
    vcpu_jobs: Vec<mpsc::Sender<VcpuContext>>,
    io_job: Option<mpsc::Sender<IoJob>>,
    handles: Vec<JoinHandle<()>>,
}

/// Installs `prog` on the calling thread, if there is one.
fn install_filter(
    prog: Option<&seccompiler::BpfProgram>,
) -> std::result::Result<(), seccompiler::Error> {
    match prog {
        Some(p) => seccompiler::apply_filter(p),
        None => Ok(()),
    }
}

impl Threads {
    /// One thread per vCPU, and the I/O thread when there is something for it to do (a
    /// virtio device to serve or a deadline to enforce).
    pub(super) fn spawn(cfg: &VmConfig, tids: &Arc<Vec<AtomicI32>>) -> Result<Threads> {
        let (vcpu_prog, io_prog) = if cfg.seccomp {
            (
                Some(crate::seccomp::vcpu_filter()?),
                Some(crate::seccomp::io_filter()?),
            )
        } else {
            (None, None)
        };
        // Dropping `t` on an error below ends and joins the threads spawned so far.
        let mut t = Threads::default();
        for id in 0..usize::from(cfg.vcpus) {
            let (tx, rx) = mpsc::channel::<VcpuContext>();
            let tids = tids.clone();
            let prog = vcpu_prog.clone();
            let h = std::thread::Builder::new()
                .name(format!("microvm-vcpu{id}"))
                .stack_size(256 * 1024)
                .spawn(move || {
                    // SAFETY: gettid has no preconditions.
                    let tid = unsafe { libc::gettid() };
                    if let Some(t) = tids.get(id) {
                        t.store(tid, Ordering::SeqCst);
                    }
                    let filtered = install_filter(prog.as_ref());
                    if let Ok(ctx) = rx.recv() {
                        vcpu::vcpu_thread(ctx, filtered);
                    }
                })
                .map_err(VmmError::Thread)?;
            t.vcpu_jobs.push(tx);
            t.handles.push(h);
        }
        if cfg.virtio_console || cfg.block.is_some() || cfg.net.is_some() || cfg.deadline.is_some()
        {
            let (tx, rx) = mpsc::channel::<IoJob>();
            let h = std::thread::Builder::new()
                .name("microvm-io".into())
                .stack_size(256 * 1024)
                .spawn(move || {
                    let filtered = install_filter(io_prog.as_ref());
                    if let Ok(job) = rx.recv() {
                        io_thread(job, filtered);
                    }
                })
                .map_err(VmmError::Thread)?;
            t.io_job = Some(tx);
            t.handles.push(h);
        }
        Ok(t)
    }

    /// Ends the threads that never got a job and joins all of them (the running ones must
    /// have been told to stop).
    pub(super) fn join(&mut self) {
        self.vcpu_jobs.clear();
        self.io_job = None;
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

impl Drop for Threads {
    fn drop(&mut self) {
        self.join();
    }
}

impl Vm {
    /// Hands each waiting thread its job: the vCPUs start running.
    pub(super) fn spawn_threads(&mut self) -> Result<()> {
        self.started = true;
        let deadline = self.cfg.deadline.map(|d| Instant::now() + d);
        // The I/O thread first: once a vCPU runs, it may take this CPU from us.
        if let Some(job) = self.threads.io_job.take() {
            let sent = job.send(IoJob {
                shared: self.shared.clone(),
                transports: self.virtio.clone(),
                deadline,
            });
            if sent.is_err() {
                let why = "the I/O thread ended before it got its job";
                self.shared.finish(VmExit::VmmFailure(why.into()));
                return Err(VmmError::State(why.into()));
            }
        }
        let vcpus = std::mem::take(&mut self.pending_vcpus);
        let jobs = std::mem::take(&mut self.threads.vcpu_jobs);
        self.shared.lock().alive = vcpus.len();
        for (id, (v, job)) in vcpus.into_iter().zip(jobs).enumerate() {
            let ctx = VcpuContext {
                id: id as u8,
                vcpu: v,
                kvm: self.kvm.clone(),
                shared: self.shared.clone(),
                pio: self.pio.clone(),
                mmio: self.mmio.clone(),
                has_irqchip: self.has_irqchip,
            };
            if job.send(ctx).is_err() {
                let mut c = self.shared.lock();
                c.alive = c.alive.saturating_sub(1);
                drop(c);
                let why = "a vCPU thread ended before it got its vCPU";
                self.shared.finish(VmExit::VmmFailure(why.into()));
                return Err(VmmError::State(why.into()));
            }
        }
        Ok(())
    }
}

/// The I/O thread: virtio queue processing (on notify or host socket readiness) and the
/// wall-clock deadline.
fn io_thread(job: IoJob, seccomp: std::result::Result<(), seccompiler::Error>) {
    let IoJob {
        shared,
        transports,
        deadline,
    } = job;
    if let Err(e) = seccomp {
        shared.finish(VmExit::VmmFailure(format!("installing seccomp: {e}")));
        return;
    }
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        io_loop(&shared, &transports, deadline)
    }));
    if r.is_err() {
        shared.finish(VmExit::VmmFailure("I/O thread panicked".into()));
    }
}

fn io_loop(shared: &Shared, transports: &[Arc<Mutex<MmioTransport>>], deadline: Option<Instant>) {
    fn lock(t: &Arc<Mutex<MmioTransport>>) -> std::sync::MutexGuard<'_, MmioTransport> {
        t.lock().unwrap_or_else(|p| p.into_inner())
    }
    // Notify fds are stable for the transport's life.
    let notify: Vec<RawFd> = transports
        .iter()
        .map(|t| lock(t).notify_fd().as_raw_fd())
        .collect();
    loop {
        if shared.lock().stop {
            return;
        }
        let mut fds = vec![libc::pollfd {
            fd: shared.stop_evt.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }];
        for (t, n) in transports.iter().zip(&notify) {
            fds.push(libc::pollfd {
                fd: *n,
                events: libc::POLLIN,
                revents: 0,
            });
            if let Some((fd, r, w)) = lock(t).host_interest() {
                let mut ev = 0;
                if r {
                    ev |= libc::POLLIN;
                }
                if w {
                    ev |= libc::POLLOUT;
                }
                if ev != 0 {
                    fds.push(libc::pollfd {
                        fd,
                        events: ev,
                        revents: 0,
                    });
                }
            }
        }
        let timeout = match deadline {
            None => -1,
            Some(d) => {
                let now = Instant::now();
                if now >= d {
                    shared.finish(VmExit::DeadlineExceeded);
                    return;
                }
                let ms = (d - now).as_millis().saturating_add(1);
                i32::try_from(ms).unwrap_or(i32::MAX)
            }
        };
        // SAFETY: `fds` is a live, correctly sized array of pollfd; the descriptors stay
        // open for the call (owned by `shared` and the transports, which we hold).
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                shared.finish(VmExit::VmmFailure(format!("I/O thread poll: {e}")));
                return;
            }
            continue;
        }
        for t in transports {
            let mut g = lock(t);
            let _ = g.notify_fd().read();
            g.process();
        }
    }
}

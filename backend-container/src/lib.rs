//! # backend-container — tier 2: our own hardened Linux containers
//!
//! Runs agent code (python, node, gcc, git, bash...) in a persistent Linux container built
//! from namespaces, cgroups, seccomp and Landlock, with our own tiny init as pid 1. No OCI
//! runtime, no daemon, no helper binary to install.
//!
//! ```no_run
//! # async fn demo() -> sandbox_core::Result<()> {
//! use backend_container::ContainerBackend;
//! use sandbox_core::{Backend, ExecRequest, Language, ResolvedSecrets, SandboxSpec};
//!
//! let backend = ContainerBackend::new()?;
//! let spec = SandboxSpec::builder(Language::Python).memory_mib(256).build()?;
//! let sb = backend.create(&spec, ResolvedSecrets::none()).await?;
//! let r = sb.exec(ExecRequest::code("print(2 + 2)")).await?;
//! assert_eq!(r.stdout_str(), "4\n");
//! sb.destroy().await?;
//! # Ok(()) }
//! ```
//!
//! ## Architecture
//!
//! ```text
//!  library process (tokio)                       the init (static, from a sealed memfd)
//!  ───────────────────────                       ────────────────────
//!  create: take the spare init (or have the      A = pid 1 of new user + pid namespaces,
//!          zygote clone one: CLONE_NEWUSER |       cloned by the zygote (CLONE_PARENT), waits
//!          CLONE_NEWPID | CLONE_PARENT)            (a spare: cloned with NS|UTS|IPC|NET too,
//!                                                   its lo up while it waits)
//!          write uid_map/gid_map
//!          START, MAPS ────────────────────────▶ A: BOOT, unshare(NS|UTS|IPC|NET) (not a
//!          (meanwhile: plan the setup; make the     spare), setresuid(0)
//!           cgroups, or rename kept ones, open
//!           their `tasks` files)
//!          check BOOT ◀──────────────────────── (source hash; spare: lo is up)
//!          (rootfs dir: open_tree + idmap)
//!          CGROUPS (the opened files) ─────────▶ A: writes "0" to each (moves itself in)
//!          SETUP, SEAL (queued) ───────────────▶ A: as root, one recursive bind of the
//!                                                    zygote's root-filesystem template, its
//!                                                    own mounts on it (else the classic
//!                                                    setup), pivot_root, hostname, lo up,
//!                                                    Landlock; unshare(CGROUP), seccomp
//!          network hook (netns of A)
//!  exec:   pipes (stdin/stdout/stderr) ─────────▶ the spare supervisor A forked ahead
//!          (on the spare's own socket; else        (else one A forks on demand): a child
//!           through A)                              subreaper; it starts the command with a
//!                                                   vfork-style clone: setpgid, rlimits,
//!                                                   setuid(sandbox), chdir, execve
//!          ◀──────────── EXITED(status, t) ──────── the supervisor (which then waits for the
//!                                                   next exec, if this one left nothing);
//!                                                   A reaps every orphan
//!  destroy: SIGKILL A → the kernel kills the pid namespace; rmdir cgroups
//! ```
//!
//! **The init is a separate, embedded program** (`init/main.rs`, std only, compiled by
//! `build.rs` with the same `rustc`, statically linked and non-PIE when possible, ~1.3 MB).
//! The library writes it once per process into a sealed memfd and starts it from there once,
//! with `std::process::Command` (glibc's `posix_spawn`: a vfork-style spawn), as the
//! process's **zygote**: a small idle fork server. Every sandbox's init is a clone of it
//! (`CLONE_PARENT`, so a child of the library), which skips an `execve` and libc's start-up
//! per sandbox (~0.3-0.5 ms here: its CPUID probing traps to the hypervisor); a zygote that
//! died is replaced on the next create. The zygote holds no sandbox's namespace, cgroup or
//! file. It keeps **one init cloned ahead of time** (a *spare*, asked for after a command
//! finishes and when a sandbox is torn down, moments that usually precede idleness): a
//! process cloned with all of a sandbox's namespaces (user, pid, mount, UTS, IPC, network:
//! empty, owned by its own user namespace, exactly what an init makes after `START`) that
//! brings its `lo` up and then does nothing until a create sends it `START`. Nothing in it
//! depends on the spec. A create then skips the zygote's wake-up and `clone` (~0.3 ms here)
//! and the namespaces' creation (~0.5 ms, mostly the network namespace's). A spare that
//! died is noticed (its socket hung up), reaped and replaced by an on-demand clone. As root
//! the zygote also holds the **root-filesystem templates** (see below). The init
//! reports a compile-time hash of its sources at start-up, and the library refuses an init
//! built from other sources (a stale build-script output) with a clear error.
//! **The library never forks itself**, for two reasons:
//! 1. *Safety*: the library runs inside multi-threaded tokio programs. After `fork` only
//!    async-signal-safe calls are allowed (no malloc, no locks), which rules out building a
//!    root filesystem, parsing requests or serving execs in a forked child. `posix_spawn`
//!    runs no code of ours in the child; everything else happens in the init, a fresh
//!    single-threaded process.
//! 2. *Cost and memory*: a fork copies the parent's page tables and `execve` then tears the
//!    copy down again (together ~1 ms here for a small tokio program, more for a big one),
//!    and a child kept without exec ends up owning a private copy of the parent's heap as the
//!    parent writes to it. The idle init measures ~0.84 MB RSS, ~0.48 MB PSS. It has its own
//!    C `main` (`#![no_main]`): std's runtime start-up would parse `/proc/self/maps`.
//!
//! The init is cloned as pid 1 of a new pid namespace, in a new user namespace (so pid 1 is
//! a direct child of the library, which waits for it on destroy); the other namespaces come
//! with a spare's `clone`, or are created from inside an init cloned on demand, right away
//! (they need only the capabilities it holds in its user
//! namespace, so their cost, ~0.5 ms with the network namespace, overlaps the library's map
//! writing and the cgroup job). **On cgroup v1 it moves itself into the sandbox's cgroups**
//! (writing `0` to the `tasks` files the library opened; the opener's credentials authorize
//! it) before it starts anything: a single thread moving itself skips the global lock that
//! moving another process takes, which waits for an RCU grace period: 10-20 ms on an idle
//! host, measured here. (On v2, where `cgroup.procs` takes that lock either way, the library
//! writes the init's pid.) The cgroup namespace is created last, once the init sits in the
//! sandbox's cgroups, so it is rooted there.
//!
//! Why not re-exec `/proc/self/exe` with a magic argument? It needs a hook in the embedding
//! program's `main` (or a pre-main constructor), and breaks when the library is loaded into
//! another interpreter (e.g. a Python extension, whose `/proc/self/exe` is python).
//!
//! **Exec enters the running sandbox through its init**: the init starts the command, which is
//! therefore in every namespace, the same root filesystem and the sandbox's cgroups, under the
//! same seccomp filter and Landlock domain (no `setns` needed: the init is already inside).
//! Each exec gets a *supervisor*, a fork of the init marked `PR_SET_CHILD_SUBREAPER`: every
//! process the command starts stays its descendant (orphans are re-parented to it, even after
//! `setsid` or a double fork), so a timeout kills the exec's whole tree by walking `/proc`.
//! **Sessions**: the init makes the sandbox's own session (`setsid` right after `START`), which
//! has no controlling terminal, so nothing inside reaches the terminal of the library's session
//! (`/dev/tty`, `TIOCSTI`); each exec is a process group of that session (`setpgid`), not a
//! session of its own, which would cost a scheduler autogroup per command (made by `setsid`,
//! freed through RCU after the command exits).
//! The init keeps one **spare supervisor** forked ahead of time (the first before the seal's
//! reply, so it carries the seal) and hands the library a socket to it
//! (`REP_SPARE`): the library sends the exec **straight to the spare**, whose replies
//! (`EXITED`, kill acknowledgements) and kill requests travel on that socket, so an exec's
//! critical path has neither a `fork` nor a hop through the init or the control socket's
//! reader task. Execs that find no spare at hand (concurrent ones, or a request too big for
//! one packet) go through the init, which forks their supervisor on demand. **A spare serves
//! exec after exec** as long as each leaves nothing behind: when the command has exited, no
//! descendant is left (orphans are re-parented to the supervisor before the command's death
//! is reported, so none then means none), no kill was asked for and the library still
//! listens, `EXITED` says so and the supervisor waits for the next exec on the same socket;
//! the library keeps it for the next one. An exec that leaves a process running keeps its
//! supervisor (which leaves with the last of it) and the init forks the next spare once the
//! reply is out (an exec that follows at once may find none and take the path above). No
//! fork, and none of a fresh process's page faults, per exec: "until started" for
//! `/bin/true` went from ~0.24 to ~0.10 ms. The supervisor keeps its copies of the command's
//! stdout and stderr until its `EXITED` is out, so the command's exit wakes no reader: the
//! library's two pipe readers were woken in turn (each preempting the exiting command on a
//! busy CPU) before the report; it now reads what is left once `EXITED` comes. A spare takes
//! a process slot (`pids.max` allows for it) and ~0.2-0.3 MiB PSS. The supervisor starts the command with `clone(CLONE_VM | CLONE_VFORK)`: the child shares
//! the supervisor's memory until it execs (no page-table copy, no copy-on-write faults) and
//! only makes system calls on data prepared before the clone (argv, env, the `PATH`
//! candidates, rlimits); the capability bounding set was emptied once, when the sandbox was
//! sealed. The command's start time travels in the final `EXITED` reply, so the library is
//! not woken while the command runs. When the command itself exits the supervisor reports; what the command left running
//! **persists** (files do too), still grouped under its supervisor, which leaves with the
//! last of it. An exec that hit the memory or pids limit has its leftovers killed. An exec
//! returns when its command exits; output written later by background children is not
//! captured and does not block the call. (A per-exec cgroup would also work, but moving a
//! task between v1 cgroups costs ~0.1-0.3 ms idle and waits for an RCU grace period, several
//! ms on a busy host.)
//!
//! ## Identity
//!
//! Every sandbox has a user namespace. **As root**, ids 0..65536 inside map to a private host
//! range (`uid_base + slot * 65536`, default base 2^30): the init runs as uid 0 *inside*
//! (an unprivileged host uid), commands run as `sandbox` (uid 1000 inside) with no
//! capabilities. **Rootless**, only the caller's uid can be mapped: it becomes uid 0 inside and
//! commands run as that uid with every capability dropped, the bounding set emptied and
//! `SECBIT_NOROOT` locked, so exec cannot regain any. With a rootfs directory, commands run
//! as uid 0 inside in both modes (see below).
//!
//! ## Root filesystem ("host tools" view)
//!
//! A fresh tmpfs root (read-only once built) holding:
//! - `/usr` bound read-only (`nosuid,nodev`), `/bin`, `/sbin`, `/lib*` as the host's symlinks
//!   (or read-only binds on a non-merged host);
//! - `/etc`: generated `passwd`/`group` (with the sandbox user), `hosts`, `hostname`,
//!   `resolv.conf`, `nsswitch.conf` (files only), `gitconfig` (a user name/email, so git
//!   commits work), plus read-only binds of the host's `ld.so.cache`, `ld.so.conf*`, `ssl`,
//!   `ca-certificates*`, `alternatives`, `localtime`, `protocols`, `services`, and a few more
//!   (see `rootfs.rs`). Nothing else of the host's `/etc` (no `shadow`, no `ld.so.preload`);
//! - a fresh `/proc` of the sandbox's pid namespace (`/proc/sys` read-only);
//! - `/dev`: a tmpfs with `null`, `zero`, `full`, `random`, `urandom`, `tty` bound from the
//!   host (no `mknod` in a user namespace), a private `devpts` (`/dev/pts`, `/dev/ptmx`),
//!   `/dev/shm` (tmpfs), and the `fd`/`stdin`/`stdout`/`stderr` links;
//! - `/tmp` (tmpfs), `/var/tmp` → `/tmp`;
//! - `/workspace`: a tmpfs owned by the sandbox user, or the spec's host directory (read-only
//!   if asked);
//! - the spec's mounts, read-only unless `read_only: false`, never under a system directory.
//!
//! No `/sys`, `/home`, `/root`, `/var`, `/run` or host sockets.
//!
//! **As root, from a template.** Everything above that is the same for every sandbox with
//! the same generated `/etc` files (the command user, the hostname, `resolv.conf`) — `/usr`
//! and the links, `/etc`, the `/dev` tmpfs with its nodes and links, the mount points — is
//! built **once per process** by the zygote, in a mount namespace of its own (a slave of the
//! host's, so host mounts still arrive and ours never leave), as a read-only tmpfs under
//! `/run/agent-sandbox-templates` (the directory is made on the host and stays empty there).
//! Every init starts from a copy of that namespace: it clones the template with one recursive
//! bind (the template's mounts arrive locked, so they stay read-only: a sandbox can neither
//! write nor unmount them), mounts its own `/proc`, `/dev/pts`, `/dev/shm`, `/tmp` and
//! workspace on it, `pivot_root`s into it and detaches the old root: ~20 mount operations
//! instead of ~100 (the filesystem phase went from ~1.2 to ~0.5 ms). A template is used only
//! under the host fingerprint it was built with (device, inode, size, mode and mtime of the
//! `/etc` entries it copies or binds and of the `/usr` links, taken at most once a second):
//! e.g. after an `ldconfig` renamed a new `ld.so.cache` into place, the next create builds a
//! new template (a file bind would keep the old file). The template's files
//! belong to host root, so inside they show as `nobody` (like `/usr` always did). A
//! host-directory workspace reaches a template-mode init as a detached mount the library
//! clones (`open_tree`) from its own current view, since the init's namespace descends from
//! the zygote's copy, which may lag it. Specs with their own mounts (whose mount points would
//! have to be made in the shared root), an egress link (its own `resolv.conf`) or a rootfs
//! directory, and rootless mode, use the classic setup, from an init the zygote clones in the
//! library's own mount namespace (so bind sources are the library's current view): the init builds the root in a scratch tmpfs (keeping the host root at `/oldroot`
//! for bind sources, as bubblewrap does), `pivot_root`s into it and detaches the old root.
//!
//! `/proc/mounts` shows only the sandbox's own mounts (device names and mount points inside;
//! bind sources appear as the device they live on, never as a host path). Not hidden:
//! `/proc/self/mountinfo` shows a bind's path *within its filesystem* (e.g. a host workspace
//! directory's path), and tmpfs options show the host uid the sandbox's root maps to.
//!
//! **Host-directory workspaces as root**: when the directory (writable spec) belongs to an
//! unprivileged user, the sandbox user (uid 1000 inside) is mapped to that owner (an extra
//! `uid_map` line), so commands and the file API create files the owner owns; the rest of the
//! range stays private. A directory owned by root is never mapped that way (commands would
//! own host root's files): it is writable only if its mode allows it. Rootless, the caller's
//! own directories are writable. (Idmapped mounts would lift the root-owned case; not done.)
//!
//! ## Root filesystem from a directory ([`SandboxSpec::rootfs`])
//!
//! A root filesystem directory (a Debian tree made with `debootstrap`, an unpacked OCI image)
//! replaces the host-tools view. It is the **lower layer of an overlay** and is never
//! written: the upper and work directories live on a tmpfs of the sandbox's own (capped as
//! below, charged to its memory cgroup), so changes vanish with the sandbox
//! unless snapshotted. `/proc`, `/dev`, `/tmp`, `/workspace`, the spec's mounts, hostname,
//! loopback, rlimits, cgroups, seccomp and Landlock are the same as in the host-tools view;
//! the image keeps its own `/etc` except `hosts`, `hostname` and `resolv.conf`, which are
//! written (into the upper layer) for the sandbox. Nothing of the host's `/usr` is visible.
//!
//! - **Ownership.** As root, the library clones the directory's mount with `open_tree`
//!   (not recursive: submounts stay out) and **idmaps** it through the sandbox's user
//!   namespace (`mount_setattr(MOUNT_ATTR_IDMAP)`), then hands the detached mount to the
//!   init, which `move_mount`s it into place: a file owned by host uid N appears owned by N
//!   inside (host root's files belong to the sandbox's root, not `nobody`), nothing on disk
//!   changes, and copy-up keeps owners. Rootless (no idmapping without host privileges), the
//!   directory is bound as it is: the caller's files look root-owned, other owners' files
//!   look like `nobody` and cannot be copied up (modified). A filesystem without idmapped
//!   mount support falls back to the same (with a warning).
//! - **Identity.** Commands run as the image's root (uid 0 inside, like `docker run`), with
//!   every capability dropped, the bounding set empty and `SECBIT_NOROOT` locked (as in
//!   rootless mode); uid 0 inside is an unprivileged host uid of the sandbox's range. A
//!   host-directory workspace is therefore not mapped to its owner in this mode.
//! - **Writes.** Landlock grants writes beneath `/workspace`, `/tmp` and the image's
//!   top-level directories (`/etc`, `/usr`, `/var`, `/root`, `/opt`...; not `/proc`, `/dev`,
//!   `/sys`); new entries directly in `/` are refused.
//! - **No host paths in `/proc/mounts`.** The init mounts the overlay from its scratch root
//!   with *relative* layer paths (`lowerdir=lower,upperdir=ovl/upper,workdir=ovl/work`); the
//!   layers' own mounts are detached with the scratch root after `pivot_root`. The init keeps
//!   the upper directory open (fd 10, close-on-exec) so the library can reach it through
//!   `/proc/<init>/fd/10`.
//!
//! [`RootfsMode`] is the backend-wide default view ([`RootfsMode::HostTools`]); a spec's
//! `rootfs` overrides it for that sandbox.
//!
//! ## Resource limits
//!
//! cgroups, created under the caller's own cgroup as `asb-<our pid>-<sandbox id>` and removed
//! on destroy; a process that dies without destroying its sandboxes leaves them empty, and
//! the next [`ContainerBackend`] built on the host removes those whose process is gone.
//! **On v1, a destroyed sandbox's emptied cgroups are kept for the next one** (renamed
//! `asb-<our pid>-free-<n>`, at most two sets per process, removed at its normal exit (a
//! killed process leaves them to the sweep above), only when no process or child
//! cgroup is left, the freezer is thawed and at most 2 MiB of memory is still charged): the
//! next create renames them and writes its own limits. Removing a v1 cgroup leaves the
//! kernel deferred work (each controller's state killed, released and freed after RCU grace
//! periods, the memory cgroup's per-CPU caches drained on every CPU) that lands on whatever
//! runs next; a rename leaves none. Counters such as the OOM-kill count carry on, which
//! changes nothing: each exec compares them before and after. cgroup2 cannot rename its
//! directories, so v2 makes and removes them per sandbox.
//! **v1** (detected from `/proc/self/cgroup` and `/proc/self/mountinfo`): `memory`
//! (`limit_in_bytes`, `memsw` when present, swappiness 0), `pids` (`pids.max` = limit + 2 for
//! the init and its spare supervisor), `cpu` (CFS quota from `cpu_millis`), `freezer` (pause/resume). No cpuset child is
//! made: the sandbox stays in the caller's cpuset. **v2**: the same limits in one directory
//! (`memory.max`, `memory.swap.max` = 0, `pids.max`, `cpu.max`; `cgroup.freeze`), used when
//! no v1 memory/pids hierarchy exists and the caller's cgroup is offered `memory` and `pids`.
//! cgroup v2 lets a cgroup other than the root either hold processes or enable controllers
//! for its children (the "no internal processes" rule), and the caller's cgroup holds at
//! least the caller. So at the first create (or probe) of a process: if the controllers
//! are not enabled yet and enabling them fails with `EBUSY`, a process **alone in its
//! cgroup moves into a leaf of its own**, `asb-self-<pid>` (still inside its cgroup, whose
//! limits keep counting; its later children start there too), then enables `memory`,
//! `pids` (and `cpu` where offered) for the cgroup's children, and sandbox cgroups are made
//! beside the leaf. A cgroup that **holds other processes too** is left alone (they are not
//! ours): creates fail with [`Error::Unavailable`] naming them and the remedy (start the
//! process in a cgroup of its own: `systemd-run --scope -p Delegate=yes ...`), or run
//! without cgroup limits under `require_cgroups(false)`. A dead process's empty leaf is
//! removed by the next backend's sweep (never its processes: they are not sandboxes).
//! Tested here: detection from `/proc` texts of v1, hybrid and unified hosts; the v2 limit
//! files on a stand-in directory; the delegation on this host's real cgroup2 hierarchy
//! (which is offered only `hugetlb`): a lone process moves into its leaf and the controller
//! is enabled, one among others is refused with nothing moved, an empty cgroup is enabled
//! in place; and end to end in a mount namespace whose only cgroup mount is that hierarchy
//! (`tests/cgroup_v2.rs`): creates refused by default with the reason, and with
//! `require_cgroups(false)` real sandboxes in v2 cgroups (the init joins its own, the
//! cgroup namespace is rooted there, pause/resume through `cgroup.freeze`, destroy removes
//! it with every process). **Not testable on this CI host**: v2 `memory`/`pids` limits
//! (those controllers are bound to its v1 hierarchies).
//!
//! Reported limits: `Memory` when the exec failed and the cgroup's `oom_kill` count rose;
//! `Pids` when it failed and `pids.events` `max` rose; `Output` when a stream passed
//! `max(4 × output_bytes, output_bytes + 8 MiB)` (the command is killed; below that it is
//! only truncated); `CpuTime` on `SIGXCPU` (`RLIMIT_CPU` = `cpu_time_ms`); `WallTime` when the
//! call's timeout killed the tree; `Disk` when it failed with `/workspace`, `/tmp`,
//! `/dev/shm` (or the overlay's upper layer) out of space or inodes.
//! rlimits: `RLIMIT_NOFILE` = `open_files`, `RLIMIT_CORE` = 0, `RLIMIT_CPU`.
//! `lifetime_ms` is checked on every call.
//!
//! **Disk is memory.** The writable tmpfs mounts (`/workspace` unless it is a host directory,
//! `/tmp`, `/dev/shm`, the overlay's upper layer) are charged to the sandbox's memory cgroup,
//! pages and inodes alike (~1 KiB of kernel memory per file), and nothing can reclaim them.
//! Were they sized by `limits.disk_bytes` alone, files could fill the memory limit: every
//! later command would be OOM-killed, then the supervisor and the init, and the sandbox would
//! be lost with its workspace (seen here: 60 MB of files in a 64 MiB sandbox killed it).
//! So together they hold at most **5/8 of `limits.memory_bytes` in data and one inode per
//! 8 KiB of it**, which leaves processes at least a quarter of the limit: `/tmp` and
//! `/dev/shm` up to an eighth of that each (asked: a quarter of `disk_bytes`), the workspace
//! (and the upper layer, sharing) the rest, at most `disk_bytes`. With the defaults (512 MiB
//! of memory, 1 GiB of disk) the workspace holds 240 MiB and 49,152 files, `/tmp` and
//! `/dev/shm` 40 MiB and 8,192 each; `df` inside shows them. A bigger workspace needs a
//! bigger memory limit, or a host directory. A full one fails the write with `ENOSPC`
//! (`limit: disk`) and the sandbox goes on (tested).
//!
//! The init keeps the default OOM score (0), like every process in the sandbox: the kernel
//! kills the task using the most memory, which is never the ~1 MB init unless the sandbox is
//! nothing but smaller processes (then the sandbox dies and says so). A negative score would
//! be inherited by every command, and a command cannot raise its own back (the init is not
//! dumpable, so its `/proc` files belong to the host's root): the memory limit would then
//! find nothing to kill. Moving the init out of the sandbox's memory cgroup would shield it
//! without that; not done yet.
//!
//! ## Hardening
//!
//! Commands run with no capabilities (bounding, ambient, inheritable, permitted and effective
//! sets empty), `no_new_privs`, under a seccomp filter and a Landlock domain, both installed
//! on the init after setup so every exec inherits them.
//!
//! **The seccomp filter** (`seccomp.rs`) is a deny-list, because agents need a general Linux
//! (compilers, package managers, runtimes). It kills any syscall of a foreign architecture,
//! returns `ENOSYS` for the x32 ABI range, and refuses:
//!
//! | syscalls | why |
//! |---|---|
//! | `kexec_load`, `kexec_file_load`, `reboot`, `init_module`, `finit_module`, `delete_module` | replacing or extending the kernel |
//! | `bpf`, `perf_event_open`, `userfaultfd`, `io_uring_*` (`ENOSYS`) | large, frequently exploited kernel surfaces; `userfaultfd` makes kernel races easy to win |
//! | `keyctl`, `add_key`, `request_key` | the kernel keyring is not namespaced |
//! | `mount`, `umount2`, `pivot_root`, `chroot`, `move_mount`, `open_tree`, `fsopen`, `fsconfig`, `fsmount`, `fspick`, `mount_setattr` | the filesystem view is fixed after setup |
//! | `setns`; `unshare` and `clone` with any `CLONE_NEW*` flag; `clone3` (`ENOSYS`, so libc falls back to `clone`, whose flags BPF can read) | a new user namespace regains a full capability set and reopens the kernel surface namespaces guard |
//! | `ptrace`, `process_vm_readv`, `process_vm_writev`, `pidfd_getfd`, `kcmp` | reading or steering other processes (and the init) |
//! | `open_by_handle_at`, `name_to_handle_at` | file handles bypass path lookup (the "shocker" escape) |
//! | `swapon`, `swapoff`, `syslog`, `acct`, `settimeofday`, `clock_settime`, `clock_adjtime`, `adjtimex`, `quotactl`, `vhangup`, `fanotify_init`, `lookup_dcookie`, NUMA policy calls (`mbind`, `set_mempolicy`, `migrate_pages`, `move_pages`) | host-global state |
//! | `iopl`, `ioperm`, `uselib`, `nfsservctl` (x86_64) | legacy hardware and ABI surfaces |
//! | `ioctl(TIOCSTI)`, `ioctl(TIOCLINUX)` | typing into a terminal outside the sandbox |
//!
//! Most of these would fail anyway without capabilities; the filter removes the kernel code
//! paths from reach (defence in depth, as Firecracker does for its own process).
//!
//! **Landlock** (ABI 1–7, best available) handles every write right (write, truncate, remove,
//! make dir/file/link/socket/FIFO/device, refer) and grants them only under `/workspace`
//! (unless mounted read-only), `/tmp`, `/dev/shm`, `/dev/pts`, writable spec mounts, and
//! `write`/`truncate` on `/dev/null`, `/dev/zero`, `/dev/full`, `/dev/tty`. Reads are confined
//! by the mount namespace.
//!
//! ## Network
//!
//! An empty network namespace with `lo` up: no route out (see [`network`]).
//! [`NetworkPolicy::DenyAll`](sandbox_core::NetworkPolicy) is enforced by that alone; other
//! policies need an [`EgressEnforcer`] ([`ContainerBuilder::egress`]) and are refused with
//! `Error::Unsupported` without one.
//!
//! ## Files and snapshots
//!
//! The file API works from the host on the sandbox's own mount of `/workspace` (through
//! `/proc/<init>/root`) with `openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)`: `..` and
//! symlinks leaving the workspace fail with `PathEscape`. Snapshots pack the workspace into a
//! tar (one `O_NOFOLLOW` name at a time, the sandbox frozen meanwhile when a freezer exists)
//! and restore unpacks it into a new sandbox's empty workspace. With a rootfs directory the
//! snapshot also packs the overlay's **upper layer** (`upper.tar`: the changes made to the
//! root, with whiteouts of deleted files as 0/0 character devices and opaque directories as a
//! PAX `user.overlay.opaque` record); restore unpacks it into the new sandbox's empty upper
//! layer *before* the overlay is mounted (the setup is split in two for that), as the
//! sandbox's root (owners inside are not preserved). The directory itself must still exist.
//! Only the filesystem is captured: CRIU cannot checkpoint processes on this kernel.
//!
//! ## What is *not* isolated
//!
//! - The kernel is shared: a kernel bug reachable through the allowed syscalls is an escape.
//!   Use the gVisor or microVM tiers for hostile code that must not reach the host kernel.
//! - `/usr` and the listed `/etc` files of the host are readable (they are what makes the
//!   tools work): nothing secret should live there.
//! - CPU caches, memory bandwidth, disk I/O bandwidth (no blkio limits), the page cache and
//!   kernel-global tables (e.g. inotify or keyring quotas) are shared with the host.
//! - Time: a time namespace is created, with zero offsets; `/proc/uptime`-style side channels
//!   remain. The host's CPU model, kernel version and memory size are visible in `/proc`.
//! - The network is isolated by the empty namespace, not by the seccomp filter; a hook that
//!   adds interfaces is responsible for what it opens.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use async_trait::async_trait;
use sandbox_core::{
    Backend, Capabilities, EgressEnforcer, Error, IsolationBoundary, Language, NetworkMode, Phase,
    ResolvedSecrets, Result, Sandbox, SandboxSpec, SnapshotId, SnapshotKind, SnapshotStore, Tier,
    TierStatus, TimelineRecorder, Workspace,
};

mod cgroup;
mod ctl;
mod files;
mod landlock;
pub mod network;
#[path = "../init/proto.rs"]
mod proto;
mod rootfs;
mod sandbox;
pub mod seccomp;
mod spawn;

pub use cgroup::CgroupVersion;
pub use sandbox::ContainerSandbox;

use crate::sandbox::{Inner, ENGINE, TIER};
use crate::spawn::IdMap;

/// How the sandbox's root filesystem is made.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum RootfsMode {
    /// The host's `/usr` and a few `/etc` files, read-only (like bubblewrap's usual setup).
    /// A spec's [`rootfs`](SandboxSpec::rootfs) directory overrides it for that sandbox.
    #[default]
    HostTools,
}

/// Configuration of a [`ContainerBackend`]; build one with [`ContainerBackend::builder`].
#[derive(Debug, Clone)]
pub struct ContainerConfig {
    /// Where a small record of each live sandbox (init pid, cgroup directories) is kept, so
    /// [`ContainerBackend::cleanup_stale`] can remove what a crashed process left. `None`:
    /// no record.
    pub state_dir: Option<PathBuf>,
    /// Root filesystem mode.
    pub rootfs: RootfsMode,
    /// The sandbox's host name.
    pub hostname: String,
    /// As root: the first host uid/gid of the ranges mapped into sandboxes (65536 per
    /// sandbox, 4096 slots).
    pub uid_base: u32,
    /// Refuse to create sandboxes when cgroups are not usable (default `true`). With `false`
    /// and no usable cgroup, memory, pids and CPU-quota limits are **not enforced** (rlimits
    /// still are) and pause/resume is unavailable; on a host whose only hierarchy is a
    /// cgroup v2 one that does not offer memory and pids, sandboxes still get a v2 cgroup
    /// (pause/resume, one group killed at once, `cpu.max` where offered) without those two
    /// limits, and `probe()` says so.
    pub require_cgroups: bool,
    /// Install the seccomp filter (default `true`).
    pub seccomp: bool,
    /// Install the Landlock domain when the kernel has Landlock (default `true`).
    pub landlock: bool,
    /// The egress enforcer for policies other than deny-all, if any (see [`network`]).
    pub egress: Option<Arc<dyn EgressEnforcer>>,
}

impl Default for ContainerConfig {
    fn default() -> Self {
        ContainerConfig {
            state_dir: None,
            rootfs: RootfsMode::HostTools,
            hostname: "sandbox".into(),
            uid_base: 1 << 30,
            require_cgroups: true,
            seccomp: true,
            landlock: true,
            egress: None,
        }
    }
}

/// Builder for [`ContainerBackend`].
#[derive(Debug, Clone, Default)]
pub struct ContainerBuilder {
    cfg: ContainerConfig,
}

impl ContainerBuilder {
    /// Keeps a record of live sandboxes in `dir` (see [`ContainerConfig::state_dir`]).
    pub fn state_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.cfg.state_dir = Some(dir.into());
        self
    }

    /// Sets the root filesystem mode.
    pub fn rootfs(mut self, mode: RootfsMode) -> Self {
        self.cfg.rootfs = mode;
        self
    }

    /// Sets the sandbox host name.
    pub fn hostname(mut self, name: impl Into<String>) -> Self {
        self.cfg.hostname = name.into();
        self
    }

    /// Sets the first host uid of the mapped ranges (root mode).
    pub fn uid_base(mut self, base: u32) -> Self {
        self.cfg.uid_base = base;
        self
    }

    /// Whether to refuse creating sandboxes without usable cgroups.
    pub fn require_cgroups(mut self, yes: bool) -> Self {
        self.cfg.require_cgroups = yes;
        self
    }

    /// Whether to install the seccomp filter.
    pub fn seccomp(mut self, yes: bool) -> Self {
        self.cfg.seccomp = yes;
        self
    }

    /// Whether to install Landlock.
    pub fn landlock(mut self, yes: bool) -> Self {
        self.cfg.landlock = yes;
        self
    }

    /// Plugs in the egress enforcer that gives allowlisted sandboxes their path out.
    pub fn egress(mut self, enforcer: Arc<dyn EgressEnforcer>) -> Self {
        self.cfg.egress = Some(enforcer);
        self
    }

    /// Builds the backend.
    pub fn build(self) -> Result<ContainerBackend> {
        let c = &self.cfg;
        if c.hostname.is_empty()
            || c.hostname.len() > 64
            || !c
                .hostname
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-')
        {
            return Err(Error::invalid("hostname", "1-64 letters, digits or '-'"));
        }
        if c.uid_base == 0 || u64::from(c.uid_base) + 4096 * 65536 > u64::from(u32::MAX) {
            return Err(Error::invalid(
                "uid_base",
                "must be positive and leave room for 4096 ranges of 65536",
            ));
        }
        if let Some(d) = &c.state_dir {
            std::fs::create_dir_all(d).map_err(|e| Error::io_path("create state dir", d, e))?;
        }
        let mut host = cgroup::CgroupHost::detect();
        if !self.cfg.require_cgroups {
            host.allow_v2_without_limits();
        }
        host.sweep_orphans();
        Ok(ContainerBackend {
            cfg: Arc::new(self.cfg),
            host,
            landlock_abi: landlock::abi(),
            bpf: Arc::new(seccomp::program_bytes()),
            slot: Arc::new(AtomicU64::new(0)),
            host_ops: Arc::new(std::sync::OnceLock::new()),
            cgroups_ok: Arc::new(std::sync::atomic::AtomicBool::new(false)),
        })
    }
}

/// The container backend. Cheap to clone; sandboxes outlive nothing but their own handle.
#[derive(Debug, Clone)]
pub struct ContainerBackend {
    cfg: Arc<ContainerConfig>,
    host: cgroup::CgroupHost,
    landlock_abi: Option<u32>,
    bpf: Arc<Vec<u8>>,
    slot: Arc<AtomicU64>,
    host_ops: Arc<std::sync::OnceLock<Vec<proto::Op>>>,
    /// Set once the cgroup directories were found writable (see `cgroups_usable`).
    cgroups_ok: Arc<std::sync::atomic::AtomicBool>,
}

/// The cgroup (and state record) name of sandbox `id`: tagged with our pid, so leftovers of a
/// dead process can be told from other processes' live sandboxes.
fn cgroup_name(id: &str) -> String {
    format!("asb-{}-{id}", std::process::id())
}

fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

impl ContainerBackend {
    /// A backend with the default configuration.
    pub fn new() -> Result<Self> {
        Self::builder().build()
    }

    /// Starts a builder.
    pub fn builder() -> ContainerBuilder {
        ContainerBuilder::default()
    }

    /// The configuration.
    pub fn config(&self) -> &ContainerConfig {
        &self.cfg
    }

    /// The cgroup version sandboxes use here, if any.
    pub fn cgroup_version(&self) -> Option<CgroupVersion> {
        self.host.version()
    }

    /// Whether sandboxes are created rootless (the caller is not root).
    pub fn rootless(&self) -> bool {
        !is_root()
    }

    /// Whether we can make cgroups. Checked (`access(2)` on each controller's directory, ~15
    /// µs apiece here; on v2 also the controllers for the caller's cgroup's children, see
    /// `cgroup::delegate_v2`) until it first holds; should the permission go later, each
    /// create's cgroup job fails with the `mkdir` error instead.
    fn cgroups_usable(&self) -> std::result::Result<(), String> {
        if self.cgroups_ok.load(Ordering::Relaxed) {
            return Ok(());
        }
        let r = self.host.usable().map(|_| ());
        if r.is_ok() {
            self.cgroups_ok.store(true, Ordering::Relaxed);
        }
        r
    }

    /// As root, a writable host-directory workspace owned by an unprivileged user (outside
    /// our uid ranges): the sandbox user becomes that user, so it can write its workspace.
    /// (A root-owned directory is never mapped: commands would own host root's files.)
    fn workspace_owner(&self, spec: &SandboxSpec) -> Option<(u32, u32)> {
        use std::os::unix::fs::MetadataExt;
        let Workspace::HostDir {
            path,
            read_only: false,
        } = &spec.workspace
        else {
            return None;
        };
        let md = std::fs::metadata(path).ok()?;
        let (lo, hi) = (
            u64::from(self.cfg.uid_base),
            u64::from(self.cfg.uid_base) + 4096 * 65536,
        );
        let ours = |id: u32| (lo..hi).contains(&u64::from(id));
        (md.uid() != 0 && md.gid() != 0 && !ours(md.uid()) && !ours(md.gid()))
            .then(|| (md.uid(), md.gid()))
    }

    /// Checks `spec` against this backend; returns the egress enforcer its network needs and
    /// whether sandboxes get cgroups (see `cgroups_usable`).
    fn check_spec(&self, spec: &SandboxSpec) -> Result<(Option<Arc<dyn EgressEnforcer>>, bool)> {
        spec.validate()?;
        if spec.language == Language::Wasm {
            return Err(Error::unsupported(
                TIER,
                "the wasm language (use the wasm tier)",
            ));
        }
        let enforcer =
            sandbox_core::egress::enforcer_for(TIER, self.cfg.egress.as_ref(), &spec.network)?;
        rootfs::check_mounts(spec)?;
        // Always asked, and before the first create starts this process's zygote: on v2
        // it may move this process into a leaf cgroup, which must hold all of ours.
        let cgroups = self.cgroups_usable();
        if self.cfg.require_cgroups {
            cgroups.clone().map_err(|reason| Error::Unavailable {
                tier: TIER,
                reason,
                fix: "run as root, or delegate a cgroup to this user (chown its directory and cgroup.procs \
                      in each controller and start the process inside it), or build the backend with \
                      require_cgroups(false) to run without memory/pids limits"
                    .into(),
            })?;
        }
        Ok((enforcer, cgroups.is_ok()))
    }

    /// Creates a sandbox and returns the concrete type (for [`ContainerSandbox::init_pid`]).
    pub async fn create_container(&self, spec: &SandboxSpec) -> Result<ContainerSandbox> {
        self.create_sandbox(spec, ResolvedSecrets::none()).await
    }

    async fn create_sandbox(
        &self,
        spec: &SandboxSpec,
        secrets: ResolvedSecrets,
    ) -> Result<ContainerSandbox> {
        self.create_inner(spec, secrets, None).await
    }

    /// Creates a sandbox; `upper` (a snapshot's `upper.tar`, rootfs-directory mode) is
    /// unpacked into the overlay's upper layer before the overlay is mounted.
    async fn create_inner(
        &self,
        spec: &SandboxSpec,
        secrets: ResolvedSecrets,
        upper: Option<&[u8]>,
    ) -> Result<ContainerSandbox> {
        let (enforcer, with_cgroups) = self.check_spec(spec)?;
        let mut t = TimelineRecorder::start();
        let id = uuid::Uuid::new_v4().simple().to_string();
        let rootless = !is_root();
        let ids = if rootless {
            IdMap {
                host_root: nix::unistd::geteuid().as_raw(),
                host_root_gid: nix::unistd::getegid().as_raw(),
                count: 1,
                rootless: true,
                user_override: None,
            }
        } else {
            let slot = u32::try_from(self.slot.fetch_add(1, Ordering::Relaxed) % 4096).unwrap_or(0);
            let base = self.cfg.uid_base + slot * 65536;
            IdMap {
                host_root: base,
                host_root_gid: base,
                count: 65536,
                rootless: false,
                // Rootfs mode runs commands as root inside: a host-directory workspace is
                // not mapped to its owner then.
                user_override: if spec.rootfs.is_some() {
                    None
                } else {
                    self.workspace_owner(spec)
                },
            }
        };
        // A rootfs directory is an image: commands run as its root (uid 0 inside, with no
        // capabilities, like rootless mode), which owns its files through the idmapping.
        let stay_root = rootless || spec.rootfs.is_some();
        let user = if stay_root { 0 } else { spawn::SANDBOX_USER };
        // The plan and the seal are ready before the init starts: both are queued behind the
        // bootstrap, and the init runs them in order, stopping at the first failure.
        let egress = match enforcer {
            Some(e) => {
                let plan = e.prepare(&id, &spec.network)?;
                Some((e, plan))
            }
            None => None,
        };
        // From here on, a failed create must give the prepared link back.
        let release = EgressRelease(egress.as_ref().map(|(e, _)| (e.clone(), id.clone())));
        let resolv = egress
            .as_ref()
            .map(|(_, plan)| plan.resolv_conf.clone())
            .unwrap_or_else(|| network::DEFAULT_RESOLV_CONF.to_string());
        // As root, a host-tools root without spec mounts or an egress link (whose
        // `resolv.conf` is the sandbox's own) starts from a template (see
        // `rootfs::template_ops`), built once per process for each set of `/etc` files.
        // A host-directory workspace reaches a template-mode init as a detached mount made
        // here, from our current view (see `rootfs::template_fits`); if we cannot make one,
        // the classic setup binds the directory instead.
        let mut ws_tree = None;
        let mut fits = !rootless && egress.is_none() && rootfs::template_fits(spec);
        if let (true, Workspace::HostDir { path, .. }) = (fits, &spec.workspace) {
            match path.canonicalize().and_then(|p| spawn::detached_tree(&p)) {
                Ok(t) => ws_tree = Some(t),
                Err(_) => fits = false,
            }
        }
        let template = if fits {
            spawn::template_root(rootfs::etc_files(user, &self.cfg.hostname, &resolv))
        } else {
            None
        };
        if template.is_none() {
            ws_tree = None;
        }
        // The init makes its namespaces (~0.5 ms; a spare has them already) while we plan
        // its setup.
        let starting = spawn::start_init(true, template.is_some(), &ids)
            .await
            .map_err(|e| Error::backend(TIER, e))?;
        let planned = (|| {
            let plan = rootfs::Plan {
                spec,
                user,
                hostname: &self.cfg.hostname,
                resolv_conf: &resolv,
                caps: rootfs::tmpfs_caps(spec),
                landlock: if self.cfg.landlock {
                    self.landlock_abi
                } else {
                    None
                },
                host: if spec.rootfs.is_some() {
                    &[]
                } else {
                    self.host_ops.get_or_init(rootfs::host_ops)
                },
                // As root the library brings `lo` up meanwhile (see `network::loopback_up`),
                // unless the init (a spare) did so while it waited.
                loopback: rootless,
            };
            let ops = match &template {
                Some(root) => rootfs::template_plan(&plan, root)?,
                None => rootfs::plan(&plan)?,
            };
            let enc = |ops: &[proto::Op]| {
                let mut e = proto::Enc::default();
                e.ops(ops);
                e.0
            };
            let seal = enc(&rootfs::seal_ops(
                self.cfg.seccomp.then_some(self.bpf.as_slice()),
            ));
            // Queued behind the bootstrap: everything, or (restoring an upper layer) only the
            // preparation; the rest follows once the upper layer is filled.
            let (queued, later): (Vec<Vec<u8>>, Vec<Vec<u8>>) = match upper {
                Some(_) if spec.rootfs.is_some() => {
                    (vec![enc(&ops.prep)], vec![enc(&ops.main), seal])
                }
                _ => (vec![enc(&ops.all()), seal], Vec::new()),
            };
            let lower = match (&spec.rootfs, rootless) {
                (Some(r), false) => Some(
                    r.canonicalize()
                        .map_err(|e| Error::io_path("resolve the rootfs directory", r, e))?,
                ),
                _ => None,
            };
            Ok((queued, later, lower))
        })();
        let (queued, later, lower): (Vec<Vec<u8>>, Vec<Vec<u8>>, Option<std::path::PathBuf>) =
            match planned {
                Ok(p) => p,
                Err(e) => {
                    spawn::abandon(starting);
                    return Err(e);
                }
            };
        // The cgroups are made in parallel with the init's start-up (the job is ~0.3 ms),
        // started once the setup is planned so the init gets a CPU first (on 2 CPUs a third
        // busy thread delayed its start). The init joins them itself (see `spawn::CgroupJob`
        // for why) before it starts anything.
        let cg_job = {
            let host = self.host.clone();
            let (name, limits) = (cgroup_name(&id), spec.limits.clone());
            tokio::task::spawn_blocking(move || {
                if !with_cgroups {
                    return Ok(None);
                }
                let c = host
                    .create(&name, &limits)
                    .map_err(|e| format!("create the sandbox cgroup: {e}"))?;
                let mut files = Vec::new();
                for p in c.join_files() {
                    match std::fs::OpenOptions::new().write(true).open(&p) {
                        Ok(f) => files.push(std::os::fd::OwnedFd::from(f)),
                        Err(e) => {
                            c.remove(std::time::Duration::from_millis(500));
                            return Err(format!("open {}: {e}", p.display()));
                        }
                    }
                }
                Ok(Some((c, files)))
            })
        };
        let requests: Vec<&[u8]> = queued.iter().map(Vec::as_slice).collect();
        let spawned =
            spawn::spawn_init(starting, &ids, &requests, lower.as_deref(), ws_tree, cg_job)
                .await
                .map_err(|e| Error::backend(TIER, e))?;
        let (pid, ctl, cgroup) = (spawned.pid, spawned.ctl, spawned.cgroup);
        let lo = (!rootless && !spawned.lo_up).then(|| network::loopback_up(pid));
        if lower.is_some() && !spawned.idmapped {
            tracing::warn!(sandbox = %id, "rootfs directory used without idmapping");
        }
        t.mark(Phase::Allocation);
        let gone = || std::io::Error::new(std::io::ErrorKind::BrokenPipe, "sandbox init is gone");
        let mut ids_used: Vec<u64> = spawned.queued.iter().map(|(i, _)| *i).collect();
        let done = async {
            let wait = |mut rx: tokio::sync::mpsc::UnboundedReceiver<ctl::Reply>| async move {
                let r = rx
                    .recv()
                    .await
                    .ok_or_else(gone)
                    .map_err(|e| Error::io("set up the sandbox", e))?;
                check_reply(&r, "set up the sandbox")
            };
            for (_, rx) in spawned.queued {
                wait(rx).await?;
            }
            if !later.is_empty() {
                if let Some(tar) = upper {
                    restore_upper(pid, tar, &ids, user)?;
                }
                for next in &later {
                    let (rid, rx) = ctl.register();
                    ids_used.push(rid);
                    ctl.send(proto::MSG_SETUP, rid, next, &[])
                        .await
                        .map_err(|e| Error::io("set up the sandbox", e))?;
                    wait(rx).await?;
                }
            }
            Ok::<(), Error>(())
        };
        let mut done = done.await;
        if let (Ok(()), Some(lo)) = (&done, lo) {
            done = match lo.await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(Error::io("bring up the sandbox's loopback interface", e)),
                Err(_) => Err(Error::backend(TIER, "the loopback thread vanished")),
            };
        }
        for rid in ids_used {
            ctl.unregister(rid);
        }
        if let Err(e) = done {
            spawn::reap(pid, true);
            if let Some(c) = &cgroup {
                c.remove(std::time::Duration::from_millis(500));
            }
            return Err(e);
        }
        let mut env = spec.base_env();
        for (k, v) in secrets.env() {
            env.insert(k.to_string(), v.to_string());
        }
        env.entry("PATH".into()).or_insert_with(|| {
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into()
        });
        env.insert("HOME".into(), "/workspace".into());
        env.entry("LANG".into()).or_insert_with(|| "C.UTF-8".into());
        if let Some((_, plan)) = &egress {
            for (k, v) in &plan.env {
                env.insert(k.clone(), v.clone());
            }
        }
        let state_file = self
            .cfg
            .state_dir
            .as_ref()
            .map(|d| d.join(cgroup_name(&id)));
        let inner = Arc::new(Inner {
            id: id.clone(),
            spec: spec.clone(),
            env,
            redactor: secrets.redactor(),
            born: Instant::now(),
            gone: Default::default(),
            gone_reason: Mutex::new(String::new()),
            pid,
            ctl,
            cgroup,
            ids,
            user,
            stay_root,
            egress: egress.as_ref().map(|(e, _)| e.clone()),
            state_file,
            terminated: Mutex::new(false),
            timer: Mutex::new(None),
            paused: Default::default(),
        });
        // From here on, dropping `sb` tears everything down.
        let mut sb = ContainerSandbox {
            inner,
            timeline: Default::default(),
        };
        if let Some(f) = &sb.inner.state_file {
            let mut rec = format!("{pid}\n");
            if let Some(c) = &sb.inner.cgroup {
                for d in c.dirs() {
                    rec.push_str(&format!("{}\n", d.display()));
                }
            }
            std::fs::write(f, rec).map_err(|e| Error::io_path("write state record", f, e))?;
        }
        t.mark(Phase::Filesystem);

        // The sandbox owns the link now: its teardown detaches it.
        release.disarm();
        if let Some((e, plan)) = &egress {
            e.attach(plan, pid).await?;
            t.mark(Phase::Network);
        }

        t.mark(Phase::Runtime);
        sb.timeline = t.finish();

        // Lifetime: destroy the sandbox when it runs out, even if nobody calls it.
        let weak = Arc::downgrade(&sb.inner);
        let life = spec.limits.lifetime();
        let timer = tokio::spawn(async move {
            tokio::time::sleep(life).await;
            if let Some(inner) = weak.upgrade() {
                let _ =
                    tokio::task::spawn_blocking(move || inner.terminate("lifetime limit reached"))
                        .await;
            }
        });
        if let Ok(mut t) = sb.inner.timer.lock() {
            *t = Some(timer.abort_handle());
        }
        Ok(sb)
    }

    /// Removes what crashed processes left behind: for every record in the state directory
    /// whose init is gone, its cgroup directories. Returns how many records were cleaned.
    pub fn cleanup_stale(&self) -> usize {
        let Some(dir) = &self.cfg.state_dir else {
            return 0;
        };
        let Ok(rd) = std::fs::read_dir(dir) else {
            return 0;
        };
        let mut n = 0;
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if !name.starts_with("asb-") {
                continue;
            }
            let Ok(rec) = std::fs::read_to_string(e.path()) else {
                continue;
            };
            let mut lines = rec.lines();
            let Some(pid) = lines.next().and_then(|p| p.parse::<i32>().ok()) else {
                continue;
            };
            let dirs: Vec<PathBuf> = lines.map(PathBuf::from).collect();
            // Live: its cgroups still hold processes (the init dies when its process does),
            // or, without cgroups, its init still runs.
            let live = if dirs.is_empty() {
                std::fs::read_link(format!("/proc/{pid}/exe"))
                    .is_ok_and(|e| e.to_string_lossy().contains("agent-sandbox-init"))
            } else {
                dirs.iter().any(|d| {
                    std::fs::read_to_string(d.join("cgroup.procs"))
                        .is_ok_and(|p| !p.trim().is_empty())
                })
            };
            if live {
                continue;
            }
            for p in dirs {
                if p.file_name().is_some_and(|f| f.to_string_lossy() == name) {
                    if let Ok(sub) = std::fs::read_dir(&p) {
                        for s in sub.flatten() {
                            if s.file_type().is_ok_and(|t| t.is_dir()) {
                                cgroup::kill_procs(&s.path());
                                let _ = std::fs::remove_dir(s.path());
                            }
                        }
                    }
                    cgroup::kill_procs(&p);
                    let _ = std::fs::remove_dir(&p);
                }
            }
            let _ = std::fs::remove_file(e.path());
            n += 1;
        }
        n
    }

    async fn probe_status(&self) -> TierStatus {
        let mut details = std::collections::BTreeMap::new();
        let root = is_root();
        details.insert(
            "mode".to_string(),
            if root { "root" } else { "rootless" }.to_string(),
        );
        let uname = nix::sys::utsname::uname().ok();
        if let Some(u) = &uname {
            details.insert("kernel".into(), u.release().to_string_lossy().into_owned());
        }
        let max_userns = std::fs::read_to_string("/proc/sys/user/max_user_namespaces")
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok());
        let cgroups = self.cgroups_usable();
        details.insert(
            "cgroup".into(),
            match self.host.version() {
                Some(CgroupVersion::V1) => "v1".into(),
                Some(CgroupVersion::V2) => {
                    let mut v = match self.host.delegation() {
                        Some(cgroup::Delegation::MovedInto(leaf)) => {
                            format!("v2 (this process moved into {})", leaf.display())
                        }
                        _ => "v2".into(),
                    };
                    if self.host.v2_without_limits {
                        v.push_str(", not offered memory and pids: those limits are not enforced");
                    }
                    v
                }
                None => "none".into(),
            },
        );
        details.insert("seccomp".into(), seccomp::available().to_string());
        details.insert(
            "landlock_abi".into(),
            self.landlock_abi.map_or("none".into(), |a| a.to_string()),
        );
        let with = |mut s: TierStatus| {
            s.details = details.clone();
            s
        };
        if max_userns == Some(0) {
            return with(TierStatus::unavailable(
                TIER,
                "user namespaces are disabled (user.max_user_namespaces = 0)",
                "sysctl -w user.max_user_namespaces=15000",
            ));
        }
        if let Err(e) = spawn::image() {
            return with(TierStatus::unavailable(
                TIER,
                e,
                "check that memfd_create and exec from memfd are allowed (vm.memfd_noexec = 0)",
            ));
        }
        if !seccomp::available() && self.cfg.seccomp {
            return with(TierStatus::unavailable(
                TIER,
                "the kernel has no seccomp",
                "use a kernel built with CONFIG_SECCOMP_FILTER",
            ));
        }
        if let (Err(reason), true) = (cgroups, self.cfg.require_cgroups) {
            return with(TierStatus::unavailable(
                TIER,
                reason,
                "run as root, or delegate a cgroup (v1: in each of memory, pids, cpu; v2: with memory and pids \
                 controllers) to this user and start the process inside it",
            ));
        }
        // A real smoke test, bounded.
        let spec = SandboxSpec::new(Language::Shell);
        let started = Instant::now();
        let smoke = async {
            let sb = self.create_sandbox(&spec, ResolvedSecrets::none()).await?;
            let r =
                sandbox_core::Sandbox::exec(&sb, sandbox_core::ExecRequest::argv(["/bin/true"]))
                    .await?;
            sandbox_core::Sandbox::destroy(&sb).await?;
            Ok::<_, Error>(r)
        };
        match tokio::time::timeout(std::time::Duration::from_secs(10), smoke).await {
            Ok(Ok(r)) if r.success() => {
                details.insert("smoke_test_us".into(), started.elapsed().as_micros().to_string());
                let mut s = TierStatus::available(
                    TIER,
                    format!(
                        "namespaces + cgroup {} + seccomp + landlock {} ({})",
                        details.get("cgroup").map_or("?", |s| s.as_str()),
                        details.get("landlock_abi").map_or("?", |s| s.as_str()),
                        if root { "root" } else { "rootless" }
                    ),
                );
                s.details = details;
                s
            }
            Ok(Ok(r)) => with(TierStatus::unavailable(
                TIER,
                format!("smoke test `/bin/true` failed: exit {:?}, {}", r.exit_code, r.stderr_str().trim()),
                "check that /usr/bin is readable and the sandbox can exec host binaries",
            )),
            Ok(Err(e)) => with(TierStatus::unavailable(
                TIER,
                format!("smoke test failed: {e}"),
                "check that user namespaces (also for this uid), pivot_root and tmpfs/proc mounts work: \
                 `unshare --user --map-root-user --mount --pid --fork true`",
            )),
            Err(_) => with(TierStatus::unavailable(TIER, "smoke test timed out after 10 s", "check the host's load and kernel logs")),
        }
    }
}

fn check_reply(r: &ctl::Reply, what: &str) -> Result<()> {
    match r.kind {
        proto::REP_OK => Ok(()),
        proto::REP_ERR => {
            let mut d = proto::Dec::new(&r.payload);
            let _ = d.u32();
            let errno = d.i32().unwrap_or(0);
            let msg = d.str().unwrap_or_default();
            if errno == libc::ENOSPC || errno == libc::ENOMEM {
                return Err(Error::ResourceExhausted {
                    what: format!("{what}: {msg}"),
                });
            }
            Err(Error::backend(TIER, format!("{what}: {msg}")))
        }
        k => Err(Error::backend(
            TIER,
            format!("{what}: unexpected reply {k}"),
        )),
    }
}

#[async_trait]
impl Backend for ContainerBackend {
    fn tier(&self) -> Tier {
        TIER
    }

    fn capabilities(&self) -> Capabilities {
        let mut network = vec![NetworkMode::DenyAll];
        if self.cfg.egress.is_some() {
            network.extend([NetworkMode::Allowlist, NetworkMode::Internet]);
        }
        let freezer = match self.host.version() {
            Some(CgroupVersion::V1) => self.host.v1.iter().any(|(c, _)| c == "freezer"),
            Some(CgroupVersion::V2) => true,
            None => false,
        };
        Capabilities {
            tier: TIER,
            languages: vec![
                Language::Python,
                Language::Shell,
                Language::Node,
                Language::Javascript,
                Language::C,
            ],
            argv: true,
            boundary: IsolationBoundary::SharedKernel,
            snapshots: vec![SnapshotKind::Filesystem],
            network,
            pause_resume: freezer && self.cgroups_usable().is_ok(),
            streaming: true,
            persistent_state: true,
        }
    }

    async fn probe(&self) -> TierStatus {
        self.probe_status().await
    }

    async fn create(
        &self,
        spec: &SandboxSpec,
        secrets: ResolvedSecrets,
    ) -> Result<Box<dyn Sandbox>> {
        Ok(Box::new(self.create_sandbox(spec, secrets).await?))
    }

    async fn restore(
        &self,
        store: &dyn SnapshotStore,
        id: &SnapshotId,
        secrets: ResolvedSecrets,
    ) -> Result<Box<dyn Sandbox>> {
        let m = store.manifest_for(id, TIER).await?;
        if m.engine != ENGINE {
            return Err(sandbox_core::SnapshotError::Incompatible {
                id: id.clone(),
                reason: format!("written by `{}`, this is `{ENGINE}`", m.engine),
            }
            .into());
        }
        if !m.kinds.contains(&SnapshotKind::Filesystem) {
            return Err(sandbox_core::SnapshotError::Incompatible {
                id: id.clone(),
                reason: "not a filesystem snapshot".into(),
            }
            .into());
        }
        let tar = store.artifact(id, "workspace.tar").await?;
        let mut spec = m.spec.clone();
        // A snapshot of a host-directory workspace restores into a fresh one: restoring must
        // never write into a host directory.
        if matches!(spec.workspace, Workspace::HostDir { .. }) {
            spec.workspace = Workspace::Empty;
        }
        let upper = if spec.rootfs.is_some() {
            Some(store.artifact(id, "upper.tar").await?)
        } else {
            None
        };
        let mut t = TimelineRecorder::start();
        let mut sb = self.create_inner(&spec, secrets, upper.as_deref()).await?;
        let ws = sb.inner.workspace_fd()?;
        files_unpack(&sb, &ws, &tar)?;
        t.mark(Phase::Restore);
        sb.timeline.extend(&t.finish());
        Ok(Box::new(sb))
    }

    /// The records of the state directory whose sandboxes are gone
    /// ([`ContainerBackend::cleanup_stale`]), then the cgroups named after dead processes
    /// (which building a backend also sweeps). Counts records and cgroup directories.
    async fn cleanup_stale(&self) -> Result<usize> {
        Ok(ContainerBackend::cleanup_stale(self) + self.host.sweep_orphans())
    }
}

/// Unpacks a snapshot's `upper.tar` into the overlay upper layer the init keeps open (before
/// the overlay is mounted), as the sandbox's root.
fn restore_upper(pid: libc::pid_t, tar: &[u8], ids: &IdMap, user: u32) -> Result<()> {
    use std::os::fd::AsRawFd;
    let p = format!("/proc/{pid}/fd/{}", proto::UPPER_FD);
    let dir = std::fs::File::open(&p).map_err(|e| Error::io(format!("open {p}"), e))?;
    let owner = (!ids.rootless).then(|| files::Owner {
        uid: ids.host_uid(user),
        gid: ids.host_gid(user),
    });
    let _ids = files::FsIds::switch(owner);
    files::unpack_upper(dir.as_raw_fd(), tar, owner)
}

fn files_unpack(sb: &ContainerSandbox, ws: &std::os::fd::OwnedFd, tar: &[u8]) -> Result<()> {
    use std::os::fd::AsRawFd;
    let _ids = files::FsIds::switch(sb.inner.owner());
    files::unpack(ws.as_raw_fd(), tar, sb.inner.owner())
}

/// Gives a prepared egress link back if a create fails before the sandbox owns it.
struct EgressRelease(Option<(Arc<dyn EgressEnforcer>, String)>);

impl EgressRelease {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for EgressRelease {
    fn drop(&mut self) {
        if let Some((e, id)) = self.0.take() {
            e.detach_in_background(&id);
        }
    }
}

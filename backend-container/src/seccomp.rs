//! The seccomp filter every sandboxed process runs under (see `docs/container.md` for the list
//! and the reasons). A deny-list: agents need a general-purpose Linux (compilers, package
//! managers, language runtimes), so everything is allowed except what no agent workload needs
//! and what widens the kernel attack surface or breaks out of the namespaces.
//!
//! The program is built here as classic BPF and installed by the init on itself (so every
//! exec inherits it) after `no_new_privs`.

/// One BPF instruction (`struct sock_filter`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Insn {
    /// Opcode.
    pub code: u16,
    /// Jump offset if true.
    pub jt: u8,
    /// Jump offset if false.
    pub jf: u8,
    /// Constant.
    pub k: u32,
}

const BPF_LD_W_ABS: u16 = 0x20; // BPF_LD | BPF_W | BPF_ABS
const BPF_JEQ_K: u16 = 0x15; // BPF_JMP | BPF_JEQ | BPF_K
const BPF_JGE_K: u16 = 0x35; // BPF_JMP | BPF_JGE | BPF_K
const BPF_JSET_K: u16 = 0x45; // BPF_JMP | BPF_JSET | BPF_K
const BPF_RET_K: u16 = 0x06; // BPF_RET | BPF_K

const RET_ALLOW: u32 = 0x7fff_0000;
const RET_KILL_PROCESS: u32 = 0x8000_0000;
const RET_ERRNO: u32 = 0x0005_0000;

const OFF_NR: u32 = 0;
const OFF_ARCH: u32 = 4;
// args[i] low 32 bits (little-endian hosts only, which is all we build for).
const fn off_arg_lo(i: u32) -> u32 {
    16 + 8 * i
}

#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: u32 = 0xc000_003e;
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH: u32 = 0xc000_00b7;

/// Every `CLONE_NEW*` namespace flag.
pub const NS_FLAGS: u32 = (libc::CLONE_NEWUSER
    | libc::CLONE_NEWNS
    | libc::CLONE_NEWPID
    | libc::CLONE_NEWNET
    | libc::CLONE_NEWUTS
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWCGROUP
    | 0x80/* CLONE_NEWTIME */) as u32;

/// A syscall refused outright, with the errno returned and why.
#[derive(Debug, Clone, Copy)]
pub struct Denied {
    /// Syscall number.
    pub nr: i64,
    /// Name, for docs and tests.
    pub name: &'static str,
    /// errno returned.
    pub errno: i32,
}

macro_rules! deny {
    ($($name:ident => $errno:expr),* $(,)?) => {
        &[$(Denied { nr: libc::$name as i64, name: stringify!($name), errno: $errno }),*]
    };
}

/// Syscalls refused whatever their arguments.
pub fn denied() -> &'static [Denied] {
    use libc::{ENOSYS, EPERM};
    deny![
        // Replace or reconfigure the kernel.
        SYS_kexec_load => EPERM, SYS_kexec_file_load => EPERM, SYS_reboot => EPERM,
        SYS_init_module => EPERM, SYS_finit_module => EPERM, SYS_delete_module => EPERM,
        // Large, often-exploited kernel surfaces agents never need.
        SYS_bpf => EPERM, SYS_perf_event_open => EPERM, SYS_userfaultfd => EPERM,
        SYS_io_uring_setup => ENOSYS, SYS_io_uring_enter => ENOSYS, SYS_io_uring_register => ENOSYS,
        // The kernel keyring is not namespaced.
        SYS_keyctl => EPERM, SYS_add_key => EPERM, SYS_request_key => EPERM,
        // The filesystem view is fixed after setup.
        SYS_mount => EPERM, SYS_umount2 => EPERM, SYS_pivot_root => EPERM, SYS_chroot => EPERM,
        SYS_move_mount => EPERM, SYS_open_tree => EPERM, SYS_fsopen => EPERM, SYS_fsconfig => EPERM,
        SYS_fsmount => EPERM, SYS_fspick => EPERM, SYS_mount_setattr => EPERM,
        // Joining other namespaces; clone3's flags live in memory seccomp cannot read, so
        // it is refused with ENOSYS and libc falls back to clone, whose flags are checked.
        SYS_setns => EPERM, SYS_clone3 => ENOSYS,
        // Inspecting or writing other processes' memory.
        SYS_ptrace => EPERM, SYS_process_vm_readv => EPERM, SYS_process_vm_writev => EPERM,
        SYS_pidfd_getfd => EPERM, SYS_kcmp => EPERM,
        // File handles bypass path-based checks (the "shocker" escape).
        SYS_open_by_handle_at => EPERM, SYS_name_to_handle_at => EPERM,
        // Host-global state.
        SYS_swapon => EPERM, SYS_swapoff => EPERM, SYS_syslog => EPERM, SYS_acct => EPERM,
        SYS_settimeofday => EPERM, SYS_clock_settime => EPERM, SYS_clock_adjtime => EPERM,
        SYS_adjtimex => EPERM, SYS_quotactl => EPERM, SYS_vhangup => EPERM,
        SYS_fanotify_init => EPERM, SYS_lookup_dcookie => EPERM,
        SYS_mbind => EPERM, SYS_migrate_pages => EPERM, SYS_move_pages => EPERM,
        SYS_set_mempolicy => EPERM,
    ]
}

#[cfg(target_arch = "x86_64")]
fn arch_denied() -> &'static [Denied] {
    use libc::{ENOSYS, EPERM};
    deny![SYS_iopl => EPERM, SYS_ioperm => EPERM, SYS_uselib => EPERM, SYS_nfsservctl => ENOSYS]
}

#[cfg(not(target_arch = "x86_64"))]
fn arch_denied() -> &'static [Denied] {
    &[]
}

fn ld(off: u32) -> Insn {
    Insn {
        code: BPF_LD_W_ABS,
        jt: 0,
        jf: 0,
        k: off,
    }
}
fn ret(k: u32) -> Insn {
    Insn {
        code: BPF_RET_K,
        jt: 0,
        jf: 0,
        k,
    }
}
fn errno(e: i32) -> u32 {
    RET_ERRNO | (e as u32 & 0xffff)
}

/// A jump target in [`program`]'s layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Label {
    /// The namespace-flag check of `clone`/`unshare`.
    NsFlags,
    /// The `ioctl` request check.
    Ioctl,
    /// An `open` that may create a file: its flags (argument `flags`) checked for
    /// [`CREATE_FLAGS`], then its mode (argument `mode`) as [`Label::Mode`] does.
    Create { flags: u32, mode: u32 },
    /// The mode in argument `n` checked for the set-id bits ([`SETID_BITS`]).
    Mode(u32),
    /// `return errno(e)`.
    Errno(i32),
}

/// `fchmodat2` (Linux 6.6; the same number on every architecture, not in every libc).
const SYS_FCHMODAT2: i64 = 452;

/// The set-user-ID and set-group-ID mode bits.
const SETID_BITS: u32 = 0o6000;
/// The `open` flags with which it creates a file (and takes a mode): `O_CREAT`, and the
/// bit of `O_TMPFILE` that is its own (`__O_TMPFILE`).
const CREATE_FLAGS: u32 = libc::O_CREAT as u32 | 0o2000_0000;

/// The syscalls that set a file's mode, with the argument holding it ([`Label::Mode`]), or
/// its flags and mode ([`Label::Create`]); refused by the set-id guard (see
/// [`program_with`]) when the mode carries [`SETID_BITS`].
fn mode_setters() -> Vec<(i64, Label)> {
    let mut v = vec![
        (libc::SYS_fchmod, Label::Mode(1)),
        (libc::SYS_fchmodat, Label::Mode(2)),
        (SYS_FCHMODAT2, Label::Mode(2)),
        (libc::SYS_mknodat, Label::Mode(2)),
        (libc::SYS_openat, Label::Create { flags: 2, mode: 3 }),
    ];
    #[cfg(target_arch = "x86_64")]
    v.extend([
        (libc::SYS_chmod, Label::Mode(1)),
        (libc::SYS_creat, Label::Mode(1)),
        (libc::SYS_mknod, Label::Mode(1)),
        (libc::SYS_open, Label::Create { flags: 1, mode: 2 }),
    ]);
    v
}

/// An instruction whose true branch jumps to a label (the false branch falls through).
#[derive(Debug, Clone, Copy)]
enum Item {
    Plain(Insn),
    Jump { code: u16, k: u32, to: Label },
}

/// Builds the filter program: the architecture check, then one comparison per refused or
/// argument-checked syscall, each jumping to a block shared by all with the same outcome.
///
/// Compactness is speed here: the kernel verifies, converts and JIT-compiles the filter in
/// every sandbox's init, and that cost grows with its length (measured on this host: 42
/// instructions ~90 µs, 82 ~110 µs, 132 ~230 µs); one shared return per errno instead of
/// one after each comparison halves the program.
pub fn program() -> Vec<Insn> {
    program_with(false)
}

/// [`program`], plus, with `setid_guard`, the **set-id guard**: setting the setuid or setgid
/// bit is refused with `EPERM` (`chmod`, `fchmod`, `fchmodat`, `fchmodat2`, `mknod`,
/// `mknodat`, and `open`, `openat`, `creat` that create a file with those bits), and
/// `openat2`, whose mode lives in memory seccomp cannot read, answers `ENOSYS` (callers
/// fall back to `openat`). For sandboxes whose writable workspace belongs to host root
/// through its idmapped mount: there, a set-id file would be a set-id-root program on the
/// host (see "Identity" in `docs/container.md`).
pub fn program_with(setid_guard: bool) -> Vec<Insn> {
    let jeq = |k: u32, to: Label| Item::Jump {
        code: BPF_JEQ_K,
        k,
        to,
    };
    let mut items = vec![
        Item::Plain(ld(OFF_ARCH)),
        Item::Plain(Insn {
            code: BPF_JEQ_K,
            jt: 1,
            jf: 0,
            k: AUDIT_ARCH,
        }),
        Item::Plain(ret(RET_KILL_PROCESS)),
        Item::Plain(ld(OFF_NR)),
    ];
    // x32 syscalls share the arch value: refuse the whole x32 range.
    #[cfg(target_arch = "x86_64")]
    items.push(Item::Jump {
        code: BPF_JGE_K,
        k: 0x4000_0000,
        to: Label::Errno(libc::ENOSYS),
    });
    // clone(flags, ...) and unshare(flags): no new namespaces (a new user namespace would
    // regain capabilities). ioctl(fd, TIOCSTI / TIOCLINUX): typing into a terminal outside.
    items.push(jeq(libc::SYS_clone as u32, Label::NsFlags));
    items.push(jeq(libc::SYS_unshare as u32, Label::NsFlags));
    items.push(jeq(libc::SYS_ioctl as u32, Label::Ioctl));
    let setters = if setid_guard {
        mode_setters()
    } else {
        Vec::new()
    };
    for (nr, label) in &setters {
        items.push(jeq(*nr as u32, *label));
    }
    if setid_guard {
        items.push(jeq(libc::SYS_openat2 as u32, Label::Errno(libc::ENOSYS)));
    }
    for d in denied().iter().chain(arch_denied()) {
        items.push(jeq(d.nr as u32, Label::Errno(d.errno)));
    }
    items.push(Item::Plain(ret(RET_ALLOW)));
    // The blocks, in order; each ends in a return.
    let mut blocks: Vec<(Label, Vec<Item>)> = vec![
        (
            Label::NsFlags,
            vec![
                Item::Plain(ld(off_arg_lo(0))),
                Item::Jump {
                    code: BPF_JSET_K,
                    k: NS_FLAGS,
                    to: Label::Errno(libc::EPERM),
                },
                Item::Plain(ret(RET_ALLOW)),
            ],
        ),
        (
            Label::Ioctl,
            vec![
                Item::Plain(ld(off_arg_lo(1))),
                jeq(libc::TIOCSTI as u32, Label::Errno(libc::EPERM)),
                jeq(libc::TIOCLINUX as u32, Label::Errno(libc::EPERM)),
                Item::Plain(ret(RET_ALLOW)),
            ],
        ),
    ];
    // The set-id guard's blocks: the flag checks first (they jump forward to the mode
    // checks), one block per distinct label.
    let mut creates: Vec<Label> = Vec::new();
    let mut modes: Vec<Label> = Vec::new();
    for (_, label) in &setters {
        let (list, mode) = match *label {
            Label::Create { mode, .. } => (&mut creates, Label::Mode(mode)),
            l => (&mut modes, l),
        };
        if !list.contains(label) {
            list.push(*label);
        }
        if !modes.contains(&mode) {
            modes.push(mode);
        }
    }
    for label in creates {
        if let Label::Create { flags, mode } = label {
            blocks.push((
                label,
                vec![
                    Item::Plain(ld(off_arg_lo(flags))),
                    Item::Jump {
                        code: BPF_JSET_K,
                        k: CREATE_FLAGS,
                        to: Label::Mode(mode),
                    },
                    Item::Plain(ret(RET_ALLOW)),
                ],
            ));
        }
    }
    for label in modes {
        if let Label::Mode(n) = label {
            blocks.push((
                label,
                vec![
                    Item::Plain(ld(off_arg_lo(n))),
                    Item::Jump {
                        code: BPF_JSET_K,
                        k: SETID_BITS,
                        to: Label::Errno(libc::EPERM),
                    },
                    Item::Plain(ret(RET_ALLOW)),
                ],
            ));
        }
    }
    let mut errnos: Vec<i32> = denied()
        .iter()
        .chain(arch_denied())
        .map(|d| d.errno)
        .chain([libc::EPERM, libc::ENOSYS])
        .collect();
    errnos.sort_unstable();
    errnos.dedup();
    for e in errnos {
        blocks.push((Label::Errno(e), vec![Item::Plain(ret(errno(e)))]));
    }
    // Lay out, then resolve the (always forward) jumps.
    let mut at = Vec::new();
    for (label, body) in blocks {
        at.push((label, items.len()));
        items.extend(body);
    }
    items
        .iter()
        .enumerate()
        .map(|(pc, item)| match *item {
            Item::Plain(i) => i,
            Item::Jump { code, k, to } => {
                let target = at
                    .iter()
                    .find(|(l, _)| *l == to)
                    .map_or(pc + 1, |(_, t)| *t);
                // Offsets fit a byte: the program is ~80 instructions (see the tests).
                let jt = u8::try_from(target.saturating_sub(pc + 1)).unwrap_or(u8::MAX);
                Insn { code, jt, jf: 0, k }
            }
        })
        .collect()
}

/// The program as the bytes of a `struct sock_filter` array (native endian).
pub fn program_bytes() -> Vec<u8> {
    program_bytes_with(false)
}

/// [`program_with`] as the bytes of a `struct sock_filter` array (native endian).
pub fn program_bytes_with(setid_guard: bool) -> Vec<u8> {
    let mut out = Vec::new();
    for i in program_with(setid_guard) {
        out.extend_from_slice(&i.code.to_ne_bytes());
        out.push(i.jt);
        out.push(i.jf);
        out.extend_from_slice(&i.k.to_ne_bytes());
    }
    out
}

/// Whether the kernel supports seccomp filters (`Seccomp:` in /proc/self/status).
pub fn available() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .is_ok_and(|s| s.lines().any(|l| l.starts_with("Seccomp:")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny BPF interpreter for the subset we emit.
    fn run(p: &[Insn], arch: u32, nr: u32, args: [u64; 6]) -> u32 {
        let mut data = [0u8; 64];
        data[0..4].copy_from_slice(&nr.to_le_bytes());
        data[4..8].copy_from_slice(&arch.to_le_bytes());
        for (i, a) in args.iter().enumerate() {
            data[16 + 8 * i..24 + 8 * i].copy_from_slice(&a.to_le_bytes());
        }
        let mut acc = 0u32;
        let mut pc = 0usize;
        loop {
            let i = p[pc];
            match i.code {
                BPF_LD_W_ABS => {
                    let o = i.k as usize;
                    acc = u32::from_le_bytes(data[o..o + 4].try_into().unwrap());
                    pc += 1;
                }
                BPF_JEQ_K => pc += 1 + usize::from(if acc == i.k { i.jt } else { i.jf }),
                BPF_JGE_K => pc += 1 + usize::from(if acc >= i.k { i.jt } else { i.jf }),
                BPF_JSET_K => pc += 1 + usize::from(if acc & i.k != 0 { i.jt } else { i.jf }),
                BPF_RET_K => return i.k,
                c => panic!("unexpected opcode {c}"),
            }
        }
    }

    #[test]
    #[allow(clippy::unnecessary_cast)] // the libc types differ between targets
    fn filter_decisions() {
        let p = program();
        // Short, because its length is paid in every create (see `program`), and every jump
        // offset fits a byte.
        assert!(p.len() < 90, "{}", p.len());
        for d in denied().iter().chain(arch_denied()) {
            let r = run(&p, AUDIT_ARCH, d.nr as u32, [0; 6]);
            assert_eq!(r, errno(d.errno), "{}", d.name);
        }
        for nr in [
            libc::SYS_write,
            libc::SYS_openat,
            libc::SYS_execve,
            libc::SYS_wait4,
        ] {
            assert_eq!(run(&p, AUDIT_ARCH, nr as u32, [0; 6]), RET_ALLOW, "{nr}");
        }
        let a = AUDIT_ARCH;
        let z = [0u64; 6];
        assert_eq!(run(&p, a, libc::SYS_read as u32, z), RET_ALLOW);
        assert_eq!(run(&p, a, libc::SYS_mount as u32, z), errno(libc::EPERM));
        assert_eq!(run(&p, a, libc::SYS_bpf as u32, z), errno(libc::EPERM));
        assert_eq!(run(&p, a, libc::SYS_clone3 as u32, z), errno(libc::ENOSYS));
        assert_eq!(
            run(&p, a, libc::SYS_io_uring_setup as u32, z),
            errno(libc::ENOSYS)
        );
        // clone for threads/fork is fine; with a namespace flag it is not.
        let fork_flags =
            (libc::CLONE_CHILD_SETTID | libc::CLONE_CHILD_CLEARTID | libc::SIGCHLD) as u64;
        assert_eq!(
            run(&p, a, libc::SYS_clone as u32, [fork_flags, 0, 0, 0, 0, 0]),
            RET_ALLOW
        );
        let userns = fork_flags | libc::CLONE_NEWUSER as u64;
        assert_eq!(
            run(&p, a, libc::SYS_clone as u32, [userns, 0, 0, 0, 0, 0]),
            errno(libc::EPERM)
        );
        assert_eq!(
            run(
                &p,
                a,
                libc::SYS_unshare as u32,
                [libc::CLONE_NEWNS as u64, 0, 0, 0, 0, 0]
            ),
            errno(libc::EPERM)
        );
        assert_eq!(
            run(
                &p,
                a,
                libc::SYS_unshare as u32,
                [libc::CLONE_FILES as u64, 0, 0, 0, 0, 0]
            ),
            RET_ALLOW
        );
        assert_eq!(
            run(
                &p,
                a,
                libc::SYS_ioctl as u32,
                [1, libc::TIOCSTI as u64, 0, 0, 0, 0]
            ),
            errno(libc::EPERM)
        );
        assert_eq!(
            run(
                &p,
                a,
                libc::SYS_ioctl as u32,
                [1, libc::TIOCGWINSZ as u64, 0, 0, 0, 0]
            ),
            RET_ALLOW
        );
        // Another architecture is killed.
        assert_eq!(
            run(&p, 0x4000_0003, libc::SYS_read as u32, z),
            RET_KILL_PROCESS
        );
        #[cfg(target_arch = "x86_64")]
        assert_eq!(
            run(&p, a, 0x4000_0000 | libc::SYS_read as u32, z),
            errno(libc::ENOSYS)
        );
        assert_eq!(program_bytes().len(), p.len() * 8);
        // Without the set-id guard, modes are nobody's business.
        let suid = [0, 0, 0o4755, 0, 0, 0];
        assert_eq!(run(&p, a, libc::SYS_fchmodat as u32, suid), RET_ALLOW);
    }

    #[test]
    #[allow(clippy::unnecessary_cast)] // the libc types differ between targets
    fn the_setid_guard_refuses_setuid_and_setgid_modes_only() {
        let p = program_with(true);
        assert!(p.len() < 130, "{}", p.len());
        let a = AUDIT_ARCH;
        let eperm = errno(libc::EPERM);
        let creat = (libc::O_CREAT | libc::O_WRONLY) as u64;
        let tmpfile = (libc::O_TMPFILE | libc::O_WRONLY) as u64;
        let cases: Vec<(i64, [u64; 6], u32)> = vec![
            (libc::SYS_fchmod, [3, 0o4755, 0, 0, 0, 0], eperm),
            (libc::SYS_fchmod, [3, 0o2755, 0, 0, 0, 0], eperm),
            (libc::SYS_fchmod, [3, 0o1777, 0, 0, 0, 0], RET_ALLOW),
            (libc::SYS_fchmodat, [0, 0, 0o6755, 0, 0, 0], eperm),
            (libc::SYS_fchmodat, [0, 0, 0o755, 0, 0, 0], RET_ALLOW),
            (SYS_FCHMODAT2, [0, 0, 0o4700, 0, 0, 0], eperm),
            (libc::SYS_mknodat, [0, 0, 0o104755, 0, 0, 0], eperm),
            (libc::SYS_openat, [0, 0, creat, 0o4755, 0, 0], eperm),
            (libc::SYS_openat, [0, 0, tmpfile, 0o2755, 0, 0], eperm),
            (libc::SYS_openat, [0, 0, creat, 0o644, 0, 0], RET_ALLOW),
            // Without O_CREAT the mode argument means nothing.
            (libc::SYS_openat, [0, 0, 0, 0o4755, 0, 0], RET_ALLOW),
            (libc::SYS_openat2, [0; 6], errno(libc::ENOSYS)),
            (
                libc::SYS_write,
                [1, 0o4755, 0o4755, 0o4755, 0, 0],
                RET_ALLOW,
            ),
        ];
        for (nr, args, want) in cases {
            assert_eq!(run(&p, a, nr as u32, args), want, "{nr} {args:?}");
        }
        #[cfg(target_arch = "x86_64")]
        {
            assert_eq!(
                run(&p, a, libc::SYS_chmod as u32, [0, 0o4755, 0, 0, 0, 0]),
                eperm
            );
            assert_eq!(
                run(&p, a, libc::SYS_creat as u32, [0, 0o2755, 0, 0, 0, 0]),
                eperm
            );
            assert_eq!(
                run(&p, a, libc::SYS_open as u32, [0, creat, 0o4755, 0, 0, 0]),
                eperm
            );
            assert_eq!(
                run(&p, a, libc::SYS_open as u32, [0, creat, 0o755, 0, 0, 0]),
                RET_ALLOW
            );
        }
        // Everything else decides as without the guard.
        let plain = program();
        for d in denied().iter().chain(arch_denied()) {
            assert_eq!(
                run(&p, a, d.nr as u32, [0; 6]),
                run(&plain, a, d.nr as u32, [0; 6])
            );
        }
        assert_eq!(program_bytes_with(true).len(), p.len() * 8);
    }
}

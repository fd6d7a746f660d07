//! The seccomp filter every sandboxed process runs under (see `docs/container.md` for the list
//! and the reasons). A deny-list: agents need a general-purpose Linux (compilers, package
//! managers, language runtimes), so everything is allowed except what no agent workload needs
//! and what widens the kernel attack surface or breaks out of the namespaces.
//!
//! The rules are compiled by `seccompiler` (as the microVM tier's are), one filter per
//! errno, since a `seccompiler` filter has a single action for its matches. Two things it
//! cannot say are added around its output, in [`program_with`]: the x32 syscall range (a
//! range of numbers, not one) and the chaining of its filters into the one program the init
//! installs on itself (so every exec inherits it) after `no_new_privs`.
//!
//! The price of `seccompiler`'s layout (five instructions per refused syscall, one rule per
//! flag bit) is length: 403 instructions (582 with the set-id guard) where the hand-written
//! program it replaced had 73 (98), and the kernel verifies, converts and JIT-compiles the
//! filter in every sandbox's init: installing it took ~176 µs instead of ~78 µs (~232 µs
//! instead of ~93 µs with the guard), medians of 300 installs on the 2-vCPU dev host.

use std::collections::BTreeMap;

use seccompiler::{
    sock_filter, BackendError, BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp,
    SeccompCondition, SeccompFilter, SeccompRule, TargetArch,
};

/// `seccomp_data.arch` of this build's architecture.
#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: u32 = 0xc000_003e;
/// `seccomp_data.arch` of this build's architecture (only the tests need it there).
#[cfg(all(test, target_arch = "aarch64"))]
const AUDIT_ARCH: u32 = 0xc000_00b7;

/// This build's architecture, as `seccompiler` names it.
#[cfg(target_arch = "x86_64")]
const TARGET_ARCH: TargetArch = TargetArch::x86_64;
/// This build's architecture, as `seccompiler` names it.
#[cfg(target_arch = "aarch64")]
const TARGET_ARCH: TargetArch = TargetArch::aarch64;

/// Classic BPF opcodes of the hand-written parts (x32 range, chaining).
#[cfg(any(test, target_arch = "x86_64"))]
const BPF_LD_W_ABS: u16 = 0x20; // BPF_LD | BPF_W | BPF_ABS
#[cfg(any(test, target_arch = "x86_64"))]
const BPF_JEQ_K: u16 = 0x15; // BPF_JMP | BPF_JEQ | BPF_K
#[cfg(any(test, target_arch = "x86_64"))]
const BPF_JGE_K: u16 = 0x35; // BPF_JMP | BPF_JGE | BPF_K
const BPF_JA: u16 = 0x05; // BPF_JMP | BPF_JA
const BPF_RET_K: u16 = 0x06; // BPF_RET | BPF_K

const RET_ALLOW: u32 = 0x7fff_0000;
#[cfg(any(test, target_arch = "x86_64"))]
const RET_KILL_PROCESS: u32 = 0x8000_0000;
#[cfg(any(test, target_arch = "x86_64"))]
const RET_ERRNO: u32 = 0x0005_0000;

/// Offsets in `struct seccomp_data`.
#[cfg(target_arch = "x86_64")]
const OFF_NR: u32 = 0;
#[cfg(target_arch = "x86_64")]
const OFF_ARCH: u32 = 4;

/// The first x32 syscall number (`__X32_SYSCALL_BIT`); x32 shares x86_64's arch value.
#[cfg(target_arch = "x86_64")]
const X32_SYSCALL_BIT: u32 = 0x4000_0000;

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
#[non_exhaustive]
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

/// `fchmodat2` (Linux 6.6; the same number on every architecture, not in every libc).
const SYS_FCHMODAT2: i64 = 452;

/// The set-user-ID and set-group-ID mode bits, each checked on its own.
const SETID_BITS: [u32; 2] = [libc::S_ISUID, libc::S_ISGID];
/// The `open` flags with which it creates a file (and takes a mode), each checked on its
/// own: `O_CREAT`, and the bit of `O_TMPFILE` that is its own (`__O_TMPFILE`).
const CREATE_FLAGS: [u32; 2] = [libc::O_CREAT as u32, 0o2000_0000];

/// Where a mode-setting syscall holds the mode (argument indices).
#[derive(Debug, Clone, Copy)]
enum ModeArg {
    /// The mode is argument `n`.
    Mode(u8),
    /// An `open` that may create a file: its flags in argument `flags` (checked for
    /// [`CREATE_FLAGS`]), its mode in argument `mode`.
    Create { flags: u8, mode: u8 },
}

/// The syscalls that set a file's mode, with where the mode is; refused by the set-id
/// guard (see [`program_with`]) when the mode carries a [`SETID_BITS`] bit.
fn mode_setters() -> Vec<(i64, ModeArg)> {
    let mut v = vec![
        (libc::SYS_fchmod, ModeArg::Mode(1)),
        (libc::SYS_fchmodat, ModeArg::Mode(2)),
        (SYS_FCHMODAT2, ModeArg::Mode(2)),
        (libc::SYS_mknodat, ModeArg::Mode(2)),
        (libc::SYS_openat, ModeArg::Create { flags: 2, mode: 3 }),
    ];
    #[cfg(target_arch = "x86_64")]
    v.extend([
        (libc::SYS_chmod, ModeArg::Mode(1)),
        (libc::SYS_creat, ModeArg::Mode(1)),
        (libc::SYS_mknod, ModeArg::Mode(1)),
        (libc::SYS_open, ModeArg::Create { flags: 1, mode: 2 }),
    ]);
    v
}

/// The condition "bit `bit` is set in the low 32 bits of argument `arg`" (the kernel's
/// flag and mode arguments are `int`s: their upper halves are not looked at).
fn bit_set(arg: u8, bit: u32) -> Result<SeccompCondition, BackendError> {
    SeccompCondition::new(
        arg,
        SeccompCmpArgLen::Dword,
        SeccompCmpOp::MaskedEq(u64::from(bit)),
        u64::from(bit),
    )
}

/// The condition "the low 32 bits of argument `arg` are `value`".
fn equals(arg: u8, value: u32) -> Result<SeccompCondition, BackendError> {
    SeccompCondition::new(
        arg,
        SeccompCmpArgLen::Dword,
        SeccompCmpOp::Eq,
        u64::from(value),
    )
}

/// Rules matching when any bit of `mask` is set in argument `arg` (one rule per bit:
/// `seccompiler` has no "masked not-equal").
fn any_bit(arg: u8, mask: u32) -> Result<Vec<SeccompRule>, BackendError> {
    (0..32)
        .map(|i| 1u32 << i)
        .filter(|b| mask & b != 0)
        .map(|b| SeccompRule::new(vec![bit_set(arg, b)?]))
        .collect()
}

/// The rules of the filter returning `EPERM`: the `EPERM` denials, `clone`/`unshare` with a
/// namespace flag, the terminal-injecting `ioctl`s, and, with `setid_guard`, the set-id
/// modes.
fn eperm_rules(setid_guard: bool) -> Result<BTreeMap<i64, Vec<SeccompRule>>, BackendError> {
    let mut rules = BTreeMap::new();
    for d in denied().iter().chain(arch_denied()) {
        if d.errno == libc::EPERM {
            rules.insert(d.nr, Vec::new());
        }
    }
    // clone(flags, ...) and unshare(flags): no new namespaces (a new user namespace would
    // regain capabilities).
    rules.insert(libc::SYS_clone, any_bit(0, NS_FLAGS)?);
    rules.insert(libc::SYS_unshare, any_bit(0, NS_FLAGS)?);
    // ioctl(fd, TIOCSTI / TIOCLINUX): typing into a terminal outside.
    rules.insert(
        libc::SYS_ioctl,
        vec![
            SeccompRule::new(vec![equals(1, libc::TIOCSTI as u32)?])?,
            SeccompRule::new(vec![equals(1, libc::TIOCLINUX as u32)?])?,
        ],
    );
    if setid_guard {
        for (nr, arg) in mode_setters() {
            let mut chain = Vec::new();
            for bit in SETID_BITS {
                match arg {
                    ModeArg::Mode(n) => chain.push(SeccompRule::new(vec![bit_set(n, bit)?])?),
                    ModeArg::Create { flags, mode } => {
                        for flag in CREATE_FLAGS {
                            chain.push(SeccompRule::new(vec![
                                bit_set(flags, flag)?,
                                bit_set(mode, bit)?,
                            ])?);
                        }
                    }
                }
            }
            rules.insert(nr, chain);
        }
    }
    Ok(rules)
}

/// The rules of the filter returning `ENOSYS`: the `ENOSYS` denials and, with
/// `setid_guard`, `openat2` (its mode lives in memory seccomp cannot read).
fn enosys_rules(setid_guard: bool) -> BTreeMap<i64, Vec<SeccompRule>> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = denied()
        .iter()
        .chain(arch_denied())
        .filter(|d| d.errno == libc::ENOSYS)
        .map(|d| (d.nr, Vec::new()))
        .collect();
    if setid_guard {
        rules.insert(libc::SYS_openat2, Vec::new());
    }
    rules
}

/// One filter compiled by `seccompiler`: `errno` for what `rules` match, allow otherwise,
/// kill for a foreign architecture.
fn compile(rules: BTreeMap<i64, Vec<SeccompRule>>, errno: i32) -> Result<BpfProgram, BackendError> {
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(errno as u32),
        TARGET_ARCH,
    )?;
    BpfProgram::try_from(filter)
}

fn stmt(code: u16, k: u32) -> sock_filter {
    sock_filter {
        code,
        jt: 0,
        jf: 0,
        k,
    }
}

/// Appends `filters` to `out` as one program: each filter's "allow" becomes a jump to the
/// next filter, so the first filter that does not allow decides, and the last one's allow
/// stands. Each `seccompiler` filter begins with its own architecture check and loads, so
/// none depends on what the one before left in the accumulator.
fn chain(out: &mut BpfProgram, filters: Vec<BpfProgram>) {
    let count = filters.len();
    for (i, f) in filters.into_iter().enumerate() {
        let end = out.len() + f.len();
        for insn in f {
            let at = out.len();
            if i + 1 < count && insn.code == BPF_RET_K && insn.k == RET_ALLOW {
                // The next filter starts at `end`; a jump from `at` lands at `at + 1 + k`.
                out.push(stmt(BPF_JA, (end - at - 1) as u32));
            } else {
                out.push(insn);
            }
        }
    }
}

/// The filter program: see [`program_with`].
pub fn program() -> Result<BpfProgram, BackendError> {
    program_with(false)
}

/// The filter program: a foreign architecture is killed, the x32 range answers `ENOSYS`,
/// then the `EPERM` rules and the `ENOSYS` rules, each compiled by `seccompiler`, decide;
/// everything else is allowed.
///
/// With `setid_guard`, the **set-id guard** is added: setting the setuid or setgid bit is
/// refused with `EPERM` (`chmod`, `fchmod`, `fchmodat`, `fchmodat2`, `mknod`, `mknodat`, and
/// `open`, `openat`, `creat` that create a file with those bits), and `openat2`, whose mode
/// lives in memory seccomp cannot read, answers `ENOSYS` (callers fall back to `openat`).
/// For sandboxes whose writable workspace belongs to host root through its idmapped mount:
/// there, a set-id file would be a set-id-root program on the host (see "Identity" in
/// `docs/container.md`).
pub fn program_with(setid_guard: bool) -> Result<BpfProgram, BackendError> {
    let mut out: BpfProgram = Vec::new();
    // x32 syscalls share the arch value: refuse the whole x32 range, after the same
    // architecture check `seccompiler` puts at the head of each filter.
    #[cfg(target_arch = "x86_64")]
    out.extend([
        stmt(BPF_LD_W_ABS, OFF_ARCH),
        sock_filter {
            code: BPF_JEQ_K,
            jt: 1,
            jf: 0,
            k: AUDIT_ARCH,
        },
        stmt(BPF_RET_K, RET_KILL_PROCESS),
        stmt(BPF_LD_W_ABS, OFF_NR),
        sock_filter {
            code: BPF_JGE_K,
            jt: 0,
            jf: 1,
            k: X32_SYSCALL_BIT,
        },
        stmt(BPF_RET_K, RET_ERRNO | libc::ENOSYS as u32),
    ]);
    let eperm = compile(eperm_rules(setid_guard)?, libc::EPERM)?;
    let enosys = compile(enosys_rules(setid_guard), libc::ENOSYS)?;
    chain(&mut out, vec![eperm, enosys]);
    if out.len() > BPF_MAXINSNS {
        return Err(BackendError::FilterTooLarge(out.len()));
    }
    Ok(out)
}

/// The largest classic BPF program the kernel takes.
const BPF_MAXINSNS: usize = 4096;

/// The program as the bytes of a `struct sock_filter` array (native endian).
pub fn program_bytes() -> Vec<u8> {
    program_bytes_with(false)
}

/// [`program_with`] as the bytes of a `struct sock_filter` array (native endian). Empty if
/// the rules could not be compiled (they are constants: the tests compile both programs),
/// which the init refuses to install (`EINVAL`), so no sandbox starts without its filter.
pub fn program_bytes_with(setid_guard: bool) -> Vec<u8> {
    let Ok(program) = program_with(setid_guard) else {
        return Vec::new();
    };
    let mut out = Vec::with_capacity(program.len() * 8);
    for i in program {
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
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    const BPF_JGT_K: u16 = 0x25; // BPF_JMP | BPF_JGT | BPF_K
    const BPF_JSET_K: u16 = 0x45; // BPF_JMP | BPF_JSET | BPF_K
    const BPF_AND_K: u16 = 0x54; // BPF_ALU | BPF_AND | BPF_K

    fn errno(e: i32) -> u32 {
        RET_ERRNO | (e as u32 & 0xffff)
    }

    /// A tiny classic BPF interpreter for the instructions seccompiler and we emit.
    fn run(p: &[sock_filter], arch: u32, nr: u32, args: [u64; 6]) -> u32 {
        let mut data = [0u8; 64];
        data[0..4].copy_from_slice(&nr.to_le_bytes());
        data[4..8].copy_from_slice(&arch.to_le_bytes());
        for (i, a) in args.iter().enumerate() {
            data[16 + 8 * i..24 + 8 * i].copy_from_slice(&a.to_le_bytes());
        }
        let mut acc = 0u32;
        let mut pc = 0usize;
        loop {
            let i = &p[pc];
            let jump = |c: bool| 1 + usize::from(if c { i.jt } else { i.jf });
            pc += match i.code {
                BPF_LD_W_ABS => {
                    let o = i.k as usize;
                    acc = u32::from_le_bytes(data[o..o + 4].try_into().unwrap());
                    1
                }
                BPF_AND_K => {
                    acc &= i.k;
                    1
                }
                BPF_JA => 1 + i.k as usize,
                BPF_JEQ_K => jump(acc == i.k),
                BPF_JGE_K => jump(acc >= i.k),
                BPF_JGT_K => jump(acc > i.k),
                BPF_JSET_K => jump(acc & i.k != 0),
                BPF_RET_K => return i.k,
                c => panic!("unexpected opcode {c:#x}"),
            };
        }
    }

    /// The rules as `docs/container.md` states them, decided directly (the oracle the
    /// compiled programs are compared with).
    #[allow(clippy::unnecessary_cast)] // the libc types differ between targets
    fn rules(setid_guard: bool, arch: u32, nr: u32, args: [u64; 6]) -> u32 {
        if arch != AUDIT_ARCH {
            return RET_KILL_PROCESS;
        }
        #[cfg(target_arch = "x86_64")]
        if nr >= X32_SYSCALL_BIT {
            return errno(libc::ENOSYS);
        }
        let low = |i: usize| args[i] as u32;
        let nr = i64::from(nr);
        let eperm = errno(libc::EPERM);
        if nr == libc::SYS_clone || nr == libc::SYS_unshare {
            return if low(0) & NS_FLAGS != 0 {
                eperm
            } else {
                RET_ALLOW
            };
        }
        if nr == libc::SYS_ioctl {
            let req = low(1);
            let bad = req == libc::TIOCSTI as u32 || req == libc::TIOCLINUX as u32;
            return if bad { eperm } else { RET_ALLOW };
        }
        if setid_guard {
            let setid = |i: usize| low(i) & (libc::S_ISUID | libc::S_ISGID) != 0;
            let creates = |i: usize| low(i) & (libc::O_CREAT as u32 | 0o2000_0000) != 0;
            for (s, arg) in mode_setters() {
                if s == nr {
                    let refused = match arg {
                        ModeArg::Mode(n) => setid(n.into()),
                        ModeArg::Create { flags, mode } => {
                            creates(flags.into()) && setid(mode.into())
                        }
                    };
                    return if refused { eperm } else { RET_ALLOW };
                }
            }
            if nr == libc::SYS_openat2 {
                return errno(libc::ENOSYS);
            }
        }
        match denied().iter().chain(arch_denied()).find(|d| d.nr == nr) {
            Some(d) => errno(d.errno),
            None => RET_ALLOW,
        }
    }

    #[test]
    #[allow(clippy::unnecessary_cast)] // the libc types differ between targets
    fn random_calls_decide_as_the_rules_say() {
        let seed: u64 = std::env::var("SECCOMP_FUZZ_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0x5ecc_0e95);
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut listed: Vec<u32> = denied()
            .iter()
            .chain(arch_denied())
            .map(|d| d.nr as u32)
            .chain(mode_setters().into_iter().map(|(nr, _)| nr as u32))
            .collect();
        listed.extend(
            [
                libc::SYS_clone,
                libc::SYS_unshare,
                libc::SYS_ioctl,
                libc::SYS_openat2,
                libc::SYS_read,
                libc::SYS_write,
                libc::SYS_execve,
            ]
            .map(|n| n as u32),
        );
        // Argument values that reach every branch: the bits the rules look at, alone and
        // mixed with noise, and the same in the upper half (which must not matter).
        let bits: Vec<u64> = [NS_FLAGS, libc::S_ISUID | libc::S_ISGID]
            .iter()
            .chain(&CREATE_FLAGS)
            .flat_map(|m| (0..32).map(|i| 1u32 << i).filter(move |b| m & b != 0))
            .map(u64::from)
            .chain([libc::TIOCSTI as u64, libc::TIOCLINUX as u64])
            .collect();
        let programs = [
            (false, program().unwrap()),
            (true, program_with(true).unwrap()),
        ];
        for round in 0..20_000u32 {
            let arch = if round % 50 == 0 {
                rng.u32(..)
            } else {
                AUDIT_ARCH
            };
            let nr = match rng.u32(..8) {
                0 => rng.u32(..),
                1 => rng.u32(..512),
                2 => 0x4000_0000 | rng.u32(..512),
                _ => listed[rng.usize(..listed.len())],
            };
            let mut args = [0u64; 6];
            for a in &mut args {
                *a = match rng.u32(..4) {
                    0 => 0,
                    1 => rng.u64(..),
                    2 => bits[rng.usize(..bits.len())],
                    _ => bits[rng.usize(..bits.len())] << 32,
                };
            }
            for (guard, p) in &programs {
                assert_eq!(
                    run(p, arch, nr, args),
                    rules(*guard, arch, nr, args),
                    "seed {seed} round {round}: guard {guard} arch {arch:#x} nr {nr} {args:x?}"
                );
            }
        }
    }

    #[test]
    #[allow(clippy::unnecessary_cast)] // the libc types differ between targets
    fn filter_decisions() {
        let p = program().unwrap();
        assert!(p.len() <= BPF_MAXINSNS, "{}", p.len());
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
        let newns = [libc::CLONE_NEWNS as u64, 0, 0, 0, 0, 0];
        assert_eq!(
            run(&p, a, libc::SYS_unshare as u32, newns),
            errno(libc::EPERM)
        );
        let files = [libc::CLONE_FILES as u64, 0, 0, 0, 0, 0];
        assert_eq!(run(&p, a, libc::SYS_unshare as u32, files), RET_ALLOW);
        let sti = [1, libc::TIOCSTI as u64, 0, 0, 0, 0];
        assert_eq!(run(&p, a, libc::SYS_ioctl as u32, sti), errno(libc::EPERM));
        let winsz = [1, libc::TIOCGWINSZ as u64, 0, 0, 0, 0];
        assert_eq!(run(&p, a, libc::SYS_ioctl as u32, winsz), RET_ALLOW);
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
        let p = program_with(true).unwrap();
        assert!(p.len() <= BPF_MAXINSNS, "{}", p.len());
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
            let cases: Vec<(i64, [u64; 6], u32)> = vec![
                (libc::SYS_chmod, [0, 0o4755, 0, 0, 0, 0], eperm),
                (libc::SYS_creat, [0, 0o2755, 0, 0, 0, 0], eperm),
                (libc::SYS_open, [0, creat, 0o4755, 0, 0, 0], eperm),
                (libc::SYS_open, [0, creat, 0o755, 0, 0, 0], RET_ALLOW),
            ];
            for (nr, args, want) in cases {
                assert_eq!(run(&p, a, nr as u32, args), want, "{nr} {args:?}");
            }
        }
        // Everything else decides as without the guard.
        let plain = program().unwrap();
        for d in denied().iter().chain(arch_denied()) {
            assert_eq!(
                run(&p, a, d.nr as u32, [0; 6]),
                run(&plain, a, d.nr as u32, [0; 6])
            );
        }
        assert_eq!(program_bytes_with(true).len(), p.len() * 8);
    }

    /// The kernel takes both programs and decides as the rules say: each is installed in a
    /// forked child (which makes only raw syscalls before `_exit`) and probed.
    #[test]
    fn the_kernel_installs_both_programs_and_refuses_what_they_refuse() {
        if !available() {
            return;
        }
        for guard in [false, true] {
            let p = program_with(guard).unwrap();
            let fprog = libc::sock_fprog {
                len: p.len() as u16,
                filter: p.as_ptr() as *mut libc::sock_filter,
            };
            // SAFETY: the child makes only async-signal-safe raw syscalls and `_exit`s; the
            // program (`p`, `fprog`) is live memory copied into the child.
            let pid = unsafe { libc::fork() };
            assert!(pid >= 0);
            if pid == 0 {
                // SAFETY: raw syscalls with plain integer arguments and a pointer to the
                // live `fprog`; the child only exits afterwards.
                let code = unsafe { probe(&fprog, guard) };
                // SAFETY: ends the forked child without running the parent's destructors.
                unsafe { libc::_exit(code) };
            }
            let mut status = 0;
            // SAFETY: waits for the child forked above.
            assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
            assert!(libc::WIFEXITED(status), "guard {guard}: status {status:#x}");
            assert_eq!(libc::WEXITSTATUS(status), 0, "guard {guard}: failed probe");
        }
    }

    /// Installs `fprog` and probes it; the failed probe's number, or 0.
    ///
    /// # Safety
    /// Only for a forked child: the filter stays on the calling thread.
    unsafe fn probe(fprog: &libc::sock_fprog, guard: bool) -> i32 {
        let errno = || std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
        // SAFETY: prctl and seccomp with valid arguments (the caller's contract).
        unsafe {
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
                return 90;
            }
            if libc::syscall(libc::SYS_seccomp, 1, 0, fprog as *const libc::sock_fprog) != 0 {
                return 91;
            }
            let refused = |r: libc::c_long, e: i32| r == -1 && errno() == e;
            if !refused(libc::syscall(libc::SYS_bpf, 0, 0, 0), libc::EPERM) {
                return 1;
            }
            if !refused(libc::syscall(libc::SYS_io_uring_setup, 1, 0), libc::ENOSYS) {
                return 2;
            }
            let newuser = libc::CLONE_NEWUSER as libc::c_long;
            if !refused(libc::syscall(libc::SYS_unshare, newuser), libc::EPERM) {
                return 3;
            }
            if libc::syscall(libc::SYS_getpid) <= 0 {
                return 4;
            }
            #[cfg(target_arch = "x86_64")]
            if !refused(libc::syscall(0x4000_0000 | libc::SYS_getpid), libc::ENOSYS) {
                return 5;
            }
            // fchmod of an invalid fd: EBADF when allowed, EPERM when the guard refuses.
            let want = if guard { libc::EPERM } else { libc::EBADF };
            if !refused(libc::syscall(libc::SYS_fchmod, -1, 0o4755), want) {
                return 6;
            }
            if !refused(libc::syscall(libc::SYS_fchmod, -1, 0o755), libc::EBADF) {
                return 7;
            }
        }
        0
    }
}

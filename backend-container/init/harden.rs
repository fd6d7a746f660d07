//! Hardening: the sandbox's seal, which every exec inherits (an empty capability bounding
//! set, `no_new_privs`, Landlock, seccomp), and the privilege drop in each command's child
//! (capabilities, the sandbox user).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use crate::proto::*;
use crate::sys::*;

/// `prctl(PR_SET_NO_NEW_PRIVS)`: no exec may gain privileges (set-id bits, file
/// capabilities); required before an unprivileged Landlock or seccomp restriction.
fn no_new_privs() -> io::Result<()> {
    // SAFETY: prctl with integer arguments.
    check(unsafe { prctl(PR_SET_NO_NEW_PRIVS, 1u64, 0u64, 0u64, 0u64) })
}

#[repr(C)]
struct LlRulesetAttr {
    handled_access_fs: u64,
}

#[repr(C, packed)]
struct LlPathBeneath {
    allowed_access: u64,
    parent_fd: i32,
}

/// Restricts this process (and so every exec) to writing beneath the rules' paths.
pub(crate) fn landlock(handled: u64, rules: &[(String, u64)]) -> io::Result<()> {
    let attr = LlRulesetAttr {
        handled_access_fs: handled,
    };
    // SAFETY: landlock_create_ruleset with a valid attr of the stated size.
    let rs = unsafe {
        syscall(
            NR_LANDLOCK_CREATE_RULESET,
            &attr as *const LlRulesetAttr,
            8usize,
            0u32,
        )
    };
    if rs < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel returned a new fd that we now own.
    let rs = unsafe { OwnedFd::from_raw_fd(rs as RawFd) };
    for (path, rights) in rules {
        let c = cstr(path)?;
        // SAFETY: open(2) O_PATH of a NUL-terminated path.
        let fd = unsafe { libc_open(c.as_ptr(), O_PATH | O_CLOEXEC | O_NOFOLLOW) };
        if fd < 0 {
            if errno() == 2 {
                continue;
            }
            return Err(io::Error::last_os_error());
        }
        // SAFETY: we own the new fd.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let rule = LlPathBeneath {
            allowed_access: rights & handled,
            parent_fd: fd.as_raw_fd(),
        };
        // SAFETY: landlock_add_rule(PATH_BENEATH) with a valid packed attr.
        if unsafe {
            syscall(
                NR_LANDLOCK_ADD_RULE,
                rs.as_raw_fd(),
                1u32,
                &rule as *const LlPathBeneath,
                0u32,
            )
        } < 0
        {
            return Err(io::Error::last_os_error());
        }
    }
    no_new_privs()?;
    // SAFETY: landlock_restrict_self(ruleset_fd, 0).
    check(unsafe { syscall(NR_LANDLOCK_RESTRICT_SELF, rs.as_raw_fd(), 0u32) } as c_int)
}

/// Installs the seccomp filter on this process (inherited by every exec).
pub(crate) fn seccomp(bpf: &[u8]) -> io::Result<()> {
    let prog = bpf_program(bpf)?;
    let fprog = SockFprog {
        len: prog.len() as u16,
        filter: prog.as_ptr(),
    };
    no_new_privs()?;
    // SAFETY: seccomp(SET_MODE_FILTER, 0, &fprog) with a program that outlives the call.
    check(unsafe {
        syscall(
            nr::SECCOMP,
            SECCOMP_SET_MODE_FILTER,
            0u32,
            &fprog as *const SockFprog,
        )
    } as c_int)
}

/// The largest classic BPF program the kernel takes (`BPF_MAXINSNS`).
const BPF_MAXINSNS: usize = 4096;

/// A seccomp filter's `struct sock_filter` array, as the library sent it (8 bytes per
/// instruction, native endian), in 8-byte-aligned memory: `EINVAL` unless it holds 1 to
/// [`BPF_MAXINSNS`] whole instructions.
fn bpf_program(bpf: &[u8]) -> io::Result<Vec<u64>> {
    if !bpf.len().is_multiple_of(8) || bpf.is_empty() || bpf.len() / 8 > BPF_MAXINSNS {
        return Err(io::Error::from_raw_os_error(22));
    }
    Ok(bpf
        .chunks_exact(8)
        .map(|c| {
            let mut a = [0u8; 8];
            a.copy_from_slice(c);
            u64::from_ne_bytes(a)
        })
        .collect())
}

/// Empties the bounding set (the init keeps its own capabilities; what it starts cannot
/// regain any through `execve`).
pub(crate) fn drop_bounding_set() -> io::Result<()> {
    for cap in 0..64u64 {
        // SAFETY: prctl with integer arguments.
        if unsafe { prctl(PR_CAPBSET_DROP, cap, 0u64, 0u64, 0u64) } < 0 {
            // EINVAL: past the kernel's last capability, so all are gone.
            return match errno() {
                22 if cap > 0 => Ok(()),
                _ => Err(io::Error::last_os_error()),
            };
        }
    }
    Ok(())
}

/// Drops every capability and privilege in the command's child, between clone and exec
/// (the bounding set is already empty: see [`drop_bounding_set`]). Makes system calls only:
/// no allocation (the child shares the supervisor's memory).
pub(crate) fn drop_privileges(spec_flags: u32, uid: u32, gid: u32) -> io::Result<()> {
    // SAFETY: prctl/setgroups/setres*id/capset with integer arguments and valid structs.
    unsafe {
        let stay_root = spec_flags & EXEC_STAY_ROOT != 0;
        if stay_root {
            // uid 0 must not regain capabilities on exec.
            check(prctl(
                PR_SET_SECUREBITS,
                SECBITS_LOCKED_NOROOT as u64,
                0u64,
                0u64,
                0u64,
            ))?;
        }
        prctl(
            PR_CAP_AMBIENT,
            PR_CAP_AMBIENT_CLEAR_ALL as u64,
            0u64,
            0u64,
            0u64,
        );
        if !stay_root {
            check(setgroups(0, std::ptr::null()))?;
            check(setresgid(gid, gid, gid))?;
            check(setresuid(uid, uid, uid))?;
        }
        let hdr = CapHeader {
            version: 0x2008_0522,
            pid: 0,
        };
        let data = [
            CapData {
                effective: 0,
                permitted: 0,
                inheritable: 0,
            },
            CapData {
                effective: 0,
                permitted: 0,
                inheritable: 0,
            },
        ];
        check(syscall(nr::CAPSET, &hdr as *const CapHeader, data.as_ptr()) as c_int)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::TempDir;
    use std::ffi::CString;
    use std::fs;
    use std::path::PathBuf;
    use std::process::Command;

    #[test]
    fn seccomp_programs_are_whole_instructions_within_the_kernels_limit() {
        let insn = 0x0102_0304_0506_0708u64.to_ne_bytes();
        assert_eq!(bpf_program(&insn).unwrap(), [0x0102_0304_0506_0708u64]);
        let full = insn.repeat(BPF_MAXINSNS);
        assert_eq!(bpf_program(&full).unwrap().len(), BPF_MAXINSNS);
        for bad in [
            Vec::new(),
            insn[..7].to_vec(),
            insn.repeat(2)[..9].to_vec(),
            insn.repeat(BPF_MAXINSNS + 1),
        ] {
            let e = bpf_program(&bad).unwrap_err();
            assert_eq!(e.raw_os_error(), Some(22), "{} bytes", bad.len());
        }
    }

    // Landlock, as the library asks for it on each ABI (see backend-container's
    // `src/landlock.rs`): every write-side filesystem right.
    const LL_WRITE_FILE: u64 = 1 << 1;
    const LL_ABI1_WRITES: u64 = LL_WRITE_FILE | 0x1ff0; // remove dir/file, make *
    const LL_REFER: u64 = 1 << 13;
    const LL_TRUNCATE: u64 = 1 << 14;

    /// The running kernel's Landlock ABI, if any.
    fn landlock_abi() -> Option<i64> {
        // SAFETY: landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION) only
        // returns a number.
        let v = unsafe {
            syscall(
                NR_LANDLOCK_CREATE_RULESET,
                std::ptr::null::<u8>(),
                0usize,
                1u32,
            )
        };
        (v > 0).then_some(v)
    }

    fn landlock_write_rights(abi: i64) -> u64 {
        let mut r = LL_ABI1_WRITES;
        if abi >= 2 {
            r |= LL_REFER;
        }
        if abi >= 3 {
            r |= LL_TRUNCATE;
        }
        r
    }

    const LANDLOCK_DIR: &str = "CONTAINER_INIT_LANDLOCK_TEST_DIR";

    #[test]
    fn landlock_refuses_bad_rules_before_restricting() {
        if landlock_abi().is_none() {
            eprintln!("Landlock is unavailable: skipped");
            return;
        }
        let rules = [("a\0b".to_string(), LL_WRITE_FILE)];
        let e = landlock(LL_WRITE_FILE, &rules).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(22));
        // Still unrestricted (this is the test process itself).
        let dir = TempDir::new("unrestricted");
        fs::write(dir.join("f"), "x").unwrap();
    }

    /// The init's `landlock` installs a domain that confines writes to the rules' paths
    /// (checked in a child process: a domain cannot be left).
    #[test]
    fn landlock_confines_writes_to_the_rules() {
        let Some(abi) = landlock_abi() else {
            eprintln!("Landlock is unavailable: skipped");
            return;
        };
        let dir = TempDir::new("landlock");
        fs::create_dir(dir.join("allowed")).unwrap();
        fs::create_dir(dir.join("denied")).unwrap();
        fs::write(dir.join("denied/existing"), "old").unwrap();
        fs::write(dir.join("file"), "old").unwrap();
        let out = Command::new(std::env::current_exe().unwrap())
            .args(["harden::tests::landlock_child", "--exact", "--ignored"])
            .args(["--nocapture", "--test-threads=1"])
            .env(LANDLOCK_DIR, &dir.0)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && stdout.contains("landlock child: confined (ABI "),
            "ABI {abi}: {stdout}\n{stderr}"
        );
        assert_eq!(
            fs::read_to_string(dir.join("denied/existing")).unwrap(),
            "old"
        );
        assert_eq!(fs::read_to_string(dir.join("file")).unwrap(), "new");
        assert!(!dir.join("denied/new").exists());
    }

    #[test]
    #[ignore = "run in a child process by landlock_confines_writes_to_the_rules"]
    fn landlock_child() {
        extern "C" {
            fn truncate(path: *const c_char, len: i64) -> c_int;
        }
        let Some(dir) = std::env::var_os(LANDLOCK_DIR).map(PathBuf::from) else {
            return;
        };
        let abi = landlock_abi().expect("Landlock went away");
        let all = landlock_write_rights(abi);
        let at = |p: &str| dir.join(p).to_str().unwrap().to_string();
        landlock(
            all,
            &[
                (at("allowed"), all),
                (at("file"), all & (LL_WRITE_FILE | LL_TRUNCATE)),
                // Missing paths are skipped.
                (at("missing"), all),
            ],
        )
        .unwrap();
        let denied = |what: &str, r: io::Result<()>| match r {
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {}
            other => panic!("{what}: {other:?}"),
        };
        // Beneath a directory rule: every write.
        fs::write(dir.join("allowed/new"), "new").unwrap();
        fs::create_dir(dir.join("allowed/sub")).unwrap();
        std::os::unix::fs::symlink("new", dir.join("allowed/link")).unwrap();
        fs::rename(dir.join("allowed/new"), dir.join("allowed/sub/new")).unwrap();
        fs::remove_file(dir.join("allowed/link")).unwrap();
        fs::remove_file(dir.join("allowed/sub/new")).unwrap();
        fs::remove_dir(dir.join("allowed/sub")).unwrap();
        // A file rule: that file, written and truncated (`O_TRUNC`).
        fs::write(dir.join("file"), "new").unwrap();
        // Anywhere else: no write of any kind.
        denied("create", fs::write(dir.join("denied/new"), "x"));
        denied("mkdir", fs::create_dir(dir.join("denied/sub")));
        denied(
            "open for writing",
            fs::OpenOptions::new()
                .append(true)
                .open(dir.join("denied/existing"))
                .map(drop),
        );
        denied("unlink", fs::remove_file(dir.join("denied/existing")));
        denied(
            "symlink",
            std::os::unix::fs::symlink("x", dir.join("denied/link")),
        );
        denied(
            "create beside a file rule",
            fs::write(dir.join("file2"), "x"),
        );
        if abi >= 3 {
            let p = CString::new(at("denied/existing")).unwrap();
            // SAFETY: truncate(2) of a NUL-terminated path.
            let r = unsafe { truncate(p.as_ptr(), 0) };
            denied("truncate", check(r));
        }
        // Reads are not handled.
        assert_eq!(
            fs::read_to_string(dir.join("denied/existing")).unwrap(),
            "old"
        );
        println!("landlock child: confined (ABI {abi})");
    }
}

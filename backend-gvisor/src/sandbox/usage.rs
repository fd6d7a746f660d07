//! What a sandbox uses ([`Sandbox::usage`](sandbox_core::Sandbox::usage)), from the cgroup of
//! its sandbox process: runsc puts the Sentry (where every guest thread runs) and the Gofer
//! there, so the cgroup's CPU time and memory are the sandbox's, guest kernel included.

use std::path::Path;

/// The sandbox process's cgroup, as found in `/proc/PID/cgroup`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum UsageCgroup {
    /// cgroup v1: its paths in the `cpuacct` and `memory` hierarchies.
    V1 { cpuacct: String, memory: String },
    /// cgroup v2: its path in the unified hierarchy.
    V2(String),
}

impl UsageCgroup {
    /// From the text of `/proc/PID/cgroup`: v1 when both controllers have hierarchies,
    /// else the unified one (`0::/path`); only cgroups of the sandbox's own (named `name`):
    /// a process left in its creator's cgroup would count the creator's use as its own.
    pub(crate) fn parse(text: &str, name: &str) -> Option<UsageCgroup> {
        let own = |p: &str| p.rsplit('/').next() == Some(name);
        let mut cpuacct = None;
        let mut memory = None;
        let mut unified = None;
        for l in text.lines() {
            let mut parts = l.splitn(3, ':');
            let (id, ctrls, path) = (parts.next()?, parts.next()?, parts.next()?);
            if id == "0" && ctrls.is_empty() {
                unified = Some(path.to_string());
            }
            for c in ctrls.split(',') {
                match c {
                    "cpuacct" => cpuacct = Some(path.to_string()),
                    "memory" => memory = Some(path.to_string()),
                    _ => {}
                }
            }
        }
        match (cpuacct, memory) {
            (Some(cpuacct), Some(memory)) if own(&cpuacct) && own(&memory) => {
                Some(UsageCgroup::V1 { cpuacct, memory })
            }
            (Some(_), Some(_)) => None,
            _ => unified.filter(|u| own(u)).map(UsageCgroup::V2),
        }
    }

    /// The sandbox process `pid`'s, if it is in the sandbox's own cgroup `name`.
    pub(crate) fn of(pid: i32, name: &str) -> Option<UsageCgroup> {
        UsageCgroup::parse(
            &std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?,
            name,
        )
    }

    /// CPU time so far and memory held now, from the cgroup's files.
    pub(crate) fn read(&self) -> Option<sandbox_core::Usage> {
        self.read_under(Path::new("/sys/fs/cgroup"))
    }

    fn read_under(&self, root: &Path) -> Option<sandbox_core::Usage> {
        let file = |ctrl: &str, rel: &str, name: &str| {
            std::fs::read_to_string(root.join(ctrl).join(rel.trim_start_matches('/')).join(name))
                .ok()
        };
        let (cpu_us, mem) = match self {
            UsageCgroup::V1 { cpuacct, memory } => {
                let ns: u64 = file("cpuacct", cpuacct, "cpuacct.usage")?
                    .trim()
                    .parse()
                    .ok()?;
                let mem = file("memory", memory, "memory.usage_in_bytes")?
                    .trim()
                    .parse()
                    .ok()?;
                (ns / 1000, mem)
            }
            UsageCgroup::V2(path) => {
                let stat = file("", path, "cpu.stat")?;
                let us = stat
                    .lines()
                    .find_map(|l| l.strip_prefix("usage_usec "))?
                    .trim()
                    .parse()
                    .ok()?;
                let mem = file("", path, "memory.current")?.trim().parse().ok()?;
                (us, mem)
            }
        };
        Some(sandbox_core::Usage::new(
            std::time::Duration::from_micros(cpu_us),
            mem,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v1_and_v2_cgroups_are_found_and_read() {
        let v1 = "12:memory:/agent-sandbox-gvisor-x\n4:cpu,cpuacct:/agent-sandbox-gvisor-x\n\
                  1:name=systemd:/init.scope\n0::/init.scope\n";
        let x = "agent-sandbox-gvisor-x";
        let cg = UsageCgroup::parse(v1, x).unwrap();
        assert_eq!(
            cg,
            UsageCgroup::V1 {
                cpuacct: "/agent-sandbox-gvisor-x".into(),
                memory: "/agent-sandbox-gvisor-x".into()
            }
        );
        let root = tempfile::tempdir().unwrap();
        for (d, f, v) in [
            ("cpuacct", "cpuacct.usage", "2500000\n"),
            ("memory", "memory.usage_in_bytes", "4096\n"),
        ] {
            let dir = root.path().join(d).join("agent-sandbox-gvisor-x");
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join(f), v).unwrap();
        }
        let u = cg.read_under(root.path()).unwrap();
        assert_eq!((u.cpu_time_us, u.memory_bytes), (2500, 4096));

        let v2 = UsageCgroup::parse("0::/a/b\n", "b").unwrap();
        assert_eq!(v2, UsageCgroup::V2("/a/b".into()));
        // Not the sandbox's own cgroup (its creator's): nothing to count.
        assert!(UsageCgroup::parse(v1, "agent-sandbox-gvisor-y").is_none());
        assert!(UsageCgroup::parse("0::/a/b\n", "c").is_none());
        let dir = root.path().join("a/b");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("cpu.stat"), "usage_usec 77\nuser_usec 1\n").unwrap();
        std::fs::write(dir.join("memory.current"), "8192\n").unwrap();
        let u = v2.read_under(root.path()).unwrap();
        assert_eq!((u.cpu_time_us, u.memory_bytes), (77, 8192));
        assert!(UsageCgroup::parse("garbage", x).is_none());
    }
}

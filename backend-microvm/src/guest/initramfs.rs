//! The guest's initramfs: a cpio "newc" archive (the format the kernel unpacks into its
//! rootfs) holding the guest agent as `/init`, busybox with its applet links in `/bin`, the
//! kernel modules the agent needs (virtio transport and console) with a `modules.dep`, the
//! optional modules for an image root ([`ROOT_MODULES`], listed in [`ROOT_MODULES_DEP`] and
//! loaded only when the kernel command line asks for one), and a minimal `/etc`.
//!
//! [`CpioWriter`] writes the archive, [`read_cpio`] reads one back (tests, and checking a
//! cached or user-given initramfs), [`module_info`] reads a kernel module's `.modinfo`
//! (name and dependencies) so the modules and their dependency order come from the modules
//! themselves (Debian's package ships no `modules.dep`; depmod makes it at install time).
//!
//! (The cpio code is hand-written: the kernel reads only "newc", and a writer plus reader
//! of it is ~150 lines with no dependency; `archive_fuzz.rs` fuzzes both.)

use std::collections::{BTreeMap, BTreeSet};

use super::GuestError;

/// Modules the agent needs in the guest (their dependencies are added): the virtio-mmio
/// transport (devices described by ACPI) and virtio-console (`/dev/hvc0`, the agent channel).
pub const GUEST_MODULES: &[&str] = &["virtio_mmio", "virtio_console"];

/// Modules the agent loads only when the kernel command line asks for an image root
/// (`agent.root=/dev/vda`): the virtio block driver, ext4 (the read-only image) and overlayfs
/// (its writable layer). They are listed with all of their dependencies (no extra pass over
/// the kernel package is needed), plus `crc32c_generic`, which ext4 and jbd2 ask the crypto
/// layer for (a soft dependency) when a filesystem has metadata checksums.
pub const ROOT_MODULES: &[&str] = &[
    "virtio_blk",
    "crc16",
    "mbcache",
    "jbd2",
    "crc32c_generic",
    "ext4",
    "overlay",
];

/// Modules the agent loads only when the kernel command line configures a network
/// (`agent.net=`): the virtio network driver and its dependencies (listed here, so no extra
/// pass over the kernel package is needed).
pub const NET_MODULES: &[&str] = &["failover", "net_failover", "virtio_net"];

/// The `modules.dep`-format list of the network modules, in [`MODULES_DIR`]; written as
/// [`ROOT_MODULES_DEP`] is.
pub const NET_MODULES_DEP: &str = "net-modules.dep";

/// The `modules.dep`-format list of the image-root modules, in [`MODULES_DIR`]. Always written
/// (empty when the kernel has them built in); an initramfs without it predates image roots,
/// and the agent refuses an image root with a clear error instead of trying.
pub const ROOT_MODULES_DEP: &str = "root-modules.dep";

/// Where modules live in the initramfs; `modules.dep` paths are relative to it.
pub const MODULES_DIR: &str = "lib/modules";

/// Busybox applets linked in `/bin` when the list cannot be asked from the binary.
const FALLBACK_APPLETS: &[&str] = &[
    "sh",
    "ash",
    "cat",
    "cp",
    "mv",
    "rm",
    "ln",
    "ls",
    "mkdir",
    "rmdir",
    "touch",
    "chmod",
    "echo",
    "printf",
    "env",
    "true",
    "false",
    "test",
    "[",
    "sleep",
    "pwd",
    "head",
    "tail",
    "wc",
    "sort",
    "uniq",
    "cut",
    "tr",
    "grep",
    "sed",
    "awk",
    "find",
    "xargs",
    "tar",
    "gzip",
    "gunzip",
    "ps",
    "kill",
    "mount",
    "umount",
    "dmesg",
    "uname",
    "id",
    "date",
    "stat",
    "du",
    "df",
    "which",
    "basename",
    "dirname",
    "readlink",
    "realpath",
    "seq",
    "yes",
    "tee",
    "md5sum",
    "sha256sum",
    "od",
    "hexdump",
    "diff",
    "expr",
    "hostname",
    "free",
    "top",
    "vi",
    "timeout",
];

const S_IFDIR: u32 = 0o040000;
const S_IFREG: u32 = 0o100000;
const S_IFLNK: u32 = 0o120000;
const S_IFCHR: u32 = 0o020000;
const S_IFMT: u32 = 0o170000;
const TRAILER: &str = "TRAILER!!!";

/// Writes a cpio "newc" archive in memory. Parent directories are added automatically.
#[derive(Debug, Default)]
pub struct CpioWriter {
    buf: Vec<u8>,
    ino: u32,
    names: BTreeSet<String>,
}

fn pad4(buf: &mut Vec<u8>) {
    while !buf.len().is_multiple_of(4) {
        buf.push(0);
    }
}

/// Normalises an archive path: no leading `/` or `./`, no empty, `.` or `..` components.
/// Refused: a NUL (the kernel would cut the name there) and the trailer's name as the first
/// component (the archive would end at it, or at its parent directory's entry).
fn clean(path: &str) -> Result<String, GuestError> {
    if path.contains('\0') {
        return Err(GuestError::BadInitramfs(format!("NUL in path {path:?}")));
    }
    let mut parts = Vec::new();
    for c in path.split('/') {
        match c {
            "" | "." => {}
            ".." => return Err(GuestError::BadInitramfs(format!("`..` in path {path}"))),
            c => parts.push(c),
        }
    }
    if parts.is_empty() {
        return Err(GuestError::BadInitramfs(format!("empty path {path:?}")));
    }
    if parts[0] == TRAILER {
        return Err(GuestError::BadInitramfs(format!("reserved path {path:?}")));
    }
    Ok(parts.join("/"))
}

impl CpioWriter {
    /// An empty archive.
    pub fn new() -> Self {
        Self::default()
    }

    fn entry(
        &mut self,
        name: &str,
        mode: u32,
        data: &[u8],
        rdev: (u32, u32),
    ) -> Result<(), GuestError> {
        let size = u32::try_from(data.len())
            .map_err(|_| GuestError::BadInitramfs(format!("{name}: over 4 GiB")))?;
        let namesize = u32::try_from(name.len() + 1)
            .map_err(|_| GuestError::BadInitramfs("name too long".into()))?;
        self.ino = self.ino.wrapping_add(1);
        let nlink = if mode & S_IFMT == S_IFDIR { 2 } else { 1 };
        let fields = [
            self.ino, mode, 0, 0, nlink, 0, size, 0, 0, rdev.0, rdev.1, namesize, 0,
        ];
        self.buf.extend_from_slice(b"070701");
        for f in fields {
            self.buf.extend_from_slice(format!("{f:08x}").as_bytes());
        }
        self.buf.extend_from_slice(name.as_bytes());
        self.buf.push(0);
        pad4(&mut self.buf);
        self.buf.extend_from_slice(data);
        pad4(&mut self.buf);
        Ok(())
    }

    fn parents(&mut self, name: &str) -> Result<(), GuestError> {
        let mut at = 0;
        while let Some(i) = name[at..].find('/') {
            let dir = &name[..at + i];
            if self.names.insert(dir.to_string()) {
                self.entry(dir, S_IFDIR | 0o755, &[], (0, 0))?;
            }
            at += i + 1;
        }
        Ok(())
    }

    fn add(
        &mut self,
        path: &str,
        mode: u32,
        data: &[u8],
        rdev: (u32, u32),
    ) -> Result<(), GuestError> {
        let name = clean(path)?;
        self.parents(&name)?;
        if !self.names.insert(name.clone()) {
            if mode & S_IFMT == S_IFDIR {
                return Ok(());
            }
            return Err(GuestError::BadInitramfs(format!("{name} added twice")));
        }
        self.entry(&name, mode, data, rdev)
    }

    /// Adds a directory.
    pub fn dir(&mut self, path: &str, perm: u32) -> Result<(), GuestError> {
        self.add(path, S_IFDIR | (perm & 0o7777), &[], (0, 0))
    }

    /// Adds a regular file.
    pub fn file(&mut self, path: &str, perm: u32, data: &[u8]) -> Result<(), GuestError> {
        self.add(path, S_IFREG | (perm & 0o7777), data, (0, 0))
    }

    /// Adds a symbolic link to `target`.
    pub fn symlink(&mut self, path: &str, target: &str) -> Result<(), GuestError> {
        self.add(path, S_IFLNK | 0o777, target.as_bytes(), (0, 0))
    }

    /// Adds a character device node.
    pub fn char_dev(
        &mut self,
        path: &str,
        perm: u32,
        major: u32,
        minor: u32,
    ) -> Result<(), GuestError> {
        self.add(path, S_IFCHR | (perm & 0o7777), &[], (major, minor))
    }

    /// Appends the trailer and returns the archive.
    pub fn finish(mut self) -> Vec<u8> {
        // The trailer's fields are all zero but nlink 1; it cannot fail.
        let _ = self.entry(TRAILER, 0, &[], (0, 0));
        self.buf
    }
}

/// One entry read back from a cpio archive.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CpioEntry {
    /// Path (as stored: no leading `/`).
    pub name: String,
    /// `st_mode` (type and permission bits).
    pub mode: u32,
    /// Content (the target for a symlink).
    pub data: Vec<u8>,
    /// Device number (major, minor) for device nodes.
    pub rdev: (u32, u32),
}

impl CpioEntry {
    /// Whether this is a regular file.
    pub fn is_file(&self) -> bool {
        self.mode & S_IFMT == S_IFREG
    }
    /// Whether this is a directory.
    pub fn is_dir(&self) -> bool {
        self.mode & S_IFMT == S_IFDIR
    }
    /// Whether this is a symbolic link.
    pub fn is_symlink(&self) -> bool {
        self.mode & S_IFMT == S_IFLNK
    }
    /// Whether this is a character device.
    pub fn is_char_dev(&self) -> bool {
        self.mode & S_IFMT == S_IFCHR
    }
}

/// Reads a (single, uncompressed) cpio "newc" archive up to its trailer.
pub fn read_cpio(data: &[u8]) -> Result<Vec<CpioEntry>, GuestError> {
    let bad = |at: usize, m: &str| GuestError::BadInitramfs(format!("at byte {at}: {m}"));
    let mut out = Vec::new();
    let mut at = 0usize;
    loop {
        let hdr = data
            .get(at..at + 110)
            .ok_or_else(|| bad(at, "truncated header"))?;
        if &hdr[..6] != b"070701" && &hdr[..6] != b"070702" {
            return Err(bad(at, "not a cpio newc header"));
        }
        let mut f = [0u32; 13];
        for (i, v) in f.iter_mut().enumerate() {
            let s = std::str::from_utf8(&hdr[6 + i * 8..14 + i * 8])
                .map_err(|_| bad(at, "non-hex header field"))?;
            *v = u32::from_str_radix(s, 16).map_err(|_| bad(at, "non-hex header field"))?;
        }
        let (mode, size, namesize) = (f[1], f[6] as usize, f[11] as usize);
        let name_end = at + 110 + namesize;
        // The name with its NUL (a name cut before it is a truncated archive).
        let name = data
            .get(at + 110..name_end)
            .and_then(|n| n.strip_suffix(&[0]))
            .ok_or_else(|| bad(at, "truncated name"))?;
        let name = String::from_utf8(name.to_vec()).map_err(|_| bad(at, "non-UTF-8 name"))?;
        let data_start = name_end.next_multiple_of(4);
        let data_end = data_start
            .checked_add(size)
            .ok_or_else(|| bad(at, "size overflows"))?;
        if name == TRAILER {
            return Ok(out);
        }
        let body = data
            .get(data_start..data_end)
            .ok_or_else(|| bad(at, "truncated data"))?;
        out.push(CpioEntry {
            name,
            mode,
            data: body.to_vec(),
            rdev: (f[9], f[10]),
        });
        at = data_end.next_multiple_of(4);
    }
}

/// What a kernel module says about itself in its `.modinfo` section.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ModInfo {
    /// Module name (`name=`).
    pub name: String,
    /// Modules it needs loaded first (`depends=`).
    pub depends: Vec<String>,
}

/// Reads `name=` and `depends=` from a kernel module (an ELF64 relocatable object).
pub fn module_info(ko: &[u8]) -> Result<ModInfo, GuestError> {
    let bad = |m: &str| GuestError::BadInitramfs(format!("kernel module: {m}"));
    let u16_at = |at: usize| -> Option<u16> {
        Some(u16::from_le_bytes(ko.get(at..at + 2)?.try_into().ok()?))
    };
    let u32_at = |at: usize| -> Option<u32> {
        Some(u32::from_le_bytes(ko.get(at..at + 4)?.try_into().ok()?))
    };
    let u64_at = |at: usize| -> Option<usize> {
        usize::try_from(u64::from_le_bytes(ko.get(at..at + 8)?.try_into().ok()?)).ok()
    };
    if !ko.starts_with(b"\x7fELF") || ko.get(4) != Some(&2) || ko.get(5) != Some(&1) {
        return Err(bad("not a 64-bit little-endian ELF"));
    }
    let shoff = u64_at(0x28).ok_or_else(|| bad("truncated header"))?;
    let shentsize = usize::from(u16_at(0x3a).ok_or_else(|| bad("truncated header"))?);
    let shnum = usize::from(u16_at(0x3c).ok_or_else(|| bad("truncated header"))?);
    let shstrndx = usize::from(u16_at(0x3e).ok_or_else(|| bad("truncated header"))?);
    if shentsize < 64 {
        return Err(bad("bad section header size"));
    }
    let section = |i: usize| -> Option<(u32, &[u8])> {
        let h = shoff.checked_add(i.checked_mul(shentsize)?)?;
        let name = u32_at(h)?;
        let off = u64_at(h + 0x18)?;
        let size = u64_at(h + 0x20)?;
        Some((name, ko.get(off..off.checked_add(size)?)?))
    };
    let (_, strtab) = section(shstrndx).ok_or_else(|| bad("bad section string table"))?;
    let mut modinfo = None;
    for i in 0..shnum {
        let Some((name_off, body)) = section(i) else {
            continue;
        };
        let name = strtab
            .get(name_off as usize..)
            .and_then(|s| s.split(|b| *b == 0).next())
            .unwrap_or_default();
        if name == b".modinfo" {
            modinfo = Some(body);
            break;
        }
    }
    let modinfo = modinfo.ok_or_else(|| bad("no .modinfo section"))?;
    let mut info = ModInfo {
        name: String::new(),
        depends: Vec::new(),
    };
    for kv in modinfo.split(|b| *b == 0) {
        let kv = String::from_utf8_lossy(kv);
        if let Some(v) = kv.strip_prefix("name=") {
            info.name = v.to_string();
        } else if let Some(v) = kv.strip_prefix("depends=") {
            info.depends = v
                .split(',')
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect();
        }
    }
    if info.name.is_empty() {
        return Err(bad("no name= in .modinfo"));
    }
    Ok(info)
}

/// A kernel module to put in the initramfs.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct KernelModule {
    /// Module name (`virtio_mmio`).
    pub name: String,
    /// Path relative to the modules directory (`kernel/drivers/virtio/virtio_mmio.ko`).
    pub path: String,
    /// Names of the modules it depends on.
    pub depends: Vec<String>,
    /// The `.ko` file (uncompressed).
    pub data: Vec<u8>,
}

/// Orders modules so that each comes after its dependencies, and writes `modules.dep` (each
/// line `path: dependency paths`, the transitive dependencies, the deepest last, as depmod
/// writes it). Fails if a dependency is missing or the dependencies form a cycle.
pub fn modules_dep(modules: &[KernelModule]) -> Result<String, GuestError> {
    let by_name: BTreeMap<&str, &KernelModule> =
        modules.iter().map(|m| (m.name.as_str(), m)).collect();
    fn visit<'a>(
        m: &'a KernelModule,
        by_name: &BTreeMap<&str, &'a KernelModule>,
        stack: &mut Vec<&'a str>,
        out: &mut Vec<&'a str>,
    ) -> Result<(), GuestError> {
        if stack.contains(&m.name.as_str()) {
            return Err(GuestError::BadInitramfs(format!(
                "module dependency cycle through {}",
                m.name
            )));
        }
        stack.push(&m.name);
        for d in &m.depends {
            let dm = by_name.get(d.as_str()).ok_or_else(|| {
                GuestError::BadInitramfs(format!("module {} needs {d}, which is missing", m.name))
            })?;
            visit(dm, by_name, stack, out)?;
            if !out.contains(&dm.path.as_str()) {
                out.push(&dm.path);
            }
        }
        stack.pop();
        Ok(())
    }
    let mut text = String::new();
    for m in modules {
        let mut deps = Vec::new();
        visit(m, &by_name, &mut Vec::new(), &mut deps)?;
        deps.reverse();
        text.push_str(&m.path);
        text.push(':');
        for d in deps {
            text.push(' ');
            text.push_str(d);
        }
        text.push('\n');
    }
    Ok(text)
}

/// Everything that goes into the guest's initramfs.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct InitramfsContents<'a> {
    /// The guest agent, stored as `/init` (normally [`super::AGENT_BINARY`]).
    pub agent: &'a [u8],
    /// A static busybox, stored as `/bin/busybox`.
    pub busybox: Option<&'a [u8]>,
    /// Applets to link to busybox in `/bin` (empty: a built-in list of common ones).
    pub applets: Vec<String>,
    /// Kernel modules (with their dependencies) for `/lib/modules`, loaded at every boot.
    pub modules: Vec<KernelModule>,
    /// Kernel modules loaded only for an image root ([`ROOT_MODULES`] with those of their
    /// dependencies that are not in `modules`), listed in [`ROOT_MODULES_DEP`].
    pub root_modules: Vec<KernelModule>,
    /// Kernel modules loaded only for a network ([`NET_MODULES`] with those of their
    /// dependencies in neither list above), listed in [`NET_MODULES_DEP`].
    pub net_modules: Vec<KernelModule>,
}

/// Builds the initramfs (an uncompressed cpio newc archive).
pub fn build(c: &InitramfsContents<'_>) -> Result<Vec<u8>, GuestError> {
    if !c.agent.starts_with(b"\x7fELF") {
        return Err(GuestError::BadInitramfs(
            "the agent is not an ELF binary".into(),
        ));
    }
    let mut w = CpioWriter::new();
    for d in [
        "dev",
        "proc",
        "sys",
        "tmp",
        "workspace",
        "root",
        "etc",
        "bin",
        "sbin",
        "usr/bin",
        "usr/sbin",
        MODULES_DIR,
    ] {
        let perm = if d == "tmp" { 0o1777 } else { 0o755 };
        w.dir(d, perm)?;
    }
    // The kernel opens /dev/console for init before we mount devtmpfs.
    w.char_dev("dev/console", 0o600, 5, 1)?;
    w.char_dev("dev/null", 0o666, 1, 3)?;
    w.file("init", 0o755, c.agent)?;
    w.file("etc/passwd", 0o644, b"root:x:0:0:root:/root:/bin/sh\n")?;
    w.file("etc/group", 0o644, b"root:x:0:\n")?;
    w.file("etc/hosts", 0o644, b"127.0.0.1 localhost\n::1 localhost\n")?;
    if let Some(bb) = c.busybox {
        w.file("bin/busybox", 0o755, bb)?;
        let fallback: Vec<String> = FALLBACK_APPLETS.iter().map(|s| s.to_string()).collect();
        let applets = if c.applets.is_empty() {
            &fallback
        } else {
            &c.applets
        };
        let mut seen = BTreeSet::new();
        for a in applets {
            if a.is_empty() || a.contains('/') || a == "busybox" || a == "init" || !seen.insert(a) {
                continue;
            }
            w.symlink(&format!("bin/{a}"), "busybox")?;
        }
        if seen.contains(&"env".to_string()) {
            w.symlink("usr/bin/env", "../../bin/busybox")?;
        }
    }
    // One dependency computation over all sets (a root module may need a boot module), its
    // lines split between the lists: one line per module, in order.
    let all: Vec<KernelModule> = c
        .modules
        .iter()
        .chain(&c.root_modules)
        .chain(&c.net_modules)
        .cloned()
        .collect();
    let dep = modules_dep(&all)?;
    let mut boot_dep = String::new();
    let mut root_dep = String::new();
    let mut net_dep = String::new();
    let (boot_n, root_n) = (c.modules.len(), c.root_modules.len());
    for (i, line) in dep.lines().enumerate() {
        let out = if i < boot_n {
            &mut boot_dep
        } else if i < boot_n + root_n {
            &mut root_dep
        } else {
            &mut net_dep
        };
        out.push_str(line);
        out.push('\n');
    }
    for m in &all {
        w.file(&format!("{MODULES_DIR}/{}", m.path), 0o644, &m.data)?;
    }
    w.file(
        &format!("{MODULES_DIR}/modules.dep"),
        0o644,
        boot_dep.as_bytes(),
    )?;
    w.file(
        &format!("{MODULES_DIR}/{ROOT_MODULES_DEP}"),
        0o644,
        root_dep.as_bytes(),
    )?;
    w.file(
        &format!("{MODULES_DIR}/{NET_MODULES_DEP}"),
        0o644,
        net_dep.as_bytes(),
    )?;
    Ok(w.finish())
}

/// Checks that `data` is an initramfs our VMM can boot: a cpio archive whose `/init` is an
/// executable ELF (the agent). Returns its entries.
pub fn check(data: &[u8]) -> Result<Vec<CpioEntry>, GuestError> {
    let entries = read_cpio(data)?;
    let init = entries.iter().find(|e| e.name == "init").ok_or_else(|| {
        GuestError::BadInitramfs("no /init (the guest agent) in the archive".into())
    })?;
    if !init.is_file() || init.mode & 0o111 == 0 || !init.data.starts_with(b"\x7fELF") {
        return Err(GuestError::BadInitramfs(
            "/init is not an executable ELF file".into(),
        ));
    }
    Ok(entries)
}

#[cfg(test)]
#[path = "archive_fuzz.rs"]
mod archive_fuzz;

#[cfg(test)]
mod tests;

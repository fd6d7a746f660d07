#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The microVM tier through the `Backend` / `Sandbox` traits.
//!
//! The first group runs everywhere: the probe tells the truth (and returns), `create` on a host
//! that cannot boot Linux guests is `Unavailable` at once, specs this tier cannot honour are
//! `Unsupported`, the capabilities are honest, snapshots from elsewhere are refused.
//!
//! The second group is the full Linux-guest path (boot, agent, exec, env, secrets, files,
//! limits, streaming, snapshot/restore, pause, teardown, the network through the real egress
//! enforcer, published ports). It runs where the probe reports
//! hardware-speed guest kernel mode and skips elsewhere, printing the probe's reason. Its guest
//! comes from `MICROVM_GUEST_DIR` if set (a cache prepared by `agent-sandbox install
//! microvm-guest`), else it is prepared once (Debian's kernel via `apt-get download`) in a
//! directory under the system temp dir, shared with `tests/linux_guest.rs`.

#[path = "common/egress.rs"]
mod egress;

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use backend_microvm::guest::install::{self, InstallOptions, Verify};
use backend_microvm::probe::{probe_kvm, EMULATED_KERNEL_MODE};
use backend_microvm::{MicrovmBackend, INSTALL_FIX};
use sandbox_core::{
    Backend, Error, ExecEvent, ExecRequest, IsolationBoundary, Language, LimitKind,
    MapSecretSource, NetworkMode, NetworkPolicy, ObjectSnapshotStore, ResolvedSecrets, Sandbox,
    SandboxSpec, SnapshotDraft, SnapshotError, SnapshotKind, SnapshotStore, Tier, Workspace,
};

/// A probe never takes this long; a hang fails the test instead of blocking CI.
const HANG: Duration = Duration::from_secs(120);

fn shell_spec() -> SandboxSpec {
    SandboxSpec::builder(Language::Shell)
        .memory_mib(256)
        .build()
        .unwrap()
}

// ------------------------------------------------------------------------------------------
// Runs on every host.

#[tokio::test]
async fn the_probe_tells_the_truth_and_returns() {
    let status = tokio::time::timeout(HANG, MicrovmBackend::builder().build().unwrap().probe())
        .await
        .expect("the probe must not hang");
    let kvm = probe_kvm();
    assert_eq!(status.tier, Tier::Microvm);
    assert!(!status.reason.is_empty());
    assert!(status.details.contains_key("guest.status"), "{status:?}");
    if !kvm.linux_guests_supported() {
        assert!(!status.available, "{status:?}");
        assert_eq!(status.reason, kvm.reason);
        assert!(!status.fix.as_deref().unwrap_or_default().is_empty());
        if kvm.present {
            // KVM works but kernel mode is emulated (nested PVM): the documented message.
            assert_eq!(status.reason, EMULATED_KERNEL_MODE);
            assert!(status
                .reason
                .starts_with("Linux guests unsupported on this host: kernel mode is emulated"));
        }
    } else if status.available {
        assert!(status.reason.contains("hardware KVM"), "{status:?}");
    } else {
        // Hardware KVM but no guest installed: the fix is the install command.
        assert!(status
            .fix
            .as_deref()
            .unwrap_or_default()
            .contains(INSTALL_FIX));
    }
    eprintln!("microvm probe: {status:?}");
}

#[tokio::test]
async fn a_missing_guest_is_named_with_the_install_fix() {
    let empty = tempfile::tempdir().unwrap();
    let b = MicrovmBackend::builder()
        .guest_dir(empty.path())
        .build()
        .unwrap();
    let status = tokio::time::timeout(HANG, b.probe()).await.unwrap();
    assert!(!status.available);
    let guest = &status.details["guest.status"];
    assert!(guest.contains("not installed"), "{guest}");
    assert!(guest.contains(INSTALL_FIX), "{guest}");
    if probe_kvm().linux_guests_supported() {
        assert!(status.fix.unwrap().contains(INSTALL_FIX));
    }
    // Explicit files that do not exist: named.
    let b = MicrovmBackend::builder()
        .kernel(empty.path().join("vmlinux"))
        .initramfs(empty.path().join("initrd"))
        .build()
        .unwrap();
    let status = b.probe().await;
    assert!(!status.available);
    assert!(
        status.details["guest.status"].contains("does not exist"),
        "{status:?}"
    );
}

#[tokio::test]
async fn create_where_linux_guests_cannot_run_is_unavailable_at_once() {
    let kvm = probe_kvm();
    if kvm.linux_guests_supported() {
        eprintln!("SKIP: this host runs Linux guests; the full-path tests cover create");
        return;
    }
    let r = tokio::time::timeout(
        HANG,
        MicrovmBackend::builder()
            .build()
            .unwrap()
            .create(&shell_spec(), ResolvedSecrets::none()),
    )
    .await
    .expect("create must not hang");
    match r {
        Err(Error::Unavailable { tier, reason, fix }) => {
            assert_eq!(tier, Tier::Microvm);
            assert_eq!(reason, kvm.reason);
            assert!(!fix.is_empty());
        }
        Err(other) => panic!("expected Unavailable, got {other}"),
        Ok(_) => panic!("created a microVM on a host whose probe says it cannot"),
    }
}

/// An image is pulled only where the tier can run: on a host that cannot boot Linux guests,
/// `create` with an image is `Unavailable` without touching the (here unreachable) registry.
#[tokio::test]
async fn an_image_is_not_pulled_where_the_tier_cannot_run() {
    let kvm = probe_kvm();
    if kvm.linux_guests_supported() {
        eprintln!("SKIP: this host runs Linux guests; the full-path tests cover images");
        return;
    }
    let cache = tempfile::tempdir().unwrap();
    let store = backend_microvm::ImageStore::builder(cache.path())
        .build()
        .unwrap();
    let spec = SandboxSpec::builder(Language::Python)
        .image("127.0.0.1:9/nowhere:1")
        .memory_mib(256)
        .build()
        .unwrap();
    let b = MicrovmBackend::builder()
        .image_store(store)
        .build()
        .unwrap();
    match tokio::time::timeout(HANG, b.create(&spec, ResolvedSecrets::none()))
        .await
        .expect("create must not hang")
    {
        Err(Error::Unavailable { reason, .. }) => assert_eq!(reason, kvm.reason),
        Err(e) => panic!("expected Unavailable, got {e}"),
        Ok(_) => panic!("created a microVM on a host whose probe says it cannot"),
    }
    // Nothing was fetched or cached: no blob, layer or image record.
    fn files(p: &std::path::Path) -> Vec<PathBuf> {
        let Ok(rd) = std::fs::read_dir(p) else {
            return vec![];
        };
        rd.flat_map(|e| {
            let p = e.unwrap().path();
            if p.is_dir() {
                files(&p)
            } else {
                vec![p]
            }
        })
        .collect()
    }
    for d in ["blobs", "layers", "images", "fsimages"] {
        let f = files(&cache.path().join(d));
        assert!(f.is_empty(), "the cache was written: {f:?}");
    }
    assert!(!cache.path().join("refs.json").exists());
}

#[tokio::test]
async fn specs_this_tier_cannot_honour_are_refused_before_anything_starts() {
    let b = MicrovmBackend::builder().build().unwrap();
    let unsupported = |s: SandboxSpec| {
        let b = b.clone();
        async move {
            match b.create(&s, ResolvedSecrets::none()).await {
                Err(Error::Unsupported { tier, what }) => {
                    assert_eq!(tier, Tier::Microvm);
                    what
                }
                Err(e) => panic!("expected Unsupported, got {e}"),
                Ok(_) => panic!("accepted"),
            }
        }
    };
    let mut s = shell_spec();
    s.network = NetworkPolicy::Allow {
        hosts: vec!["example.com".parse().unwrap()],
        cidrs: vec![],
        ports: vec![],
    };
    assert!(unsupported(s).await.contains("network"));
    let mut s = shell_spec();
    s.network = NetworkPolicy::AllowInternet {
        deny: vec![],
        private: vec![],
    };
    assert!(unsupported(s).await.contains("network"));
    let dir = tempfile::tempdir().unwrap();
    let mut s = shell_spec();
    s.rootfs = Some(dir.path().to_path_buf());
    assert!(unsupported(s).await.contains("rootfs"));
    let mut s = shell_spec();
    s.workspace = Workspace::HostDir {
        path: dir.path().to_path_buf(),
        read_only: false,
    };
    assert!(unsupported(s).await.contains("host directory"));
    let s = SandboxSpec::builder(Language::Shell)
        .mount_ro(dir.path(), "/data")
        .build()
        .unwrap();
    assert!(unsupported(s).await.contains("mounts"));
    let s = SandboxSpec::builder(Language::Python).build().unwrap();
    assert!(unsupported(s).await.contains("without an image"));
    let s = SandboxSpec::builder(Language::C)
        .image("python:3.12-slim")
        .build()
        .unwrap();
    assert!(unsupported(s).await.contains("from an image"));
    // Too little memory for a Linux guest: an invalid spec, naming the field.
    let s = SandboxSpec::builder(Language::Shell)
        .memory_mib(16)
        .build()
        .unwrap();
    match b.create(&s, ResolvedSecrets::none()).await {
        Err(Error::InvalidSpec { field, .. }) => assert_eq!(field, "limits.memory_bytes"),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("accepted"),
    }
}

#[test]
fn capabilities_are_honest() {
    let c = MicrovmBackend::builder().build().unwrap().capabilities();
    assert_eq!(c.tier, Tier::Microvm);
    // Our initramfs has busybox and the agent: shell code and argv, nothing else.
    assert_eq!(c.languages, vec![Language::Shell]);
    // An image becomes the root disk: its interpreters run Python and JavaScript.
    assert!(c.images);
    assert!(c.runs_language(Language::Python, true));
    assert!(c.runs_language(Language::Javascript, true));
    assert!(!c.runs_language(Language::Python, false));
    assert!(!c.runs_language(Language::C, true));
    assert!(c.argv);
    assert_eq!(c.boundary, IsolationBoundary::GuestKernel);
    assert!(c.supports_snapshot(SnapshotKind::FullMemory));
    assert!(c.supports_snapshot(SnapshotKind::Filesystem));
    assert_eq!(c.network, vec![NetworkMode::DenyAll]);
    assert!(!c.supports_network(&NetworkPolicy::AllowInternet {
        deny: vec![],
        private: vec![]
    }));
    assert!(c.streaming && c.pause_resume && c.persistent_state);
    // With an egress enforcer plugged in, allowlists and the internet through its proxy.
    let c = MicrovmBackend::builder()
        .egress(sandbox_egress::shared_enforcer())
        .build()
        .unwrap()
        .capabilities();
    assert_eq!(
        c.network,
        vec![
            NetworkMode::DenyAll,
            NetworkMode::Allowlist,
            NetworkMode::Internet
        ]
    );
    assert!(c.supports_network(&NetworkPolicy::AllowInternet {
        deny: vec![],
        private: vec![]
    }));
}

#[test]
fn the_builder_refuses_bad_settings() {
    let bad = |r: sandbox_core::Result<MicrovmBackend>| match r {
        Err(Error::InvalidSpec { field, .. }) => field,
        other => panic!("{other:?}"),
    };
    assert_eq!(
        bad(MicrovmBackend::builder().vcpus(0).build()),
        "microvm.vcpus"
    );
    assert_eq!(
        bad(MicrovmBackend::builder().vcpus(33).build()),
        "microvm.vcpus"
    );
    assert_eq!(
        bad(MicrovmBackend::builder().kernel("/k").build()),
        "microvm.guest"
    );
    assert_eq!(
        bad(MicrovmBackend::builder()
            .kernel("/k")
            .initramfs("/i")
            .guest_dir("/d")
            .build()),
        "microvm.guest"
    );
    assert_eq!(
        bad(MicrovmBackend::builder()
            .boot_timeout(Duration::ZERO)
            .build()),
        "microvm.boot_timeout"
    );
    assert_eq!(
        bad(MicrovmBackend::builder()
            .pool_size(backend_microvm::MAX_POOL_SIZE + 1)
            .build()),
        "microvm.pool_size"
    );
    let b = MicrovmBackend::builder()
        .vcpus(2)
        .pool_size(0)
        .boot_snapshots(false)
        .build()
        .unwrap();
    assert_eq!(b.config().vcpus, 2);
    assert_eq!(b.config().pool_size, 0);
    assert!(!b.config().boot_snapshots);
    let d = MicrovmBackend::builder().build().unwrap();
    assert!(d.config().boot_snapshots, "on by default");
    assert_eq!(d.config().pool_size, backend_microvm::DEFAULT_POOL_SIZE);
    assert_eq!(MicrovmBackend::builder().build().unwrap().config().vcpus, 1);
    assert!(MicrovmBackend::engine().contains(&format!(
        "snapshot format {}",
        backend_microvm::vmm::vm::SNAPSHOT_FORMAT_VERSION
    )));
}

#[tokio::test]
async fn snapshots_from_elsewhere_are_refused_before_anything_starts() {
    let dir = tempfile::tempdir().unwrap();
    let store = ObjectSnapshotStore::local(dir.path()).unwrap();
    let b = MicrovmBackend::builder().build().unwrap();
    let restore = |id| {
        let (b, store) = (b.clone(), store.clone());
        async move {
            match b.restore(&store, &id, ResolvedSecrets::none()).await {
                Err(Error::Snapshot(e)) => e,
                Err(e) => panic!("expected a snapshot error, got {e}"),
                Ok(_) => panic!("restored"),
            }
        }
    };
    let draft = |tier, engine: String| {
        SnapshotDraft::new(tier, engine, vec![SnapshotKind::FullMemory], shell_spec())
            .artifact("vm-state.json", b"{}".to_vec())
            .artifact("memory.extents", b"AGSBMEM1".to_vec())
    };
    // Another tier.
    let id = store
        .put(draft(Tier::Gvisor, "runsc".into()))
        .await
        .unwrap();
    assert!(matches!(restore(id).await, SnapshotError::Foreign { .. }));
    // Another VMM version / snapshot format.
    let id = store
        .put(draft(
            Tier::Microvm,
            "agent-sandbox-microvm 0.0.1 (snapshot format 0)".into(),
        ))
        .await
        .unwrap();
    assert!(matches!(
        restore(id).await,
        SnapshotError::Incompatible { .. }
    ));
    // Our engine, but a guest agent of another build.
    let id = store
        .put(
            draft(Tier::Microvm, MicrovmBackend::engine())
                .meta("mem_size", (256u64 << 20).to_string())
                .meta("vcpus", "1")
                .meta("agent_hash", "00000000deadbeef"),
        )
        .await
        .unwrap();
    match restore(id).await {
        SnapshotError::Incompatible { reason, .. } => {
            assert!(reason.contains("agent build 00000000deadbeef"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    // Our engine, but no memory size recorded.
    let id = store
        .put(draft(Tier::Microvm, MicrovmBackend::engine()))
        .await
        .unwrap();
    assert!(matches!(restore(id).await, SnapshotError::Corrupt { .. }));

    // A sandbox with a network: without an enforcer the copy cannot have one (Unsupported,
    // naming the setting); with one, its MAC must be recorded and well-formed.
    let mut networked = shell_spec();
    networked.network = egress::allow(&["allowed.test"]);
    let put = |mac: Option<&str>| {
        let (store, networked) = (store.clone(), networked.clone());
        let mac = mac.map(str::to_owned);
        async move {
            let mut d = SnapshotDraft::new(
                Tier::Microvm,
                MicrovmBackend::engine(),
                vec![SnapshotKind::FullMemory],
                networked,
            )
            .artifact("vm-state.json", b"{}".to_vec())
            .artifact("memory.extents", b"AGSBMEM1".to_vec())
            .meta("mem_size", (256u64 << 20).to_string())
            .meta("vcpus", "1");
            if let Some(m) = mac {
                d = d.meta("net_mac", m);
            }
            store.put(d).await.unwrap()
        }
    };
    let id = put(Some("02:00:00:00:00:01")).await;
    match b.restore(&store, &id, ResolvedSecrets::none()).await {
        Err(Error::Unsupported { .. }) => {}
        Err(e) => panic!("expected Unsupported without an enforcer, got {e}"),
        Ok(_) => panic!("restored a network without an enforcer"),
    }
    let Some(veth) = egress::try_enforcer() else {
        return;
    };
    let with_egress = MicrovmBackend::builder()
        .egress(Arc::new(veth))
        .build()
        .unwrap();
    for mac in [None, Some("02:00:00:00:00"), Some("not a mac")] {
        let id = put(mac).await;
        match with_egress
            .restore(&store, &id, ResolvedSecrets::none())
            .await
        {
            Err(Error::Snapshot(SnapshotError::Corrupt { what, .. })) => {
                assert!(what.contains("net_mac"), "{what}")
            }
            Err(e) => panic!("{mac:?}: expected Corrupt, got {e}"),
            Ok(_) => panic!("{mac:?}: restored"),
        }
    }
}

// ------------------------------------------------------------------------------------------
// The full Linux-guest path: hardware KVM only.

/// Why the full path cannot run here (the probe's reason), if it cannot.
fn skip_reason() -> Option<String> {
    let p = probe_kvm();
    (!p.linux_guests_supported()).then_some(p.reason)
}

/// One VM at a time: bounded memory, and thread/fd counts that mean something.
static ONE_VM: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Skips the test (saying why) when the host cannot boot Linux guests; otherwise takes the
/// one-VM-at-a-time lock, to be held for the rest of the test.
macro_rules! linux_vm_or_skip {
    () => {
        match skip_reason() {
            Some(why) => {
                eprintln!("SKIP: {why}");
                return;
            }
            None => ONE_VM.lock().await,
        }
    };
}

fn guest_dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::var_os("MICROVM_GUEST_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| std::env::temp_dir().join("agent-sandbox-linux-guest-test"));
        if let Err(e) = install::load(&dir, Verify::Sizes) {
            eprintln!("preparing guest artifacts in {} ({e})", dir.display());
            install::install(&InstallOptions::debian().dir(dir.clone())).unwrap();
        }
        dir
    })
}

fn backend() -> MicrovmBackend {
    MicrovmBackend::builder()
        .guest_dir(guest_dir())
        .build()
        .unwrap()
}

const SECRET: &str = "hunter2-very-secret-value";

fn secrets_for(spec: &SandboxSpec) -> ResolvedSecrets {
    ResolvedSecrets::resolve(
        &spec.secrets,
        &MapSecretSource::new().with("API_TOKEN", SECRET),
    )
    .unwrap()
}

async fn create(spec: &SandboxSpec) -> Box<dyn Sandbox> {
    let b = backend();
    let dir = guest_dir().clone();
    tokio::task::spawn_blocking(move || drop(install::load(&dir, Verify::Sizes)))
        .await
        .unwrap();
    b.create(spec, secrets_for(spec)).await.unwrap()
}

#[tokio::test]
async fn create_exec_and_the_exact_environment() {
    let _one = linux_vm_or_skip!();
    let spec = SandboxSpec::builder(Language::Shell)
        .memory_mib(256)
        .env("ONLY", "this")
        .build()
        .unwrap();
    let s = create(&spec).await;
    let phases: Vec<_> = s.timeline().phases.iter().map(|p| p.phase).collect();
    assert!(phases.contains(&sandbox_core::Phase::Runtime), "{phases:?}");
    s.health_check().await.unwrap();

    // Debian's kernel, our mounts.
    let r = s.exec(ExecRequest::argv(["uname", "-r"])).await.unwrap();
    let m = install::load(guest_dir(), Verify::Sizes).unwrap().manifest;
    assert_eq!(
        Some(r.stdout_str().trim()),
        m.kernel_version.as_deref(),
        "{r:?}"
    );
    let mounts = s
        .exec(ExecRequest::argv(["cat", "/proc/mounts"]))
        .await
        .unwrap()
        .stdout_str();
    assert!(mounts.contains(" /workspace "), "{mounts}");

    // Exit codes, stderr, stdin, cwd.
    let r = s
        .exec(ExecRequest::code("echo out; echo err >&2; exit 7"))
        .await
        .unwrap();
    assert_eq!(
        (
            r.stdout_str().as_str(),
            r.stderr_str().as_str(),
            r.exit_code
        ),
        ("out\n", "err\n", Some(7))
    );
    let r = s
        .exec(ExecRequest::argv(["cat"]).stdin(b"via stdin".to_vec()))
        .await
        .unwrap();
    assert_eq!(r.stdout, b"via stdin");
    s.exec(ExecRequest::code("mkdir -p /workspace/sub"))
        .await
        .unwrap();
    let r = s.exec(ExecRequest::argv(["pwd"]).cwd("sub")).await.unwrap();
    assert_eq!(r.stdout_str(), "/workspace/sub\n");

    // Exactly the spec's environment plus the defaults; per-call env on top.
    let r = s
        .exec(ExecRequest::argv(["env"]).env("CALL", "1"))
        .await
        .unwrap();
    let mut names: Vec<String> = r
        .stdout_str()
        .lines()
        .filter_map(|l| l.split_once('=').map(|(k, _)| k.to_string()))
        .collect();
    names.sort();
    assert_eq!(names, ["CALL", "HOME", "LANG", "ONLY", "PATH"], "{r:?}");

    // State persists across execs.
    s.exec(ExecRequest::code("echo 41 > /tmp/n")).await.unwrap();
    let r = s
        .exec(ExecRequest::code("echo $(( $(cat /tmp/n) + 1 ))"))
        .await
        .unwrap();
    assert_eq!(r.stdout_str(), "42\n");
    s.destroy().await.unwrap();
}

#[tokio::test]
async fn secrets_are_in_the_environment_and_redacted_from_output() {
    let _one = linux_vm_or_skip!();
    let spec = SandboxSpec::builder(Language::Shell)
        .memory_mib(256)
        .secret_env("API_TOKEN", "TOKEN")
        .build()
        .unwrap();
    let s = create(&spec).await;
    let r = s
        .exec(ExecRequest::code(
            "echo \"out $TOKEN\"; echo \"err $TOKEN\" >&2; [ \"$TOKEN\" = '{SECRET}' ] && echo same"
                .replace("{SECRET}", SECRET),
        ))
        .await
        .unwrap();
    let (out, err) = (r.stdout_str(), r.stderr_str());
    assert!(
        !out.contains(SECRET) && !err.contains(SECRET),
        "{out} {err}"
    );
    assert!(
        out.contains("[REDACTED:API_TOKEN]") && out.contains("same"),
        "{out}"
    );
    // Streamed output too, also when the secret is split across chunks.
    let mut st = s
        .exec_stream(ExecRequest::code(format!(
            "printf '%s' '{}'; sleep 0.2; printf '%s\\n' '{}'",
            &SECRET[..5],
            &SECRET[5..]
        )))
        .await
        .unwrap();
    let mut streamed = Vec::new();
    let mut exit = None;
    while let Some(ev) = st.next().await {
        match ev.unwrap() {
            ExecEvent::Stdout(b) => streamed.extend_from_slice(&b),
            ExecEvent::Stderr(_) => {}
            ExecEvent::Exit(r) => exit = Some(r),
            other => panic!("unexpected event: {other:?}"),
        }
    }
    let streamed = String::from_utf8(streamed).unwrap();
    assert!(!streamed.contains(SECRET), "{streamed}");
    assert!(streamed.contains("[REDACTED:API_TOKEN]"), "{streamed}");
    assert_eq!(exit.unwrap().exit_code, Some(0));
    s.destroy().await.unwrap();
}

#[tokio::test]
async fn files_go_to_the_guest_workspace_and_escapes_are_refused() {
    let _one = linux_vm_or_skip!();
    let s = create(&shell_spec()).await;
    s.write_file("dir/hello.txt", b"hello guest").await.unwrap();
    let r = s
        .exec(ExecRequest::argv(["cat", "/workspace/dir/hello.txt"]))
        .await
        .unwrap();
    assert_eq!(r.stdout, b"hello guest");
    s.exec(ExecRequest::code("echo made > /workspace/made.txt"))
        .await
        .unwrap();
    assert_eq!(s.read_file("/workspace/made.txt").await.unwrap(), b"made\n");
    let names: Vec<String> = s
        .list("")
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(names, ["dir", "made.txt"]);
    for bad in ["../init", "/etc/passwd", "/workspace/../init"] {
        assert!(
            matches!(s.read_file(bad).await, Err(Error::PathEscape { .. })),
            "{bad}"
        );
        assert!(matches!(
            s.write_file(bad, b"x").await,
            Err(Error::PathEscape { .. })
        ));
    }
    // A symlink made inside the guest that points out of the workspace: the agent refuses.
    s.exec(ExecRequest::code("ln -s /etc /workspace/out"))
        .await
        .unwrap();
    assert!(matches!(
        s.read_file("out/passwd").await,
        Err(Error::PathEscape { .. })
    ));
    assert!(matches!(
        s.read_file("missing.txt").await,
        Err(Error::NotFound { .. })
    ));
    s.destroy().await.unwrap();
}

#[tokio::test]
async fn limits_wall_time_and_output_caps() {
    let _one = linux_vm_or_skip!();
    let spec = SandboxSpec::builder(Language::Shell)
        .memory_mib(256)
        .output_bytes(1000)
        .build()
        .unwrap();
    let s = create(&spec).await;
    let r = s
        .exec(ExecRequest::argv(["sleep", "100"]).timeout(Duration::from_millis(500)))
        .await
        .unwrap();
    assert_eq!(r.limit, Some(LimitKind::WallTime));
    assert_eq!(r.exit_code, Some(137));
    // A flood is capped (the guest drops the rest) and the sandbox still answers.
    let r = s
        .exec(ExecRequest::code("yes | head -c 50000000"))
        .await
        .unwrap();
    assert!(r.truncated);
    assert_eq!(r.stdout.len(), 1000);
    let r = s.exec(ExecRequest::code("echo fine")).await.unwrap();
    assert_eq!(r.stdout_str(), "fine\n");
    s.destroy().await.unwrap();
}

#[tokio::test]
async fn snapshot_and_restore_continue_where_they_were() {
    let _one = linux_vm_or_skip!();
    let dir = tempfile::tempdir().unwrap();
    let store = ObjectSnapshotStore::local(dir.path()).unwrap();
    let s = create(&shell_spec()).await;
    s.write_file("state.txt", b"before snapshot").await.unwrap();
    s.exec(ExecRequest::code(
        "(i=0; while true; do i=$((i+1)); echo $i > /workspace/counter; sleep 0.05; done) \
         >/dev/null 2>&1 &",
    ))
    .await
    .unwrap();
    s.pause().await.unwrap();
    s.resume().await.unwrap();
    let id = s.snapshot(&store).await.unwrap();
    let m = store.manifest(&id).await.unwrap();
    assert_eq!(m.tier, Tier::Microvm);
    assert_eq!(m.engine, MicrovmBackend::engine());
    assert!(m.kinds.contains(&SnapshotKind::FullMemory));
    assert_eq!(m.metadata["mem_size"], (256u64 << 20).to_string());
    // The original keeps running after its snapshot.
    assert_eq!(
        s.exec(ExecRequest::code("echo still"))
            .await
            .unwrap()
            .stdout,
        b"still\n"
    );
    s.destroy().await.unwrap();

    let r = backend()
        .restore(&store, &id, ResolvedSecrets::none())
        .await
        .unwrap();
    assert!(r
        .timeline()
        .phases
        .iter()
        .any(|p| p.phase == sandbox_core::Phase::Restore));
    assert_eq!(r.read_file("state.txt").await.unwrap(), b"before snapshot");
    let read = |d: Vec<u8>| -> u64 { String::from_utf8(d).unwrap().trim().parse().unwrap() };
    let first = read(r.read_file("counter").await.unwrap());
    r.exec(ExecRequest::argv(["sleep", "0.5"])).await.unwrap();
    assert!(read(r.read_file("counter").await.unwrap()) > first);
    r.destroy().await.unwrap();
}

fn started_from_a_snapshot(s: &dyn Sandbox) -> bool {
    s.timeline()
        .phases
        .iter()
        .any(|p| p.phase == sandbox_core::Phase::Restore)
}

/// A sandbox's random UUID, hostname and clock (seconds).
async fn facts(s: &dyn Sandbox) -> Vec<String> {
    let r = s
        .exec(ExecRequest::code(
            "cat /proc/sys/kernel/random/uuid; hostname; date +%s",
        ))
        .await
        .unwrap();
    assert_eq!(r.exit_code, Some(0), "{}", r.stderr_str());
    let out = r.stdout_str();
    let v: Vec<String> = out.lines().map(str::to_string).collect();
    assert_eq!(v.len(), 3, "{out}");
    v
}

#[tokio::test]
async fn later_sandboxes_start_from_the_first_ones_boot_with_their_own_identity() {
    let _one = linux_vm_or_skip!();
    let b = backend();
    let none = ResolvedSecrets::none;
    let first = b.create(&shell_spec(), none()).await.unwrap();
    assert!(!started_from_a_snapshot(first.as_ref()), "the first boots");
    first.write_file("mine.txt", b"first's").await.unwrap();
    let f1 = facts(first.as_ref()).await;
    let second = b.create(&shell_spec(), none()).await.unwrap();
    let third = b.create(&shell_spec(), none()).await.unwrap();
    let host_now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let mut uuids = vec![f1[0].clone()];
    for s in [&second, &third] {
        assert!(started_from_a_snapshot(s.as_ref()), "{:?}", s.timeline());
        // Nothing of the first sandbox's own: the snapshot was taken before it ran anything.
        assert!(s.read_file("mine.txt").await.is_err());
        let f = facts(s.as_ref()).await;
        // Its own name, randomness and the host's clock.
        assert_eq!(f[1], s.id(), "hostname");
        let t: i64 = f[2].parse().unwrap();
        assert!(
            (t - host_now).abs() < 60,
            "guest clock {t}, host {host_now}"
        );
        uuids.push(f[0].clone());
        assert_eq!(
            s.exec(ExecRequest::code("echo $((6*7))"))
                .await
                .unwrap()
                .stdout,
            b"42\n"
        );
    }
    uuids.sort();
    uuids.dedup();
    assert_eq!(uuids.len(), 3, "each copy draws its own random numbers");
    assert_eq!(first.read_file("mine.txt").await.unwrap(), b"first's");
    for s in [first, second, third] {
        s.destroy().await.unwrap();
    }
    // Another memory size is another kind: it boots. Off, every sandbox boots.
    let bigger = SandboxSpec::builder(Language::Shell)
        .memory_mib(320)
        .build()
        .unwrap();
    let s = b.create(&bigger, none()).await.unwrap();
    assert!(!started_from_a_snapshot(s.as_ref()));
    s.destroy().await.unwrap();
    let cold = MicrovmBackend::builder()
        .guest_dir(guest_dir())
        .boot_snapshots(false)
        .build()
        .unwrap();
    for _ in 0..2 {
        let s = cold.create(&shell_spec(), none()).await.unwrap();
        assert!(!started_from_a_snapshot(s.as_ref()));
        s.destroy().await.unwrap();
    }
}

/// Sandboxes with a network start from the first one's boot too: each on its own link and
/// address (the agent moved `eth0`), each reaching the allowed host through its own link,
/// and each link gone with its sandbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allowlisted_sandboxes_start_from_a_boot_snapshot_on_links_of_their_own() {
    let _one = linux_vm_or_skip!();
    let Some((b, veth, spec, port)) = allowlisted().await else {
        return;
    };
    let mut all = Vec::new();
    let mut addresses = Vec::new();
    for i in 0..3 {
        let s = b.create(&spec, ResolvedSecrets::none()).await.unwrap();
        assert_eq!(
            started_from_a_snapshot(s.as_ref()),
            i > 0,
            "{:?}",
            s.timeline()
        );
        let r = s
            .exec(ExecRequest::code(format!(
                "timeout 20 wget -q -O - http://allowed.test:{port}/"
            )))
            .await
            .unwrap();
        assert_eq!(
            r.stdout_str(),
            format!("hello allowed.test:{port}"),
            "{r:?}"
        );
        addresses.push(eth0(s.as_ref()).await);
        all.push(s);
    }
    addresses.sort();
    addresses.dedup();
    assert_eq!(addresses.len(), 3, "each on its own address: {addresses:?}");
    assert_eq!(veth.links().await.unwrap().len(), 3);
    for s in all {
        s.destroy().await.unwrap();
    }
    assert!(veth.links().await.unwrap().is_empty(), "the links are gone");
}

/// The Debian 13 image with python3 3.13 and numpy that `scripts/test-image.sh` builds.
fn test_image() -> Option<PathBuf> {
    let dir = std::env::var_os("AGENT_SANDBOX_TEST_IMAGES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/tmp/agent-sandbox-images"))
        .join("trixie-numpy");
    dir.join("index.json").is_file().then_some(dir)
}

/// The whole path from an OCI image: pulled into a store, made into an ext4 disk, served by
/// the VM's virtio-blk device and made the guest's root; the image's own Python runs code,
/// its `Env` and `WorkingDir` apply, a snapshot pins the image and restores onto the same
/// disk.
#[tokio::test]
async fn a_sandbox_from_an_image_runs_the_images_python() {
    let _one = linux_vm_or_skip!();
    let Some(layout) = test_image() else {
        panic!("no test image: run scripts/test-image.sh (scripts/test.sh does)");
    };
    let cache = tempfile::tempdir().unwrap();
    let store = backend_microvm::ImageStore::builder(cache.path())
        .build()
        .unwrap();
    let b = MicrovmBackend::builder()
        .guest_dir(guest_dir())
        .image_store(store)
        .build()
        .unwrap();
    let spec = SandboxSpec::builder(Language::Python)
        .image(format!("oci:{}:python3", layout.display()))
        .memory_mib(512)
        .env("FROM_SPEC", "1")
        .build()
        .unwrap();
    let s = b.create(&spec, ResolvedSecrets::none()).await.unwrap();
    let phases: Vec<_> = s.timeline().phases.iter().map(|p| p.phase).collect();
    assert!(phases.contains(&sandbox_core::Phase::Image), "{phases:?}");
    let r = s
        .exec(ExecRequest::code(
            "import sys, numpy; print(sys.version_info[:2], numpy.arange(4).sum())",
        ))
        .await
        .unwrap();
    assert_eq!(r.stdout_str(), "(3, 13) 6\n", "{r:?}");
    let r = s
        .exec(ExecRequest::code(
            "import os; print(os.environ['FROM_SPEC'], os.environ['PATH'] != '', os.getcwd())",
        ))
        .await
        .unwrap();
    assert_eq!(r.stdout_str(), "1 True /workspace\n", "{r:?}");
    s.write_file("data.txt", b"kept").await.unwrap();

    let snaps = tempfile::tempdir().unwrap();
    let snap_store = ObjectSnapshotStore::local(snaps.path()).unwrap();
    let id = s.snapshot(&snap_store).await.unwrap();
    let m = snap_store.manifest(&id).await.unwrap();
    assert!(m.metadata.contains_key("image_digest"), "{:?}", m.metadata);
    s.destroy().await.unwrap();
    let r = b
        .restore(&snap_store, &id, ResolvedSecrets::none())
        .await
        .unwrap();
    assert_eq!(r.read_file("data.txt").await.unwrap(), b"kept");
    let out = r
        .exec(ExecRequest::code("print(open('data.txt').read())"))
        .await
        .unwrap();
    assert_eq!(out.stdout_str(), "kept\n", "{out:?}");
    r.destroy().await.unwrap();
}

fn microvm_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|c| c.starts_with("microvm-"))
        .count()
}

fn kvm_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|f| std::fs::read_link(f.ok()?.path()).ok())
        .filter(|l| l.to_string_lossy().contains("kvm"))
        .count()
}

#[tokio::test]
async fn destroy_is_idempotent_and_leaves_no_threads_or_fds() {
    let _one = linux_vm_or_skip!();
    let (threads, fds) = (microvm_threads(), kvm_fds());
    let s = create(&shell_spec()).await;
    assert!(microvm_threads() > threads);
    // A background process that would outlive a careless teardown.
    s.exec(ExecRequest::code("sleep 1000 >/dev/null 2>&1 &"))
        .await
        .unwrap();
    s.destroy().await.unwrap();
    s.destroy().await.unwrap();
    assert!(matches!(
        s.exec(ExecRequest::code("true")).await,
        Err(Error::SandboxGone { .. })
    ));
    assert!(matches!(
        s.health_check().await,
        Err(Error::SandboxGone { .. })
    ));
    assert_eq!(microvm_threads(), threads);
    assert_eq!(kvm_fds(), fds);
    // Dropping without destroy also ends everything.
    let s = create(&shell_spec()).await;
    drop(s);
    assert_eq!(microvm_threads(), threads);
    assert_eq!(kvm_fds(), fds);
}

#[tokio::test]
async fn the_lifetime_limit_stops_the_vm() {
    let _one = linux_vm_or_skip!();
    let mut spec = shell_spec();
    spec.limits.wall_time_ms = 1000;
    spec.limits.lifetime_ms = 4000;
    let s = create(&spec).await;
    // Past the lifetime the VM is killed from the host, and the sandbox is gone.
    tokio::time::sleep(Duration::from_millis(4500)).await;
    match s.exec(ExecRequest::code("true")).await {
        Err(Error::SandboxGone { reason, .. }) => assert!(reason.contains("lifetime"), "{reason}"),
        other => panic!("{other:?}"),
    }
    s.destroy().await.unwrap();
}

/// The network through the real egress enforcer, from inside the guest (busybox `wget` and
/// `nslookup`), and a snapshot of it restored onto a link of the copy's own: the guest side
/// of both is also tested under QEMU (`tests/qemu_network.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allowlisted_sandbox_reaches_only_what_its_policy_allows() {
    let _one = linux_vm_or_skip!();
    let Some((b, veth, spec, port)) = allowlisted().await else {
        return;
    };
    let s = b.create(&spec, ResolvedSecrets::none()).await.unwrap();
    assert!(s
        .timeline()
        .phases
        .iter()
        .any(|p| p.phase == sandbox_core::Phase::Network));
    let wget = |url: String, proxy: bool| {
        let unset = if proxy {
            ""
        } else {
            "unset http_proxy HTTP_PROXY; "
        };
        ExecRequest::code(format!("{unset}timeout 20 wget -q -O - {url}"))
    };
    let allowed = format!("http://allowed.test:{port}/");
    let r = s.exec(wget(allowed.clone(), true)).await.unwrap();
    assert_eq!(r.exit_code, Some(0), "{}{}", r.stdout_str(), r.stderr_str());
    assert_eq!(r.stdout_str(), format!("hello allowed.test:{port}"));
    for (url, proxy) in [
        (format!("http://other.test:{port}/"), true),
        ("http://169.254.169.254/latest/meta-data/".to_string(), true),
        (format!("http://10.201.0.9:{port}/"), false),
    ] {
        let r = s.exec(wget(url.clone(), proxy)).await.unwrap();
        assert_ne!(r.exit_code, Some(0), "{url}: {}", r.stdout_str());
    }
    let events = s.network_events().await.unwrap();
    assert!(events
        .iter()
        .any(|e| e.host.as_deref() == Some("allowed.test") && e.allowed));
    assert!(events
        .iter()
        .any(|e| e.host.as_deref() == Some("other.test") && !e.allowed));
    s.set_network_policy(egress::allow(&["allowed.test", "other.test"]))
        .await
        .unwrap();
    let r = s
        .exec(wget(format!("http://other.test:{port}/"), true))
        .await
        .unwrap();
    assert_eq!(r.exit_code, Some(0), "after the update: {}", r.stderr_str());
    // A snapshot of it restores onto a link of the copy's own: another address, the
    // snapshot's state, the allowed host through the copy's proxy; the original goes on.
    s.write_file("before.txt", b"state").await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let store = ObjectSnapshotStore::local(dir.path()).unwrap();
    let snap = s.snapshot(&store).await.unwrap();
    let copy = b
        .restore(&store, &snap, ResolvedSecrets::none())
        .await
        .unwrap();
    assert_eq!(veth.links().await.unwrap().len(), 2, "a link of its own");
    assert_eq!(copy.read_file("before.txt").await.unwrap(), b"state");
    let r = copy.exec(wget(allowed.clone(), true)).await.unwrap();
    assert_eq!(r.exit_code, Some(0), "{}{}", r.stdout_str(), r.stderr_str());
    assert_eq!(r.stdout_str(), format!("hello allowed.test:{port}"));
    let r = copy
        .exec(wget(
            "http://169.254.169.254/latest/meta-data/".into(),
            true,
        ))
        .await
        .unwrap();
    assert_ne!(r.exit_code, Some(0), "{}", r.stdout_str());
    assert_ne!(eth0(s.as_ref()).await, eth0(copy.as_ref()).await);
    let r = s.exec(wget(allowed.clone(), true)).await.unwrap();
    assert_eq!(r.exit_code, Some(0), "the original: {}", r.stderr_str());
    copy.destroy().await.unwrap();
    s.destroy().await.unwrap();
    assert!(veth.links().await.unwrap().is_empty(), "the links are gone");
}

/// A web server in a deny-all guest (no network device), reached from the host through a
/// published port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_published_port_reaches_a_server_in_a_deny_all_guest() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let _one = linux_vm_or_skip!();
    let s = create(&shell_spec()).await;
    s.write_file("index.html", b"from the guest").await.unwrap();
    let _server = s
        .spawn(ExecRequest::argv([
            "httpd",
            "-f",
            "-p",
            "127.0.0.1:8080",
            "-h",
            "/workspace",
        ]))
        .await
        .unwrap();
    let at = s
        .publish(8080, "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let mut page = String::new();
    for _ in 0..50 {
        let mut c = tokio::net::TcpStream::connect(at).await.unwrap();
        c.write_all(b"GET /index.html HTTP/1.0\r\n\r\n")
            .await
            .unwrap();
        page.clear();
        c.read_to_string(&mut page).await.unwrap();
        if !page.is_empty() {
            break;
        }
        // The server is not up yet: the connection closed empty.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(page.ends_with("from the guest"), "{page}");
    // The guest still cannot get out.
    let r = s
        .exec(ExecRequest::code("timeout 5 wget -q -O - http://10.0.2.2/"))
        .await
        .unwrap();
    assert_ne!(r.exit_code, Some(0));
    s.destroy().await.unwrap();
    // The listener closes once its task is cancelled (the runtime's next turn).
    let mut closed = false;
    for _ in 0..250 {
        if tokio::net::TcpStream::connect(at).await.is_err() {
            closed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(closed, "still listening after destroy");
}

/// A snapshot keeps the background processes: the original's go on with their handles, and
/// a restored copy runs them on, listed and signalled (their output there is dropped: nobody
/// holds their handles).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_keeps_background_processes_in_both_copies() {
    let _one = linux_vm_or_skip!();
    let dir = tempfile::tempdir().unwrap();
    let store = ObjectSnapshotStore::local(dir.path()).unwrap();
    let s = create(&shell_spec()).await;
    let mut p = s
        .spawn(ExecRequest::code(
            "i=0; while :; do i=$((i+1)); echo $i > /workspace/n; echo tick; sleep 0.05; done",
        ))
        .await
        .unwrap();
    let id = s.snapshot(&store).await.unwrap();
    // The original's process and handle go on.
    let mut seen = String::new();
    while !seen.contains("tick") {
        match tokio::time::timeout(Duration::from_secs(30), p.next()).await {
            Ok(Some(Ok(ExecEvent::Stdout(b)))) => seen.push_str(&String::from_utf8_lossy(&b)),
            other => panic!("{other:?}"),
        }
    }
    let r = backend()
        .restore(&store, &id, ResolvedSecrets::none())
        .await
        .unwrap();
    let listed = r.processes().await.unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].state, sandbox_core::ProcessState::Running);
    let read = |d: Vec<u8>| -> u64 { String::from_utf8(d).unwrap().trim().parse().unwrap() };
    let first = read(r.read_file("n").await.unwrap());
    r.exec(ExecRequest::argv(["sleep", "0.5"])).await.unwrap();
    assert!(read(r.read_file("n").await.unwrap()) > first, "it runs on");
    r.signal(listed[0].id, sandbox_core::Signal::Kill)
        .await
        .unwrap();
    let mut ended = false;
    for _ in 0..100 {
        if r.processes().await.unwrap()[0].state != sandbox_core::ProcessState::Running {
            ended = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(ended, "the restored process did not end");
    r.destroy().await.unwrap();
    p.signal(sandbox_core::Signal::Kill).await.unwrap();
    assert_eq!(p.wait(None).await.unwrap().exit_code, Some(137));
    s.destroy().await.unwrap();
}

/// What the guest says of its `eth0` (its address among it).
async fn eth0(sb: &dyn sandbox_core::Sandbox) -> String {
    let r = sb
        .exec(ExecRequest::code(
            "ip -4 -o addr show eth0 2>/dev/null || ifconfig eth0",
        ))
        .await
        .unwrap();
    r.stdout_str()
}

/// A backend with the real enforcer, a shell spec allowing `allowed.test`, and the port of
/// the upstream server it names; `None` (saying why) when not root.
async fn allowlisted() -> Option<(
    MicrovmBackend,
    sandbox_egress::VethEnforcer,
    SandboxSpec,
    u16,
)> {
    let veth = egress::try_enforcer()?;
    let port = egress::http_server().await;
    let b = MicrovmBackend::builder()
        .guest_dir(guest_dir())
        .egress(Arc::new(veth.clone()))
        .build()
        .unwrap();
    let mut spec = shell_spec();
    spec.network = egress::allow(&["allowed.test"]);
    Some((b, veth, spec, port))
}

//! Specs: field validation, the host checks, the builder's setters and serde.

use super::*;
use crate::exec::LimitKind;

#[test]
fn proxy_held_secrets_must_be_bound_to_allowed_hosts() {
    let ok = SandboxSpec::builder(Language::Shell)
        .network(NetworkPolicy::allow_hosts(["api.github.com", "*.example.com"]).unwrap())
        .secret_via_proxy(
            "GH",
            "GITHUB_TOKEN",
            ["api.github.com", "a.example.com:443"],
        )
        .build()
        .unwrap();
    match &ok.secrets[0].exposure {
        SecretExposure::Proxy { var, hosts, .. } => {
            assert_eq!(var, "GITHUB_TOKEN");
            assert_eq!(hosts.len(), 2);
        }
        other => panic!("{other:?}"),
    }
    // Round trip through JSON, as the CLI and a server carry specs.
    let json = serde_json::to_string(&ok).unwrap();
    assert!(json.contains(r#""kind":"proxy""#), "{json}");
    assert_eq!(serde_json::from_str::<SandboxSpec>(&json).unwrap(), ok);
    let err = |b: SpecBuilder| match b.build() {
        Err(Error::InvalidSpec { field, reason }) => {
            assert_eq!(field, "secrets");
            reason
        }
        other => panic!("{other:?}"),
    };
    // Deny-all allows no host; a host outside the allowlist; a wildcard wider than it.
    let r = err(SandboxSpec::builder(Language::Shell).secret_via_proxy("GH", "T", ["x.com"]));
    assert!(r.contains("does not allow"), "{r}");
    let allow = || NetworkPolicy::allow_hosts(["api.github.com", "*.example.com"]).unwrap();
    let r = err(SandboxSpec::builder(Language::Shell)
        .network(allow())
        .secret_via_proxy("GH", "T", ["github.com"]));
    assert!(r.contains("github.com"), "{r}");
    err(SandboxSpec::builder(Language::Shell)
        .network(allow())
        .secret_via_proxy("GH", "T", ["*.github.com"]));
    err(SandboxSpec::builder(Language::Shell)
        .network(allow())
        .secret_via_proxy("GH", "T", Vec::<String>::new()));
    err(SandboxSpec::builder(Language::Shell)
        .network(allow())
        .secret_via_proxy("GH", "NOT A VAR", ["api.github.com"]));
    err(SandboxSpec::builder(Language::Shell)
        .network(allow())
        .secret_via_proxy("GH", "T", ["bad host!"]));
    // The internet policy allows any name its deny list does not name.
    SandboxSpec::builder(Language::Shell)
        .network(NetworkPolicy::AllowInternet {
            deny: vec![],
            private: vec![],
        })
        .secret_via_proxy("GH", "T", ["api.github.com"])
        .build()
        .unwrap();
}

#[test]
fn image_is_parsed_by_the_builder_and_exclusive_with_rootfs() {
    let spec = SandboxSpec::builder(Language::Python)
        .image("python:3.12-slim")
        .build();
    assert_eq!(
        spec.ok().and_then(|s| s.image).map(|r| r.to_string()),
        Some("docker.io/library/python:3.12-slim".into())
    );
    let field = |r: Result<SandboxSpec>| match r {
        Err(Error::InvalidSpec { field, reason }) => format!("{field}: {reason}"),
        other => format!("{other:?}"),
    };
    let bad = SandboxSpec::builder(Language::Python)
        .image("Bad Ref")
        .build();
    assert!(field(bad).starts_with("image: `Bad Ref`"));
    let dir = std::env::temp_dir();
    let both = SandboxSpec::builder(Language::Python)
        .image("alpine")
        .rootfs(&dir)
        .build();
    assert!(field(both).contains("exclusive"));
    let missing = SandboxSpec::builder(Language::Shell)
        .image("oci:/nonexistent/layout")
        .build()
        .and_then(|s| s.validate_on_host().map(|()| s));
    assert!(field(missing).contains("OCI image layout"));
    // A spec without an image serialises as before; with one, as its reference string.
    let plain = serde_json::to_value(SandboxSpec::new(Language::Shell)).ok();
    assert!(plain.is_some_and(|v| v.get("image").is_none()));
    let json = r#"{"language":"shell","image":"ghcr.io/o/i:1"}"#;
    let s: Option<SandboxSpec> = serde_json::from_str(json).ok();
    assert_eq!(
        s.and_then(|s| s.image).map(|r| r.to_string()),
        Some("ghcr.io/o/i:1".into())
    );
}

#[test]
fn tmpfs_caps_of_the_default_limits() {
    // 512 MiB of memory: 320 MiB of data, 65,536 inodes; each scratch mount an eighth.
    let c = Limits::default().tmpfs_caps(2, 1);
    assert_eq!(
        c.scratch,
        TmpfsCap {
            bytes: 40 << 20,
            inodes: 8192
        }
    );
    assert_eq!(
        c.disk,
        TmpfsCap {
            bytes: 240 << 20,
            inodes: 49_152
        }
    );
    // A small disk is what it asks for.
    let l = Limits {
        disk_bytes: 100 << 20,
        ..Limits::default()
    };
    let c = l.tmpfs_caps(2, 1);
    assert_eq!((c.disk.bytes, c.scratch.bytes), (100 << 20, 25 << 20));
}

#[test]
fn tmpfs_caps_never_fill_the_memory_limit() {
    for mem_mib in [4u64, 16, 64, 100, 512, 4096, 65_536] {
        for disk_mib in [1u64, 10, 256, 1024, 1 << 20] {
            for (scratch, disk) in [(1, 0), (1, 1), (2, 0), (2, 1), (2, 2)] {
                let l = Limits {
                    memory_bytes: mem_mib << 20,
                    disk_bytes: disk_mib << 20,
                    ..Limits::default()
                };
                let c = l.tmpfs_caps(scratch, disk);
                let bytes = scratch * c.scratch.bytes + disk * c.disk.bytes;
                let inodes = scratch * c.scratch.inodes + disk * c.disk.inodes;
                let worst = bytes + inodes * Limits::TMPFS_INODE_BYTES;
                // At most 3/4 of the limit, but for the floors (1 MiB and 256 inodes a
                // mount) that the smallest limits reach.
                let floors = (scratch + disk) * ((1 << 20) + 256 * Limits::TMPFS_INODE_BYTES);
                assert!(
                    worst <= (l.memory_bytes / 4 * 3).max(floors),
                    "{mem_mib} MiB / {disk_mib} MiB / {scratch}+{disk}: {c:?}"
                );
                assert!(c.disk.bytes <= l.disk_bytes.max(1 << 20));
                assert!(c.scratch.bytes >= 1 << 20 && c.scratch.inodes >= 256);
            }
        }
    }
}

#[test]
fn defaults_deny_everything() {
    let s = SandboxSpec::new(Language::Python);
    assert_eq!(s.network, NetworkPolicy::DenyAll);
    assert!(s.env.is_empty() && s.pass_env.is_empty() && s.mounts.is_empty());
    assert_eq!(s.workspace, Workspace::Empty);
    s.validate().unwrap();
    // no host variable leaks into the base env
    assert!(s.base_env().is_empty());
}

#[test]
fn pass_env_only_named() {
    let s = SandboxSpec::builder(Language::Shell)
        .pass_env("PATH")
        .build()
        .unwrap();
    let env = s.base_env();
    assert_eq!(env.len(), usize::from(std::env::var("PATH").is_ok()));
}

#[test]
fn bad_specs_name_the_field() {
    let cases: Vec<(SandboxSpec, &str)> = vec![
        (
            SandboxSpec::builder(Language::C).memory_mib(1).spec,
            "limits.memory_bytes",
        ),
        (
            SandboxSpec::builder(Language::C).env("1BAD", "x").spec,
            "env",
        ),
        (
            SandboxSpec::builder(Language::C).env("A", "x\0y").spec,
            "env",
        ),
        (
            SandboxSpec::builder(Language::C)
                .mount_ro("/", "relative")
                .spec,
            "mounts",
        ),
        (
            SandboxSpec::builder(Language::C)
                .mount_ro("/", "/a/../etc")
                .spec,
            "mounts",
        ),
        (
            SandboxSpec::builder(Language::C)
                .mount_ro("/nonexistent-xyz", "/x")
                .spec,
            "mounts",
        ),
        (
            SandboxSpec::builder(Language::C)
                .workspace_dir("/nonexistent-xyz", false)
                .spec,
            "workspace",
        ),
        (
            SandboxSpec::builder(Language::C).output_bytes(0).spec,
            "limits.output_bytes",
        ),
        (
            SandboxSpec::builder(Language::C)
                .workspace_alias("/home/user/x")
                .spec,
            "workspace_alias",
        ),
        (
            SandboxSpec::builder(Language::C)
                .workspace_alias("/home/..")
                .spec,
            "workspace_alias",
        ),
        (
            SandboxSpec::builder(Language::C)
                .workspace_alias("/etc")
                .spec,
            "workspace_alias",
        ),
        (
            SandboxSpec::builder(Language::C)
                .workspace_alias("/home/user")
                .mount_ro("/", "/home")
                .spec,
            "mounts",
        ),
        (
            SandboxSpec::builder(Language::C)
                .workspace_alias("/home/user")
                .mount_ro("/", "/home/user/data/")
                .spec,
            "mounts",
        ),
        (
            SandboxSpec::builder(Language::C)
                .secret_env("K", "bad var")
                .spec,
            "secrets",
        ),
    ];
    for (spec, field) in cases {
        match spec.validate_on_host() {
            Err(Error::InvalidSpec { field: f, .. }) => assert_eq!(f, field),
            other => panic!("expected InvalidSpec({field}), got {other:?}"),
        }
    }
}

#[test]
fn a_spec_is_valid_without_the_host_paths_it_names() {
    // Built on a client, created on a server: only the server has the paths.
    let spec = SandboxSpec::builder(Language::C)
        .mount_ro("/nonexistent-xyz", "/x")
        .workspace_dir("/nonexistent-xyz", false)
        .rootfs("/nonexistent-xyz")
        .build()
        .unwrap();
    assert!(spec.validate().is_ok());
    match spec.validate_on_host() {
        Err(Error::InvalidSpec { field, .. }) => assert_eq!(field, "rootfs"),
        other => panic!("expected the host check to refuse it, got {other:?}"),
    }
}

#[test]
fn every_limit_has_a_setter() {
    let s = SandboxSpec::builder(Language::Shell)
        .memory_bytes(64 << 20)
        .cpu_time(Duration::from_secs(5))
        .wall_time(Duration::from_secs(2))
        .lifetime(Duration::from_secs(60))
        .pids(32)
        .output_bytes(4096)
        .disk_bytes(8 << 20)
        .open_files(64)
        .fuel(Some(1_000_000))
        .cpu_millis(250)
        .build()
        .unwrap();
    let l = &s.limits;
    assert_eq!(
        (l.memory_bytes, l.cpu_time_ms, l.wall_time_ms, l.lifetime_ms),
        (64 << 20, 5000, 2000, 60_000)
    );
    assert_eq!((l.pids, l.output_bytes, l.disk_bytes), (32, 4096, 8 << 20));
    assert_eq!(
        (l.open_files, l.fuel, l.cpu_millis),
        (64, Some(1_000_000), 250)
    );
    // Each setter's impossible value is refused by `build`, naming its field.
    let b = || SandboxSpec::builder(Language::Shell);
    let bad = [
        (b().memory_bytes(1), LimitKind::Memory),
        (b().cpu_time(Duration::ZERO), LimitKind::CpuTime),
        (b().wall_time(Duration::ZERO), LimitKind::WallTime),
        (b().lifetime(Duration::from_millis(1)), LimitKind::Lifetime),
        (b().pids(0), LimitKind::Pids),
        (b().output_bytes(0), LimitKind::Output),
        (b().open_files(1), LimitKind::OpenFiles),
        (b().fuel(Some(0)), LimitKind::Fuel),
        (b().cpu_millis(1), LimitKind::CpuShare),
    ];
    for (builder, kind) in bad {
        match builder.build() {
            Err(Error::InvalidSpec { field, .. }) => assert_eq!(field, kind.field()),
            other => panic!("{kind}: expected InvalidSpec, got {other:?}"),
        }
    }
}

#[test]
fn limit_kinds_display_their_json_names() {
    for k in LimitKind::ALL {
        assert_eq!(serde_json::to_string(&k).unwrap(), format!("\"{k}\""));
    }
    assert_eq!(LimitKind::OpenFiles.to_string(), "open-files");
}

#[test]
fn serde_round_trip_and_unknown_fields_refused() {
    let s = SandboxSpec::builder(Language::Python)
        .env("A", "1")
        .secret_env("TOKEN", "API_TOKEN")
        .memory_mib(256)
        .build()
        .unwrap();
    let j = serde_json::to_string(&s).unwrap();
    assert_eq!(serde_json::from_str::<SandboxSpec>(&j).unwrap(), s);
    let minimal: SandboxSpec = serde_json::from_str(r#"{"language":"python"}"#).unwrap();
    assert_eq!(minimal, SandboxSpec::new(Language::Python));
    assert!(serde_json::from_str::<SandboxSpec>(r#"{"language":"python","netwrk":{}}"#).is_err());
}

#[test]
fn a_workspace_alias_is_one_directory_under_home() {
    for ok in ["/home/user", "/home/a.b_c-1"] {
        let spec = SandboxSpec::builder(Language::Shell)
            .workspace_alias(ok)
            .mount_ro("/", "/home/other")
            .spec;
        spec.validate().unwrap();
    }
    let long = format!("/home/{}", "a".repeat(65));
    let spec = SandboxSpec::builder(Language::Shell)
        .workspace_alias(long)
        .spec;
    assert!(spec.validate().is_err());
}

#[test]
fn the_user_is_named_after_the_workspace_alias() {
    let named = |alias: Option<&str>| {
        let mut s = SandboxSpec::new(Language::Shell);
        s.workspace_alias = alias.map(str::to_string);
        let (n, h) = s.user_name_and_home();
        (n.to_string(), h.to_string())
    };
    let pair = |n: &str, h: &str| (n.to_string(), h.to_string());
    assert_eq!(named(None), pair("sandbox", "/workspace"));
    assert_eq!(named(Some("/home/user")), pair("user", "/home/user"));
    assert_eq!(named(Some("/home/root")), pair("sandbox", "/workspace"));
    assert_eq!(named(Some("/home/My.Name")), pair("sandbox", "/workspace"));
}

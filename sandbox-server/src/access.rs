//! What of the server's host and networks a client may reach: what in a spec reaches into
//! the host ([`host_access`]), policies and registries on the server's loopback or private
//! networks, the 403 answers that refuse them, and the host's own addresses (refused to every
//! sandbox's egress at connect time).

use axum::http::StatusCode;
use sandbox_core::SandboxSpec;

use crate::error::ApiError;

/// The addresses of this host's interfaces (what a client must not reach through a public
/// address of the server itself). Empty if they cannot be listed.
pub(crate) fn own_addresses() -> Vec<std::net::IpAddr> {
    let Ok(addrs) = nix::ifaddrs::getifaddrs() else {
        tracing::warn!("cannot list this host's addresses; only loopback and private ranges are refused to clients");
        return Vec::new();
    };
    addrs
        .filter_map(|a| {
            let sa = a.address?;
            if let Some(v4) = sa.as_sockaddr_in() {
                return Some(std::net::IpAddr::V4(v4.ip()));
            }
            sa.as_sockaddr_in6().map(|v6| std::net::IpAddr::V6(v6.ip()))
        })
        .collect()
}

/// What in `spec` reaches into the server's host (see
/// [`ServerConfig::allow_host_access`](crate::ServerConfig::allow_host_access)), named;
/// `None` when nothing does.
pub fn host_access(spec: &SandboxSpec) -> Option<&'static str> {
    if spec.rootfs.is_some() {
        return Some("`rootfs` (a directory of the server's host)");
    }
    if !spec.mounts.is_empty() {
        return Some("`mounts` (paths of the server's host)");
    }
    if !matches!(spec.workspace, sandbox_core::Workspace::Empty) {
        return Some("a host-directory `workspace`");
    }
    if !spec.pass_env.is_empty() {
        return Some("`pass_env` (the server's environment)");
    }
    if !spec.secrets.is_empty() {
        return Some("`secrets` (resolved from the server's secret source)");
    }
    if matches!(
        spec.image,
        Some(
            sandbox_core::ImageRef::OciLayout { .. } | sandbox_core::ImageRef::DockerArchive { .. }
        )
    ) {
        return Some("an image from a local path (`oci:` or `docker-archive:`)");
    }
    None
}

/// Refuses a client's spec that reaches into the server's host (unless
/// [`allow_host_access`](crate::ServerConfig::allow_host_access)) or its loopback and private
/// networks (unless [`allow_private_networks`](crate::ServerConfig::allow_private_networks)):
/// 403, naming what and the flag that grants it. `snapshot`: the spec is a snapshot's.
pub(crate) fn check_spec(
    config: &crate::ServerConfig,
    spec: &sandbox_core::SandboxSpec,
    snapshot: bool,
) -> Result<(), ApiError> {
    if let (false, Some(what)) = (config.allow_host_access, host_access(spec)) {
        return Err(if snapshot {
            forbidden(&format!("this snapshot's spec has {what}, which"))
        } else {
            forbidden(what)
        });
    }
    check_network(config, &spec.network)?;
    if let Some(sandbox_core::ImageRef::Registry { registry, .. }) = &spec.image {
        check_registry(config, registry)?;
    }
    Ok(())
}

/// Refuses a registry a client names on the server's own networks: a link-local one always
/// (the metadata endpoint), a loopback or private one unless the operator granted private
/// networks (else any client could make the server send requests to its loopback services).
/// Names are judged as written: a name that resolves into private space is not caught here.
fn check_registry(config: &crate::ServerConfig, registry: &str) -> Result<(), ApiError> {
    let host = match registry.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(rest),
        None => registry.rsplit_once(':').map_or(registry, |(h, _)| h),
    };
    let refusal = |why: String| {
        ApiError::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            format!("the image's registry `{registry}` is {why}"),
        )
    };
    // `localhost.` and `127.0.0.1.` are the same hosts to a resolver.
    let host = host.strip_suffix('.').unwrap_or(host);
    let local_name =
        host.eq_ignore_ascii_case("localhost") || host.to_ascii_lowercase().ends_with(".localhost");
    // A name whose last label is a number is an address in another spelling (`127.1`,
    // `2130706433`, `0x7f.0.0.1`): HTTP clients dial it as one. No registry is named so.
    let last = host.rsplit('.').next().unwrap_or(host);
    let numeric = !last.is_empty()
        && (last.bytes().all(|b| b.is_ascii_digit())
            || last
                .strip_prefix("0x")
                .or_else(|| last.strip_prefix("0X"))
                .is_some_and(|h| h.bytes().all(|b| b.is_ascii_hexdigit())));
    if numeric && host.parse::<std::net::IpAddr>().is_err() {
        return Err(refusal(
            "an address in a non-canonical spelling: name a registry by its host name or \
             its address written as a.b.c.d"
                .into(),
        ));
    }
    if let Ok(ip) = host.parse::<std::net::IpAddr>() {
        if let Some(rule) = sandbox_core::policy::always_refused(ip) {
            return Err(refusal(format!("refused: {rule}")));
        }
        if !config.allow_private_networks {
            if let Some(what) = sandbox_core::ServerNetworks::default().refuses(ip) {
                return Err(refusal(format!(
                    "{what}: the server's loopback and private networks are not granted to \
                     API clients (start the server with --allow-private-networks to grant them)"
                )));
            }
        }
    } else if local_name && !config.allow_private_networks {
        return Err(refusal(
            "the server's loopback: not granted to API clients (start the server with \
             --allow-private-networks to grant it)"
                .into(),
        ));
    }
    Ok(())
}

/// Refuses a network policy that lists a range inside loopback or private space, unless the
/// operator granted them ([`allow_private_networks`](crate::ServerConfig::allow_private_networks)).
/// (What a policy cannot list, the host's own addresses and names resolving into those
/// ranges, the egress proxy refuses at connect time: [`sandbox_core::ServerNetworks`].)
pub(crate) fn check_network(
    config: &crate::ServerConfig,
    policy: &sandbox_core::NetworkPolicy,
) -> Result<(), ApiError> {
    if config.allow_private_networks {
        return Ok(());
    }
    match policy.private_ranges_listed() {
        Some(range) => Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            format!(
                "the network policy lists {range}: the server's loopback and private networks \
                 are not granted to API clients (start the server with \
                 --allow-private-networks to grant them)"
            ),
        )),
        None => Ok(()),
    }
}

pub(crate) fn forbidden(what: &str) -> ApiError {
    ApiError::new(
        StatusCode::FORBIDDEN,
        "forbidden",
        format!(
            "{what} is not granted to API clients: a token grants sandboxes, not the \
             server's host (start the server with --allow-host-access to grant it)"
        ),
    )
}

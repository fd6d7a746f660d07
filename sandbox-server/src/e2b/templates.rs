//! E2B templates: what a template name in `Sandbox.create("NAME")` starts. The operator
//! names them (`serve --template NAME=IMAGE[,tier=T][,memory=MIB][,cpus=N]`); `base`, the
//! SDKs' default, is built in (the tier's own userland: the host's tools, read-only, on the
//! container and gVisor tiers) unless the operator names another `base`.

use std::str::FromStr;
use std::time::Duration;

use sandbox_core::{ImageRef, Language, NetworkPolicy, SandboxSpec, Tier};

/// A template: a name, what its sandboxes start from, on which tier, how big.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Template {
    /// The name clients give (`Sandbox.create("NAME")`); also its id.
    pub name: String,
    /// The OCI image its sandboxes start from; `None`: the tier's own userland.
    pub image: Option<ImageRef>,
    /// The tier; `None`: the selector's choice for shell commands on this host.
    pub tier: Option<Tier>,
    /// Memory of each sandbox, MiB (`None`: the library's default).
    pub memory_mib: Option<u64>,
    /// CPUs of each sandbox (`None`: one).
    pub cpus: Option<u32>,
    /// The home of E2B's commands and relative paths, as the operator named it; `None`:
    /// `/home/user` (E2B's) on tiers that can show the workspace there, else `/workspace` (see
    /// [`home`](Self::home)). A home `/home/NAME` is the workspace itself, shown there
    /// ([`SandboxSpec::workspace_alias`]) on tiers that can; `/workspace` is the workspace
    /// alone; any other directory the operator names (or `/home/NAME` on a tier without
    /// aliases) is made at create, as the sandbox's user, where its root lets it (an
    /// image's, not a read-only host-tools root).
    pub home: Option<String>,
}

/// E2B's home directory, which programs written for it name: every template's unless the
/// operator says otherwise.
pub const E2B_HOME: &str = "/home/user";

/// Why a template could not be read from its text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("template `{text}`: {why} (the form: NAME=IMAGE[,tier=T][,memory=MIB][,cpus=N][,home=DIR], IMAGE `-` for the tier's own userland, DIR `/home/user` unless given)")]
pub struct TemplateError {
    text: String,
    why: String,
}

impl Template {
    /// A template `name` of the tier's own userland, on the selector's tier.
    pub fn new(name: impl Into<String>) -> Self {
        Template {
            name: name.into(),
            image: None,
            tier: None,
            memory_mib: None,
            cpus: None,
            home: None,
        }
    }

    /// The built-in `base`.
    pub fn base() -> Self {
        Template::new("base")
    }

    /// The spec of a sandbox of this template, with a client's environment and network
    /// policy. Commands run as E2B's do (`/bin/bash -l -c`), so the language is the shell;
    /// a sandbox lives as long as its timeout says (the library's own lifetime limit is set
    /// to E2B's longest, a day).
    /// `alias`: whether the tier shows the workspace at a second path (then a home
    /// `/home/NAME` is the workspace's alias).
    pub(crate) fn spec(
        &self,
        env: &std::collections::BTreeMap<String, String>,
        network: NetworkPolicy,
        alias: bool,
    ) -> sandbox_core::Result<SandboxSpec> {
        let mut b = SandboxSpec::builder(Language::Shell)
            .lifetime(Duration::from_secs(24 * 3600))
            .network(network);
        if alias && self.home_is_alias() {
            b = b.workspace_alias(self.home());
        }
        if let Some(image) = &self.image {
            b = b.image(image.to_string());
        }
        if let Some(m) = self.memory_mib {
            b = b.memory_mib(m);
        }
        if let Some(c) = self.cpus {
            b = b.cpu_millis(c.saturating_mul(1000));
        }
        for (k, v) in env {
            b = b.env(k, v);
        }
        b.build()
    }

    /// The home its sandboxes should have: the operator's, or E2B's.
    pub fn home(&self) -> &str {
        self.home.as_deref().unwrap_or(E2B_HOME)
    }

    /// Whether the home has the form of a workspace alias (`/home/NAME`).
    fn home_is_alias(&self) -> bool {
        let mut probe = SandboxSpec::new(Language::Shell);
        probe.workspace_alias = Some(self.home().to_string());
        probe.validate().is_ok()
    }
}

impl FromStr for Template {
    type Err = TemplateError;

    fn from_str(text: &str) -> Result<Self, TemplateError> {
        let err = |why: String| TemplateError {
            text: text.to_string(),
            why,
        };
        let (name, rest) = text
            .split_once('=')
            .ok_or_else(|| err("no `=` after the name".into()))?;
        if name.is_empty()
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.:/".contains(&b))
        {
            return Err(err(
                "a name is letters, digits and `-_.:/`, at least one".into()
            ));
        }
        let mut parts = rest.split(',');
        let image = parts.next().unwrap_or("");
        let mut t = Template::new(name);
        t.image = match image {
            "" => return Err(err("no image (`-` for the tier's own userland)".into())),
            "-" => None,
            i => Some(ImageRef::parse(i).map_err(|e| err(e.to_string()))?),
        };
        for p in parts {
            let (k, v) = p
                .split_once('=')
                .ok_or_else(|| err(format!("`{p}` is not KEY=VALUE")))?;
            match k {
                "tier" => t.tier = Some(v.parse().map_err(|e| err(format!("{e}")))?),
                "memory" => {
                    t.memory_mib = Some(
                        v.parse()
                            .ok()
                            .filter(|m| *m > 0)
                            .ok_or_else(|| err(format!("memory `{v}` is not a number of MiB")))?,
                    )
                }
                "cpus" => {
                    t.cpus = Some(
                        v.parse()
                            .ok()
                            .filter(|c| (1..=64).contains(c))
                            .ok_or_else(|| err(format!("cpus `{v}` is not 1 to 64")))?,
                    )
                }
                "home" => {
                    if !v.starts_with('/') || v.contains('\0') || v.split('/').any(|p| p == "..") {
                        return Err(err(format!("home `{v}` is not an absolute path")));
                    }
                    let v = v.trim_end_matches('/');
                    t.home = Some(if v.is_empty() { "/" } else { v }.to_string());
                }
                _ => return Err(err(format!("unknown key `{k}`"))),
            }
        }
        Ok(t)
    }
}

/// The template `e2b-code-interpreter`'s SDKs create by default.
pub const CODE_INTERPRETER: &str = "code-interpreter-v1";

/// The templates a server offers: the operator's, `base` unless they named one, and
/// [`CODE_INTERPRETER`] (the same as `base`) unless they named one.
#[derive(Debug, Clone)]
pub(crate) struct Templates(Vec<Template>);

impl Templates {
    pub(crate) fn new(mut list: Vec<Template>) -> Self {
        if !list.iter().any(|t| t.name == "base") {
            list.insert(0, Template::base());
        }
        if !list.iter().any(|t| t.name == CODE_INTERPRETER) {
            if let Some(base) = list.iter().find(|t| t.name == "base") {
                let mut ci = base.clone();
                ci.name = CODE_INTERPRETER.into();
                list.push(ci);
            }
        }
        Templates(list)
    }

    /// The template named `name` (a trailing `:tag`, as E2B's `name:tag`, is part of the
    /// name if the operator gave one, else ignored).
    pub(crate) fn find(&self, name: &str) -> Option<&Template> {
        self.0.iter().find(|t| t.name == name).or_else(|| {
            let bare = name.split_once(':').map_or(name, |(n, _)| n);
            self.0.iter().find(|t| t.name == bare)
        })
    }

    pub(crate) fn names(&self) -> Vec<&str> {
        self.0.iter().map(|t| t.name.as_str()).collect()
    }

    pub(crate) fn all(&self) -> &[Template] {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_parse_and_refuse_what_they_cannot_mean() {
        let t: Template = "py=docker.io/library/python:3.12,tier=gvisor,memory=1024"
            .parse()
            .unwrap();
        assert_eq!(t.name, "py");
        assert_eq!(t.tier, Some(Tier::Gvisor));
        assert_eq!(t.memory_mib, Some(1024));
        assert!(t.image.is_some());
        let host: Template = "base=-".parse().unwrap();
        assert_eq!(host.image, None);
        let home: Template = "h=-,home=/home/agent/".parse().unwrap();
        assert_eq!(home.home(), "/home/agent");
        let plain: Template = "h=-".parse().unwrap();
        assert_eq!((plain.home.as_deref(), plain.home()), (None, E2B_HOME));
        for bad in [
            "noequals",
            "=img",
            "x=",
            "x=-,tier=nope",
            "x=-,memory=0",
            "x=-,gpu=1",
            "a b=-",
        ] {
            let e = bad.parse::<Template>().unwrap_err().to_string();
            assert!(e.contains("the form: NAME=IMAGE"), "{bad}: {e}");
        }
    }

    #[test]
    fn base_is_built_in_unless_the_operator_names_one() {
        let t = Templates::new(vec!["py=-".parse().unwrap()]);
        assert_eq!(t.names(), ["base", "py", CODE_INTERPRETER]);
        assert!(t.find("py:latest").is_some());
        assert!(t.find("nope").is_none());
        let own = Templates::new(vec!["base=-,tier=gvisor".parse().unwrap()]);
        assert_eq!(own.find("base").unwrap().tier, Some(Tier::Gvisor));
        assert_eq!(own.all().len(), 2);
        // The code interpreter's template is the operator's `base`, unless they name it.
        assert_eq!(own.find(CODE_INTERPRETER).unwrap().tier, Some(Tier::Gvisor));
        let named = Templates::new(vec![format!("{CODE_INTERPRETER}=-,tier=container")
            .parse()
            .unwrap()]);
        assert_eq!(
            named.find(CODE_INTERPRETER).unwrap().tier,
            Some(Tier::Container)
        );
        assert_eq!(named.all().len(), 2);
    }
}

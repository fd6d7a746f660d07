//! Root-filesystem templates: whether a spec can start from one, the ops that build one (run
//! by the zygote), and the setup of a sandbox that starts from one.

use sandbox_core::{Result, SandboxSpec};

use super::host::host_ops_at;
use super::{
    check_mounts, finish, first_ops, freeze_home, sandbox_mounts, skeleton, tmpfs, write_etc, Plan,
    Roots, Setup, ATTR_RDONLY, MS_NODEV, MS_NOSUID, ROOT_TMPFS,
};
use crate::proto::Op;

/// Whether a sandbox of this spec can start from a root-filesystem template: a host-tools
/// root with no spec mounts (their mount points would have to be made in the shared,
/// read-only root). Template-mode inits live in the zygote's own mount namespace, a copy of
/// the host's that may lag behind it, so a host-directory workspace must reach them as a
/// detached mount the library made from its current view ([`template_plan`] expects it as
/// the setup message's first fd).
pub(crate) fn template_fits(spec: &SandboxSpec) -> bool {
    !crate::own_root(spec) && spec.mounts.is_empty()
}

/// A root-filesystem template at `root` (built once by the zygote, as root, in its own mount
/// namespace, where the host's root is `/`): a read-only tmpfs holding everything of the
/// host-tools root that is the same for every sandbox with these `/etc` files — `/usr` and
/// the `bin`/`lib*` links, `/etc`, `/dev` with its nodes, and the mount points. A sandbox
/// clones it with one recursive bind ([`template_plan`]) instead of ~100 operations.
pub(crate) fn template_ops(root: &str, etc: Vec<(&'static str, String)>) -> Vec<Op> {
    let r = Roots { new: root, old: "" };
    let mut ops = vec![
        Op::Mkdir {
            path: root.into(),
            mode: 0o755,
        },
        tmpfs(root, MS_NOSUID | MS_NODEV, ROOT_TMPFS),
    ];
    ops.extend(host_ops_at(r));
    write_etc(&mut ops, r, etc);
    skeleton(&mut ops, r, true);
    ops.push(Op::SetAttr {
        path: root.into(),
        set: ATTR_RDONLY,
        clear: 0,
        recursive: false,
    });
    ops
}

/// The setup of a sandbox whose root is the template at `root` (see [`template_fits`]): its
/// own clone of the template (the template's mounts arrive locked, so they stay read-only),
/// its own mounts on it, then the usual finish. The host's root stays `/` until the pivot.
pub(crate) fn template_plan(p: &Plan<'_>, root: &str) -> Result<Setup> {
    check_mounts(p.spec)?;
    let r = Roots { new: root, old: "" };
    let mut ops = first_ops();
    ops.push(Op::Bind {
        src: root.into(),
        dst: root.into(),
    });
    sandbox_mounts(&mut ops, r, p, true, false)?;
    freeze_home(&mut ops, r, p.spec);
    finish(&mut ops, p, root, &[]);
    Ok(Setup {
        prep: Vec::new(),
        main: ops,
    })
}

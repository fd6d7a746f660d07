//! Limits, the network and isolation rules for untrusted code.

use std::time::Duration;

use sandbox_core::{ExecRequest, LimitKind};

use super::{expect, run};
use crate::{Checked, Ctx};

/// A bound on calls that must end by a limit, so that a tier that does not stop them fails
/// the case instead of hanging the suite. Never asserted on.
const BOUND: Duration = Duration::from_secs(30);

async fn hit(
    cx: &Ctx<'_>,
    spec: sandbox_core::SpecBuilder,
    code: String,
    timeout: Duration,
    kind: LimitKind,
    extra: impl FnOnce(&sandbox_core::ExecResult) -> bool + Send,
) -> Checked {
    let sb = cx.create(spec).await?;
    let r = async {
        let r = run(
            sb.as_ref(),
            kind.name(),
            ExecRequest::code(code).timeout(timeout),
        )
        .await?;
        expect(
            r.limit == Some(kind) && !r.success() && extra(&r),
            &format!("the {kind} limit"),
            &r,
        )
    }
    .await;
    cx.finish(sb, r).await
}

pub(super) async fn wall_time(cx: &Ctx<'_>) -> Checked {
    let code = cx.code("sleep 60", "while True:\n    pass");
    hit(
        cx,
        cx.spec(),
        code,
        Duration::from_millis(1500),
        LimitKind::WallTime,
        |r| r.exit_code == Some(137),
    )
    .await
}

pub(super) async fn memory(cx: &Ctx<'_>) -> Checked {
    // 64 MiB allowed, 512 MiB written (touched, so that it is really used).
    let code = cx.code(
        "dd if=/dev/zero of=/dev/null bs=512M count=1",
        "b = b'x' * (512 << 20)\nprint(len(b))",
    );
    hit(
        cx,
        cx.spec().memory_mib(64),
        code,
        BOUND,
        LimitKind::Memory,
        |_| true,
    )
    .await
}

pub(super) async fn output(cx: &Ctx<'_>) -> Checked {
    let code = cx.code("yes", "while True:\n    print('y' * 1000)");
    hit(
        cx,
        cx.spec().output_bytes(4096),
        code,
        BOUND,
        LimitKind::Output,
        |r| r.truncated && r.stdout.len() <= 4096,
    )
    .await
}

pub(super) async fn pids(cx: &Ctx<'_>) -> Checked {
    hit(
        cx,
        cx.spec().pids(32),
        "f() { f | f & }; f; sleep 3; exit 1".into(),
        BOUND,
        LimitKind::Pids,
        |_| true,
    )
    .await
}

pub(super) async fn disk(cx: &Ctx<'_>) -> Checked {
    let code = cx.code(
        "head -c 40000000 /dev/zero > big",
        "with open('big', 'wb') as f:\n    for _ in range(40):\n        _ = f.write(bytes(1 << 20))",
    );
    hit(
        cx,
        cx.spec().disk_bytes(8 << 20),
        code,
        BOUND,
        LimitKind::Disk,
        |_| true,
    )
    .await
}

/// Checks the routing table first and connects only when it shows no way out (a tier with a
/// route fails without a packet sent). Exit 0: no route and the metadata address refused.
const DENY_SH: &str = r#"
if [ -r /proc/net/route ]; then
  routes=$(tail -n +2 /proc/net/route | grep -cv '^lo')
  [ "$routes" -eq 0 ] || { echo "ipv4 routes: $routes"; cat /proc/net/route; exit 3; }
fi
if [ -r /proc/net/ipv6_route ]; then
  routes=$(grep -cv ' lo$' /proc/net/ipv6_route)
  [ "$routes" -eq 0 ] || { echo "ipv6 routes: $routes"; exit 3; }
fi
if command -v python3 >/dev/null; then
  exec python3 -c 'import socket
s = socket.socket(); s.settimeout(3)
try:
    s.connect(("169.254.169.254", 80)); print("connected"); raise SystemExit(4)
except OSError as e:
    print("refused:", e)'
fi
if command -v nc >/dev/null; then
  if nc -w 3 169.254.169.254 80 </dev/null; then echo connected; exit 4; fi
fi
echo no-route
"#;

const DENY_PY: &str = r#"
import os, socket, sys
def routes(path, skip):
    with open(path) as f:
        return [l for l in f.read().splitlines()[skip:] if l.strip() and not l.startswith('lo') and not l.endswith(' lo')]
for path, skip in (('/proc/net/route', 1), ('/proc/net/ipv6_route', 0)):
    if os.path.exists(path):
        r = routes(path, skip)
        if r:
            print('routes:', r); sys.exit(3)
try:
    s = socket.socket(); s.settimeout(3)
    s.connect(('169.254.169.254', 80))
    print('connected'); sys.exit(4)
except (OSError, AttributeError) as e:
    print('refused:', e)
"#;

pub(super) async fn deny_all(cx: &Ctx<'_>) -> Checked {
    let code = cx.code(DENY_SH, DENY_PY);
    let sb = cx.create(cx.spec()).await?;
    let r = async {
        let r = run(
            sb.as_ref(),
            "network",
            ExecRequest::code(code).timeout(BOUND),
        )
        .await?;
        expect(
            r.success() && !r.stdout_str().contains("connected"),
            "no route out and 169.254.169.254 refused",
            &r,
        )
    }
    .await;
    cx.finish(sb, r).await
}

pub(super) async fn no_userns(cx: &Ctx<'_>) -> Checked {
    // `unshare -r` (util-linux) or, without it, the raw system call through Python.
    let code = r#"
if command -v unshare >/dev/null; then
  if unshare -r true 2>/dev/null; then echo "unshare -r: allowed"; exit 3; fi
fi
if command -v python3 >/dev/null; then
  python3 -c 'import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.unshare(0x10000000) == 0:
    print("unshare(CLONE_NEWUSER): allowed"); sys.exit(3)
pid = libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0)
if pid == 0:
    os._exit(0)
if pid > 0:
    os.waitpid(pid, 0); print("clone(CLONE_NEWUSER): allowed"); sys.exit(3)
print("refused:", os.strerror(ctypes.get_errno()))' || exit $?
fi
echo refused
"#;
    let sb = cx.create(cx.spec()).await?;
    let r = async {
        let r = run(sb.as_ref(), "user namespace", ExecRequest::code(code)).await?;
        expect(
            r.success() && !r.stdout_str().contains("allowed"),
            "creating a user namespace refused",
            &r,
        )?;
        // The same program started directly (argv), not from a shell: refused, or absent.
        let r = run(
            sb.as_ref(),
            "unshare as argv",
            ExecRequest::argv(["unshare", "-r", "true"]),
        )
        .await?;
        expect(
            r.exit_code != Some(0),
            "`unshare -r true` as argv refused",
            &r,
        )
    }
    .await;
    cx.finish(sb, r).await
}

//! Exit codes, standard streams, devices, environment and working directory.

use sandbox_core::{ExecEvent, ExecRequest, Language};

use super::{expect, run};
use crate::{Checked, Ctx, SECRET_NAME, SECRET_VALUE};

/// Runs one code string in a fresh default sandbox and hands the result to `judge`.
async fn one(
    cx: &Ctx<'_>,
    what: &str,
    req: ExecRequest,
    judge: impl FnOnce(&sandbox_core::ExecResult) -> Checked + Send,
) -> Checked {
    let sb = cx.create(cx.spec()).await?;
    let r = match run(sb.as_ref(), what, req).await {
        Ok(r) => judge(&r),
        Err(e) => Err(e),
    };
    cx.finish(sb, r).await
}

pub(super) async fn exit_zero(cx: &Ctx<'_>) -> Checked {
    let code = cx.code("exit 0", "import sys; sys.exit(0)");
    one(cx, "exit 0", ExecRequest::code(code), |r| {
        expect(r.exit_code == Some(0) && r.success(), "exit 0", r)
    })
    .await
}

pub(super) async fn exit_one(cx: &Ctx<'_>) -> Checked {
    let code = cx.code("exit 1", "import sys; sys.exit(1)");
    one(cx, "exit 1", ExecRequest::code(code), |r| {
        expect(
            r.exit_code == Some(1) && r.limit.is_none() && !r.success(),
            "exit 1",
            r,
        )
    })
    .await
}

/// Whether argv names programs on the `PATH` (a Linux userland) rather than workspace
/// `.wasm` modules.
fn userland(cx: &Ctx<'_>) -> bool {
    cx.caps.supports_language(Language::Shell)
}

pub(super) async fn not_found(cx: &Ctx<'_>) -> Checked {
    let prog = if userland(cx) {
        "conformance-no-such-command"
    } else {
        "conformance-no-such-module.wasm"
    };
    one(cx, "missing command", ExecRequest::argv([prog]), |r| {
        expect(r.exit_code == Some(127), "a missing command", r)
    })
    .await?;
    // A name that is not a module on a tier without a userland is "not found" too, not a
    // refusal of argv (which the tier claims).
    if !userland(cx) {
        one(
            cx,
            "missing program",
            ExecRequest::argv(["conformance-no-such-command"]),
            |r| expect(r.exit_code == Some(127), "a missing program", r),
        )
        .await?;
    }
    Ok(())
}

pub(super) async fn not_executable(cx: &Ctx<'_>) -> Checked {
    let sb = cx.create(cx.spec()).await?;
    let r = async {
        let (file, data, argv): (&str, &[u8], &str) = if userland(cx) {
            ("notexec.sh", b"#!/bin/sh\necho ran\n", "./notexec.sh")
        } else {
            ("notexec.wasm", b"#!/bin/sh\necho ran\n", "notexec.wasm")
        };
        sb.write_file(file, data)
            .await
            .map_err(|e| format!("write_file {file}: {e}"))?;
        let r = run(sb.as_ref(), "not executable", ExecRequest::argv([argv])).await?;
        expect(
            r.exit_code == Some(126) && !r.stdout_str().contains("ran"),
            "a file without exec permission (or not a module)",
            &r,
        )
    }
    .await;
    cx.finish(sb, r).await
}

pub(super) async fn killed(cx: &Ctx<'_>) -> Checked {
    one(cx, "kill -9", ExecRequest::code("kill -9 $$"), |r| {
        expect(r.exit_code == Some(137), "a command killed by SIGKILL", r)
    })
    .await
}

pub(super) async fn separate(cx: &Ctx<'_>) -> Checked {
    let code = cx.code(
        "printf out1; printf err >&2; printf out2",
        "import sys\n_ = sys.stdout.write('out1'); sys.stdout.flush()\n_ = sys.stderr.write('err'); sys.stderr.flush()\n_ = sys.stdout.write('out2')",
    );
    one(cx, "two streams", ExecRequest::code(code), |r| {
        expect(
            r.success() && r.stdout == b"out1out2" && r.stderr == b"err",
            "stdout `out1out2` and stderr `err`",
            r,
        )
    })
    .await
}

pub(super) async fn stdin(cx: &Ctx<'_>) -> Checked {
    let code = cx.code("cat", "import sys; _ = sys.stdout.write(sys.stdin.read())");
    let input = "h\u{e9}llo\nsecond line\n";
    let sb = cx.create(cx.spec()).await?;
    let r = async {
        let r = run(sb.as_ref(), "stdin", ExecRequest::code(&code).stdin(input)).await?;
        expect(
            r.success() && r.stdout_str() == input,
            "stdin echoed back",
            &r,
        )?;
        let r = run(sb.as_ref(), "no stdin", ExecRequest::code(&code)).await?;
        expect(r.success() && r.stdout.is_empty(), "no stdin reads EOF", &r)
    }
    .await;
    cx.finish(sb, r).await
}

pub(super) async fn devices(cx: &Ctx<'_>) -> Checked {
    let code = cx.code(
        "printf x > /dev/null && test -z \"$(cat /dev/null)\" \
         && test \"$(head -c 4 /dev/zero | od -An -tx1 | tr -d ' \\n')\" = 00000000 \
         && test \"$(head -c 16 /dev/urandom | wc -c)\" -eq 16 && echo ok",
        "import os\n\
         with open(os.devnull, 'w') as f: _ = f.write('x')\n\
         assert open(os.devnull, 'rb').read() == b''\n\
         assert open('/dev/zero', 'rb').read(4) == bytes(4)\n\
         a = open('/dev/urandom', 'rb').read(16); b = open('/dev/urandom', 'rb').read(16)\n\
         assert len(a) == 16 and a != b\n\
         print('ok')",
    );
    one(cx, "devices", ExecRequest::code(code), |r| {
        expect(
            r.success() && r.stdout_str() == "ok\n",
            "the three devices",
            r,
        )
    })
    .await
}

/// Host variables that a sandbox may legitimately have with the same value.
const COMMON: &[&str] = &[
    "PATH", "HOME", "PWD", "OLDPWD", "SHLVL", "_", "LANG", "LC_ALL", "LC_CTYPE", "TERM", "USER",
    "LOGNAME", "HOSTNAME", "TMPDIR", "TZ", "SHELL",
];

pub(super) async fn env_only(cx: &Ctx<'_>) -> Checked {
    let code = cx.code(
        "env",
        "import os\nfor k, v in sorted(os.environ.items()): print(f'{k}={v}')",
    );
    let sb = cx.create(cx.spec().env("CONF_SPEC", "from-spec")).await?;
    let r = async {
        let r = run(
            sb.as_ref(),
            "env",
            ExecRequest::code(&code).env("CONF_CALL", "from-call"),
        )
        .await?;
        expect(r.success(), "listing the environment", &r)?;
        let out = r.stdout_str();
        let lines: Vec<&str> = out.lines().collect();
        for want in ["CONF_SPEC=from-spec", "CONF_CALL=from-call"] {
            if !lines.contains(&want) {
                return Err(format!("`{want}` missing inside: {}", super::clip(&out)));
            }
        }
        let leaked: Vec<String> = std::env::vars()
            .filter(|(k, v)| !COMMON.contains(&k.as_str()) && v.len() >= 3)
            .map(|(k, v)| format!("{k}={v}"))
            .filter(|kv| lines.contains(&kv.as_str()))
            .collect();
        if leaked.is_empty() {
            Ok(())
        } else {
            Err(format!("host variables leaked in: {leaked:?}"))
        }
    }
    .await;
    cx.finish(sb, r).await
}

pub(super) async fn secret_redacted(cx: &Ctx<'_>) -> Checked {
    let code = cx.code(
        &format!(
            "printf '%s\\n' \"$CONF_TOKEN\"; printf '%s\\n' \"$CONF_TOKEN\" >&2; \
             test \"$CONF_TOKEN\" = '{SECRET_VALUE}'"
        ),
        &format!(
            "import os, sys\nv = os.environ.get('CONF_TOKEN', '')\nprint(v)\n\
             print(v, file=sys.stderr)\nsys.exit(0 if v == '{SECRET_VALUE}' else 3)"
        ),
    );
    let sb = cx
        .create(cx.spec().secret_env(SECRET_NAME, "CONF_TOKEN"))
        .await?;
    let r = async {
        let r = run(sb.as_ref(), "secret", ExecRequest::code(&code)).await?;
        expect(r.success(), "the secret's value inside", &r)?;
        let (out, err) = (r.stdout_str(), r.stderr_str());
        if out.contains(SECRET_VALUE) || err.contains(SECRET_VALUE) {
            return Err("the secret's value is in the captured output".into());
        }
        expect(
            out.contains("[REDACTED") && err.contains("[REDACTED"),
            "the secret redacted in both streams",
            &r,
        )
    }
    .await;
    cx.finish(sb, r).await
}

pub(super) async fn secret_redacted_stream(cx: &Ctx<'_>) -> Checked {
    // The value in two writes with a pause between: two chunks, the secret split across.
    let code = cx.code(
        "v=\"$CONF_TOKEN\"; printf %s \"${v%????}\"; sleep 0.2; printf '%s\\n' \"${v#${v%????}}\"; \
         printf '%s\\n' \"$v\" >&2",
        "import os, sys, time\nv = os.environ.get('CONF_TOKEN', '')\n\
         sys.stdout.write(v[:-4]); sys.stdout.flush(); time.sleep(0.2)\n\
         print(v[-4:], flush=True)\nprint(v, file=sys.stderr, flush=True)",
    );
    let sb = cx
        .create(cx.spec().secret_env(SECRET_NAME, "CONF_TOKEN"))
        .await?;
    let r = async {
        let mut s = sb
            .exec_stream(ExecRequest::code(&code))
            .await
            .map_err(|e| format!("exec_stream: {e}"))?;
        let mut all = Vec::new();
        while let Some(ev) = s.next().await {
            match ev.map_err(|e| format!("stream error: {e}"))? {
                ExecEvent::Stdout(b) | ExecEvent::Stderr(b) => all.extend_from_slice(&b),
                _ => {}
            }
        }
        let all = String::from_utf8_lossy(&all);
        if all.contains(SECRET_VALUE) || all.contains(&SECRET_VALUE[..SECRET_VALUE.len() - 4]) {
            return Err(format!(
                "the secret's value (or its start) was streamed: {all:?}"
            ));
        }
        if all.matches("[REDACTED").count() == 2 {
            Ok(())
        } else {
            Err(format!(
                "streamed {all:?}, not the secret redacted in both streams"
            ))
        }
    }
    .await;
    cx.finish(sb, r).await
}

pub(super) async fn cwd_default(cx: &Ctx<'_>) -> Checked {
    let code = cx.code("pwd", "import os; print(os.getcwd())");
    one(cx, "pwd", ExecRequest::code(code), |r| {
        expect(
            r.success() && r.stdout_str() == "/workspace\n",
            "the default working directory",
            r,
        )
    })
    .await
}

pub(super) async fn cwd_request(cx: &Ctx<'_>) -> Checked {
    let code = cx.code("pwd", "import os; print(os.getcwd())");
    let sb = cx.create(cx.spec()).await?;
    let r = async {
        sb.write_file("sub/dir/keep", b"")
            .await
            .map_err(|e| format!("write_file: {e}"))?;
        let r = run(
            sb.as_ref(),
            "pwd in sub/dir",
            ExecRequest::code(&code).cwd("/workspace/sub/dir"),
        )
        .await?;
        expect(
            r.success() && r.stdout_str() == "/workspace/sub/dir\n",
            "the call's working directory",
            &r,
        )?;
        // The next call without one is back in /workspace.
        let r = run(sb.as_ref(), "pwd", ExecRequest::code(&code)).await?;
        expect(
            r.success() && r.stdout_str() == "/workspace\n",
            "the default working directory after a call with another",
            &r,
        )
    }
    .await;
    cx.finish(sb, r).await
}

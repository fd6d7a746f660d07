//! Lifecycle and the truth of `capabilities()`: what a tier claims works, what it does not
//! claim is `Unsupported`.

use std::time::Duration;

use sandbox_core::{
    Error, ExecEvent, ExecRequest, Language, NetworkMode, NetworkPolicy, ObjectSnapshotStore,
    ProcessState, Sandbox, SandboxSpec, Signal,
};

use super::{expect, run};
use crate::{variant, Checked, Ctx, Need};

/// A WASI command that prints `hello`.
pub(crate) const HELLO_WAT: &str = r#"(module
  (import "wasi_snapshot_preview1" "fd_write" (func $w (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 16) "hello\n")
  (func (export "_start")
    (i32.store (i32.const 0) (i32.const 16))
    (i32.store (i32.const 4) (i32.const 6))
    (drop (call $w (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 8)))))"#;

/// Hello world in each language, as a code string.
fn hello(lang: Language) -> Option<&'static str> {
    Some(match lang {
        Language::Python => "print('hello')",
        Language::Javascript | Language::Node => "console.log('hello')",
        Language::Shell => "echo hello",
        Language::C => "#include <stdio.h>\nint main(void) { puts(\"hello\"); return 0; }\n",
        Language::Wasm => HELLO_WAT,
        _ => return None,
    })
}

fn unsupported<T>(what: &str, r: Result<T, Error>) -> Checked {
    match r {
        Err(Error::Unsupported { .. }) => Ok(()),
        Err(e) => Err(format!("{what}: {} ({e}), not Unsupported", variant(&e))),
        Ok(_) => Err(format!("{what} succeeded though not claimed")),
    }
}

fn gone<T>(what: &str, r: Result<T, Error>) -> Checked {
    match r {
        Err(Error::SandboxGone { .. }) => Ok(()),
        Err(e) => Err(format!(
            "{what} after destroy: {} ({e}), not SandboxGone",
            variant(&e)
        )),
        Ok(_) => Err(format!("{what} after destroy succeeded")),
    }
}

pub(super) async fn destroy_twice(cx: &Ctx<'_>) -> Checked {
    let sb = cx.create(cx.spec()).await?;
    sb.write_file("x", b"x").await.map_err(|e| e.to_string())?;
    sb.destroy()
        .await
        .map_err(|e| format!("first destroy: {e}"))?;
    sb.destroy()
        .await
        .map_err(|e| format!("second destroy: {e}"))?;
    sb.destroy()
        .await
        .map_err(|e| format!("third destroy: {e}"))
}

pub(super) async fn gone_after_destroy(cx: &Ctx<'_>) -> Checked {
    let sb = cx.create(cx.spec()).await?;
    sb.destroy().await.map_err(|e| format!("destroy: {e}"))?;
    let code = cx.code("echo hi", "print('hi')");
    gone("exec", sb.exec(ExecRequest::code(&code)).await)?;
    gone("exec argv", sb.exec(ExecRequest::argv(["true"])).await)?;
    if cx.caps.streaming {
        match sb.exec_stream(ExecRequest::code(&code)).await {
            Ok(mut s) => gone(
                "exec_stream's first event",
                s.next()
                    .await
                    .unwrap_or(Ok(ExecEvent::Stdout(Default::default()))),
            )?,
            Err(e) => gone("exec_stream", Err::<(), _>(e))?,
        }
    }
    gone("write_file", sb.write_file("x", b"x").await)?;
    gone("read_file", sb.read_file("x").await)?;
    gone("list", sb.list("").await)?;
    gone("health_check", sb.health_check().await)?;
    gone("network_events", sb.network_events().await)?;
    if !cx.caps.snapshots.is_empty() {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let store = ObjectSnapshotStore::local(dir.path()).map_err(|e| e.to_string())?;
        gone("snapshot", sb.snapshot(&store).await)?;
    }
    if cx.caps.pause_resume {
        gone("pause", sb.pause().await)?;
        gone("resume", sb.resume().await)?;
    }
    sb.destroy()
        .await
        .map_err(|e| format!("destroy again: {e}"))
}

pub(super) async fn languages(cx: &Ctx<'_>) -> Checked {
    for lang in Language::ALL {
        let Some(code) = hello(lang) else { continue };
        let spec = SandboxSpec::builder(lang)
            .build()
            .map_err(|e| e.to_string())?;
        if !cx.caps.supports_language(lang) {
            match cx
                .backend
                .create(&spec, sandbox_core::ResolvedSecrets::none())
                .await
            {
                Err(Error::Unsupported { .. }) => {}
                Err(e) => {
                    return Err(format!(
                        "create in {lang} (not claimed): {} ({e}), not Unsupported",
                        variant(&e)
                    ))
                }
                Ok(sb) => {
                    let _ = sb.destroy().await;
                    return Err(format!("create in {lang} succeeded though not claimed"));
                }
            }
            continue;
        }
        let sb = cx
            .create_spec(&spec)
            .await
            .map_err(|e| format!("{lang}: {e}"))?;
        let r = async {
            let r = run(sb.as_ref(), lang.name(), ExecRequest::code(code)).await?;
            expect(
                r.success() && r.stdout_str() == "hello\n",
                &format!("hello world in {lang}"),
                &r,
            )
        }
        .await;
        cx.finish(sb, r).await?;
    }
    Ok(())
}

/// Runs `hello` through argv: `echo` in a userland, a module in the workspace elsewhere.
async fn argv_hello(cx: &Ctx<'_>, sb: &dyn Sandbox) -> Checked {
    let req = if cx.caps.supports_language(Language::Shell) {
        ExecRequest::argv(["echo", "hello"])
    } else {
        let module = wat::parse_str(HELLO_WAT).map_err(|e| format!("wat: {e}"))?;
        sb.write_file("hello.wasm", &module)
            .await
            .map_err(|e| format!("write_file hello.wasm: {e}"))?;
        ExecRequest::argv(["hello.wasm"])
    };
    let r = run(sb, "argv", req).await?;
    expect(r.success() && r.stdout_str() == "hello\n", "argv hello", &r)
}

pub(super) async fn argv(cx: &Ctx<'_>) -> Checked {
    let sb = cx.create(cx.spec()).await?;
    let r = if cx.caps.argv {
        argv_hello(cx, sb.as_ref()).await
    } else {
        unsupported("argv", sb.exec(ExecRequest::argv(["echo", "hello"])).await)
    };
    cx.finish(sb, r).await
}

pub(super) async fn streaming(cx: &Ctx<'_>) -> Checked {
    let sb = cx.create(cx.spec()).await?;
    let code = cx.code(
        "echo one; echo err >&2; echo two",
        "import sys\nprint('one', flush=True)\nprint('err', file=sys.stderr, flush=True)\nprint('two')",
    );
    let r = async {
        if !cx.caps.streaming {
            return unsupported(
                "exec_stream",
                sb.exec_stream(ExecRequest::code(&code)).await,
            );
        }
        let mut s = sb
            .exec_stream(ExecRequest::code(&code))
            .await
            .map_err(|e| format!("exec_stream: {e}"))?;
        let (mut out, mut err) = (Vec::new(), Vec::new());
        loop {
            match s.next().await {
                Some(Ok(ExecEvent::Stdout(b))) => out.extend_from_slice(&b),
                Some(Ok(ExecEvent::Stderr(b))) => err.extend_from_slice(&b),
                Some(Ok(ExecEvent::Exit(r))) => {
                    if r.exit_code != Some(0) || !r.stdout.is_empty() {
                        return Err(format!("exit event {r:?}"));
                    }
                    break;
                }
                Some(Ok(other)) => return Err(format!("unexpected event {other:?}")),
                Some(Err(e)) => return Err(format!("stream error: {e}")),
                None => return Err("the stream ended without an exit event".into()),
            }
        }
        if out == b"one\ntwo\n" && err == b"err\n" {
            Ok(())
        } else {
            Err(format!(
                "streamed stdout {:?}, stderr {:?}",
                String::from_utf8_lossy(&out),
                String::from_utf8_lossy(&err)
            ))
        }
    }
    .await;
    cx.finish(sb, r).await
}

pub(super) async fn pause_resume(cx: &Ctx<'_>) -> Checked {
    let sb = cx.create(cx.spec()).await?;
    let code = cx.code("echo ok", "print('ok')");
    let r = async {
        if !cx.caps.pause_resume {
            unsupported("pause", sb.pause().await)?;
            return unsupported("resume", sb.resume().await);
        }
        sb.pause().await.map_err(|e| format!("pause: {e}"))?;
        match sb.exec(ExecRequest::code(&code)).await {
            Err(Error::SandboxPaused { .. }) => {}
            other => return Err(format!("exec while paused: {other:?}")),
        }
        sb.resume().await.map_err(|e| format!("resume: {e}"))?;
        let r = run(sb.as_ref(), "after resume", ExecRequest::code(&code)).await?;
        expect(
            r.success() && r.stdout_str() == "ok\n",
            "exec after resume",
            &r,
        )
    }
    .await;
    cx.finish(sb, r).await
}

pub(super) async fn snapshots(cx: &Ctx<'_>) -> Checked {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let store = ObjectSnapshotStore::local(dir.path()).map_err(|e| e.to_string())?;
    let sb = cx.create(cx.spec()).await?;
    let r = if Need::Snapshot.missing(&cx.caps).is_some() {
        unsupported("snapshot", sb.snapshot(&store).await)
    } else {
        sb.snapshot(&store)
            .await
            .map(|_| ())
            .map_err(|e| format!("snapshot (claimed): {e}"))
    };
    cx.finish(sb, r).await
}

pub(super) async fn network(cx: &Ctx<'_>) -> Checked {
    let allow = NetworkPolicy::Allow {
        hosts: vec!["example.invalid".parse().map_err(|e| format!("{e}"))?],
        cidrs: Vec::new(),
        ports: Vec::new(),
    };
    let internet = NetworkPolicy::AllowInternet {
        deny: Vec::new(),
        private: Vec::new(),
    };
    for (mode, policy) in [
        (NetworkMode::Allowlist, allow),
        (NetworkMode::Internet, internet),
    ] {
        if cx.caps.network.contains(&mode) {
            continue;
        }
        let spec = cx
            .spec()
            .network(policy)
            .build()
            .map_err(|e| e.to_string())?;
        match cx
            .backend
            .create(&spec, sandbox_core::ResolvedSecrets::none())
            .await
        {
            Err(Error::Unsupported { .. }) => {}
            Err(e) => {
                return Err(format!(
                    "{mode:?} (not claimed): {} ({e}), not Unsupported",
                    variant(&e)
                ))
            }
            Ok(sb) => {
                let _ = sb.destroy().await;
                return Err(format!("{mode:?} (not claimed) was accepted"));
            }
        }
    }
    Ok(())
}

pub(super) async fn images(cx: &Ctx<'_>) -> Checked {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let spec = cx
        .spec()
        .image(format!("oci:{}", dir.path().display()))
        .build()
        .map_err(|e| e.to_string())?;
    match cx
        .backend
        .create(&spec, sandbox_core::ResolvedSecrets::none())
        .await
    {
        Err(Error::Unsupported { .. }) => Ok(()),
        Err(e) => Err(format!(
            "an image (not claimed): {} ({e}), not Unsupported",
            variant(&e)
        )),
        Ok(sb) => {
            let _ = sb.destroy().await;
            Err("an image (not claimed) was accepted".into())
        }
    }
}

pub(super) async fn processes(cx: &Ctx<'_>) -> Checked {
    let sb = cx.create(cx.spec()).await?;
    let r = async {
        let long = cx.code(
            "echo started; exec sleep 1000",
            "import time\nprint('started', flush=True)\ntime.sleep(1000)",
        );
        if !cx.caps.processes {
            unsupported("spawn", sb.spawn(ExecRequest::code(&long)).await)?;
            unsupported("processes", sb.processes().await)?;
            return unsupported("signal", sb.signal(1, Signal::Kill).await);
        }
        let mut p = sb
            .spawn(ExecRequest::code(&long))
            .await
            .map_err(|e| format!("spawn: {e}"))?;
        match p.next().await {
            Some(Ok(ExecEvent::Stdout(b))) if &b[..] == b"started\n" => {}
            other => return Err(format!("first event {other:?}, not `started`")),
        }
        // An exec runs while it does.
        let r = run(
            sb.as_ref(),
            "an exec beside it",
            ExecRequest::code(cx.code("echo beside", "print('beside')")),
        )
        .await?;
        expect(r.stdout_str() == "beside\n", "an exec beside a process", &r)?;
        let list = sb
            .processes()
            .await
            .map_err(|e| format!("processes: {e}"))?;
        if !list
            .iter()
            .any(|i| i.id == p.id() && i.state == ProcessState::Running)
        {
            return Err(format!(
                "processes() does not list {} running: {list:?}",
                p.id()
            ));
        }
        sb.signal(p.id(), Signal::Kill)
            .await
            .map_err(|e| format!("signal: {e}"))?;
        let r = p
            .wait(Some(Duration::from_secs(60)))
            .await
            .map_err(|e| format!("wait: {e}"))?;
        expect(
            r.exit_code == Some(128 + 9),
            "SIGKILL's exit code (137)",
            &r,
        )?;
        match p.write_stdin(&b"late"[..]).await {
            Err(Error::ProcessExited { .. }) => Ok(()),
            other => Err(format!("stdin after exit: {other:?}, not ProcessExited")),
        }
    }
    .await;
    cx.finish(sb, r).await
}

pub(super) async fn publish(cx: &Ctx<'_>) -> Checked {
    let sb = cx.create(cx.spec()).await?;
    let r = async {
        let any: std::net::SocketAddr = ([127, 0, 0, 1], 0).into();
        if !cx.caps.publish {
            unsupported("publish", sb.publish(8000, any).await)?;
            return unsupported("published", sb.published().await);
        }
        let at = sb
            .publish(8000, any)
            .await
            .map_err(|e| format!("publish: {e}"))?;
        if !at.ip().is_loopback() || at.port() == 0 {
            return Err(format!("published on {at}, not a loopback port"));
        }
        match sb.publish(0, any).await {
            Err(Error::InvalidSpec { .. }) => {}
            other => return Err(format!("publishing port 0: {other:?}, not InvalidSpec")),
        }
        sb.unpublish(at)
            .await
            .map_err(|e| format!("unpublish: {e}"))?;
        match sb.unpublish(at).await {
            Err(Error::NotFound { .. }) => Ok(()),
            other => Err(format!("unpublishing twice: {other:?}, not NotFound")),
        }
    }
    .await;
    cx.finish(sb, r).await
}

pub(super) async fn usage(cx: &Ctx<'_>) -> Checked {
    let sb = cx.create(cx.spec()).await?;
    let r = async {
        if !cx.caps.usage {
            return unsupported("usage", sb.usage().await);
        }
        let before = sb.usage().await.map_err(|e| format!("usage: {e}"))?;
        // Some CPU work and some memory held while it is counted.
        let busy = cx.code(
            "i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done",
            "sum(range(2_000_000))",
        );
        let r = sb
            .exec(ExecRequest::code(busy))
            .await
            .map_err(|e| format!("exec: {e}"))?;
        if r.exit_code != Some(0) {
            return Err(format!("the busy loop failed: {r:?}"));
        }
        let after = sb.usage().await.map_err(|e| format!("usage: {e}"))?;
        if after.cpu_time() <= before.cpu_time() {
            return Err(format!(
                "CPU time did not grow over a busy loop: {before:?} then {after:?}"
            ));
        }
        if after.memory_bytes == 0 {
            return Err(format!("no memory counted for a live sandbox: {after:?}"));
        }
        sb.destroy().await.map_err(|e| format!("destroy: {e}"))?;
        match sb.usage().await {
            Err(Error::SandboxGone { .. }) => Ok(()),
            other => Err(format!("usage after destroy: {other:?}, not SandboxGone")),
        }
    }
    .await;
    cx.finish(sb, r).await
}

/// The next output chunk of `p`, as text (an exit or an error is a failure).
async fn next_chunk(p: &mut sandbox_core::Process, what: &str) -> Result<String, String> {
    match tokio::time::timeout(Duration::from_secs(60), p.next()).await {
        Ok(Some(Ok(ExecEvent::Stdout(b) | ExecEvent::Stderr(b)))) => {
            Ok(String::from_utf8_lossy(&b).into_owned())
        }
        Ok(other) => Err(format!("{what}: {other:?}")),
        Err(_) => Err(format!("{what}: nothing within 60 s")),
    }
}

pub(super) async fn process_io_signals(cx: &Ctx<'_>) -> Checked {
    let sb = cx.create(cx.spec()).await?;
    let r = async {
        let echo = cx.code(
            "while read l; do echo got:$l; done; exit 4",
            "import sys\nfor l in sys.stdin:\n    print('got:' + l.strip(), flush=True)\nsys.exit(4)",
        );
        let mut p = sb
            .spawn(ExecRequest::code(&echo).stdin(b"one\n".to_vec()))
            .await
            .map_err(|e| format!("spawn: {e}"))?;
        let mut out = next_chunk(&mut p, "the first line").await?;
        p.write_stdin(&b"two\n"[..])
            .await
            .map_err(|e| format!("write_stdin: {e}"))?;
        // Chunks split anywhere: wait for the whole second line.
        while !out.contains("got:two\n") {
            out.push_str(&next_chunk(&mut p, "the second line").await?);
        }
        if out != "got:one\ngot:two\n" {
            return Err(format!("output {out:?}, not the two lines in order"));
        }
        p.close_stdin().await.map_err(|e| format!("close_stdin: {e}"))?;
        let r = p
            .wait(Some(Duration::from_secs(60)))
            .await
            .map_err(|e| format!("wait: {e}"))?;
        expect(r.exit_code == Some(4), "exit 4 after stdin closed", &r)?;

        let trap = cx.code(
            "trap 'echo caught; exit 7' INT; echo ready; while :; do sleep 0.05; done",
            "import signal, sys, time\n\
             def h(*a):\n    print('caught', flush=True)\n    sys.exit(7)\n\
             signal.signal(signal.SIGINT, h)\nprint('ready', flush=True)\n\
             while True:\n    time.sleep(0.05)",
        );
        let mut p = sb
            .spawn(ExecRequest::code(&trap))
            .await
            .map_err(|e| format!("spawn: {e}"))?;
        let ready = next_chunk(&mut p, "ready").await?;
        if ready != "ready\n" {
            return Err(format!("first output {ready:?}, not `ready`"));
        }
        match p.wait(Some(Duration::from_millis(100))).await {
            Err(Error::Timeout { .. }) => {}
            other => return Err(format!("wait on a running process: {other:?}, not Timeout")),
        }
        p.signal(Signal::Interrupt)
            .await
            .map_err(|e| format!("signal: {e}"))?;
        let r = p
            .wait(Some(Duration::from_secs(60)))
            .await
            .map_err(|e| format!("wait: {e}"))?;
        expect(
            r.exit_code == Some(7) && r.stdout_str() == "caught\n",
            "SIGINT handled (`caught`, exit 7)",
            &r,
        )
    }
    .await;
    cx.finish(sb, r).await
}

/// The signals a `/proc/self/status` text shows ignored (`SigIgn`) or blocked (`SigBlk`), as
/// `(line, signal numbers)` for each of the two that is not empty; nothing for a kernel that
/// shows neither (gVisor's).
fn ignored_or_blocked(status: &str) -> Vec<(String, Vec<u32>)> {
    let mut bad = Vec::new();
    for key in ["SigIgn:", "SigBlk:"] {
        let Some(set) = status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        else {
            continue;
        };
        if set != 0 {
            let sigs = (1..=64u32).filter(|s| set & (1 << (s - 1)) != 0).collect();
            bad.push((key.trim_end_matches(':').to_string(), sigs));
        }
    }
    bad
}

/// Every process starts with every signal at its default and none blocked, whatever the
/// caller's: the runner ignores `SIGINT`, `SIGQUIT` and `SIGHUP` and blocks `SIGUSR1` and
/// `SIGTERM`, as a background job under `nohup` does (`tests/tiers.rs` does so before its
/// `main`), and `execve` keeps ignored dispositions and the mask. Checked in the command's
/// `/proc/self/status` where it shows them (an exec and a process), then by traps: a shell
/// cannot trap a signal ignored when it started, nor receive a blocked one.
pub(super) async fn process_signal_defaults(cx: &Ctx<'_>) -> Checked {
    let sb = cx.create(cx.spec()).await?;
    let r = async {
        let status = ExecRequest::argv(["cat", "/proc/self/status"]);
        let r = run(sb.as_ref(), "an exec's /proc/self/status", status.clone()).await?;
        expect(r.exit_code == Some(0), "an exec's /proc/self/status", &r)?;
        let bad = ignored_or_blocked(&r.stdout_str());
        if !bad.is_empty() {
            return Err(format!(
                "an exec starts with signals ignored or blocked: {bad:?}"
            ));
        }
        let mut p = sb.spawn(status).await.map_err(|e| format!("spawn: {e}"))?;
        let r = p
            .wait(Some(Duration::from_secs(60)))
            .await
            .map_err(|e| format!("wait: {e}"))?;
        expect(r.exit_code == Some(0), "a process's /proc/self/status", &r)?;
        let bad = ignored_or_blocked(&r.stdout_str());
        if !bad.is_empty() {
            return Err(format!(
                "a process starts with signals ignored or blocked: {bad:?}"
            ));
        }

        let mut p = sb
            .spawn(ExecRequest::code(
                "ulimit -c 0; trap 'echo int' INT; trap 'echo quit' QUIT; trap 'echo hup' HUP; \
                 trap 'echo term; exit 7' TERM; echo ready; while :; do sleep 0.05; done",
            ))
            .await
            .map_err(|e| format!("spawn: {e}"))?;
        let mut out = next_chunk(&mut p, "ready").await?;
        if out != "ready\n" {
            return Err(format!("first output {out:?}, not `ready`"));
        }
        for (sig, word) in [
            (Signal::Interrupt, "int\n"),
            (Signal::Quit, "quit\n"),
            (Signal::Hangup, "hup\n"),
        ] {
            p.signal(sig).await.map_err(|e| format!("signal: {e}"))?;
            out.clear();
            while !out.contains(word) {
                out.push_str(&next_chunk(&mut p, &format!("{sig:?} trapped")).await?);
            }
        }
        p.signal(Signal::Terminate)
            .await
            .map_err(|e| format!("signal: {e}"))?;
        let r = p
            .wait(Some(Duration::from_secs(60)))
            .await
            .map_err(|e| format!("wait: {e}"))?;
        expect(
            r.exit_code == Some(7) && r.stdout_str().contains("term\n"),
            "SIGTERM trapped (`term`, exit 7)",
            &r,
        )
    }
    .await;
    cx.finish(sb, r).await
}

pub(super) async fn tty(cx: &Ctx<'_>) -> Checked {
    let sb = cx.create(cx.spec()).await?;
    let r = async {
        let req =
            ExecRequest::code("stty size; test -t 0 && test -t 1 && echo on-a-tty").tty(7, 33);
        if !(cx.caps.tty && cx.caps.processes) {
            return unsupported("spawn with a terminal", sb.spawn(req).await);
        }
        // A terminal is for spawn: exec refuses it.
        unsupported(
            "exec with a terminal",
            sb.exec(ExecRequest::code("true").tty(7, 33)).await,
        )?;
        let mut p = sb.spawn(req).await.map_err(|e| format!("spawn: {e}"))?;
        let mut out = String::new();
        // Chunks split anywhere (the last `\r\n` may come on its own):
        // wait for the whole last line.
        while !out.replace('\r', "").contains("on-a-tty\n") {
            out.push_str(&next_chunk(&mut p, "the terminal's output").await?);
        }
        let r = p
            .wait(Some(Duration::from_secs(60)))
            .await
            .map_err(|e| format!("wait: {e}"))?;
        // A terminal turns `\n` into `\r\n`.
        if out.replace('\r', "") != "7 33\non-a-tty\n" || r.exit_code != Some(0) {
            return Err(format!("output {out:?}, exit {:?}", r.exit_code));
        }
        Ok(())
    }
    .await;
    cx.finish(sb, r).await
}

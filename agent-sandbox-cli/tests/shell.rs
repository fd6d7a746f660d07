//! `agent-sandbox shell` driven as a person would: in a `tmux` terminal, keys typed into it,
//! the screen read back.

// In tests a panic is a failed assertion.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Command;
use std::time::Duration;

mod served;

fn tmux(args: &[&str]) -> String {
    let out = Command::new("tmux").args(args).output().expect("run tmux");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The session's screen, once `needle` shows on it (60 s at most).
fn screen_with(session: &str, needle: &str) -> String {
    let mut screen = String::new();
    for _ in 0..600 {
        screen = tmux(&["capture-pane", "-p", "-t", session]);
        if screen.contains(needle) {
            return screen;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("{needle:?} never showed; the screen:\n{screen}");
}

/// Waits until the shell's prompt (`$`, trimmed by capture-pane) is the last line on the
/// screen: keys typed while a program is still exiting may be read, or flushed, by it.
fn prompt(session: &str) {
    let mut screen = String::new();
    for _ in 0..600 {
        screen = tmux(&["capture-pane", "-p", "-t", session]);
        if screen
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .map(str::trim)
            == Some("$")
        {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("the prompt never came back; the screen:\n{screen}");
}

fn keys(session: &str, keys: &[&str]) {
    let mut args = vec!["send-keys", "-t", session];
    args.extend_from_slice(keys);
    tmux(&args);
}

/// Kills the tmux session when dropped: also when an assertion fails (a session left behind
/// would keep a sandbox and its CLI running).
struct Session(String);

impl Drop for Session {
    fn drop(&mut self) {
        tmux(&["kill-session", "-t", &self.0]);
    }
}

fn available(tier: &str) -> bool {
    served::unavailable(tier).is_none()
}

#[test]
fn a_container_shell_in_tmux_runs_python_resizes_and_exits_with_its_code() {
    shell_session("container", None);
}

#[test]
fn a_gvisor_shell_in_tmux_runs_python_resizes_and_exits_with_its_code() {
    shell_session("gvisor", None);
}

/// The same session in a sandbox of `agent-sandbox serve` (`shell --server`): keys, the
/// window size and the exit code go through the HTTP API.
#[test]
fn a_shell_through_a_server_in_tmux_behaves_as_a_local_one() {
    if !available("container") {
        eprintln!("SKIP: the container tier is not available here (see `agent-sandbox probe`)");
        return;
    }
    let server = served::serve();
    shell_session("container", Some(&server));
}

/// `agent-sandbox shell --tier TIER` in a tmux terminal, driven as a person would (in a
/// sandbox of `server` when given).
fn shell_session(tier: &str, server: Option<&served::Serve>) {
    if Command::new("tmux").arg("-V").output().is_err() {
        eprintln!("SKIP: tmux is not installed (scripts/test.sh installs it)");
        return;
    }
    if !available(tier) {
        eprintln!("SKIP: the {tier} tier is not available here (see `agent-sandbox probe`)");
        return;
    }
    let remote = server.map_or_else(String::new, |s| {
        format!(
            " --server {} --token-file {}",
            s.base,
            s.dir.path().join("token").display()
        )
    });
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str| dir.path().join(name).display().to_string();
    let session = format!(
        "asb-shell-{tier}{}-{}",
        if server.is_some() { "-remote" } else { "" },
        std::process::id()
    );
    // The terminal's modes (`stty -g`) before and after, and the CLI's exit code.
    let script = format!(
        "stty -g > {before}; {bin} shell --tier {tier}{remote}; echo $? > {code}; stty -g > {after}; sleep 600",
        before = file("before"),
        after = file("after"),
        code = file("code"),
        bin = env!("CARGO_BIN_EXE_agent-sandbox"),
    );
    tmux(&[
        "-f",
        "/dev/null",
        "new-session",
        "-d",
        "-s",
        &session,
        "-x",
        "100",
        "-y",
        "30",
        &script,
    ]);
    let _cleanup = Session(session.clone());
    tmux(&["set-option", "-t", &session, "status", "off"]);
    let s = session.as_str();
    // The prompt (`$ `; capture-pane trims the space).
    prompt(s);
    keys(s, &["stty size; echo shown-$((2*3))", "Enter"]);
    let screen = screen_with(s, "shown-6");
    assert!(screen.contains("30 100"), "{screen}");
    // A terminal of the sandbox's own, in every tier.
    keys(s, &["tty", "Enter"]);
    screen_with(s, "/dev/pts/");

    keys(s, &["python3", "Enter"]);
    screen_with(s, ">>>");
    keys(s, &["print(6*7)", "Enter"]);
    screen_with(s, "\n42\n");
    keys(s, &["C-d"]);
    prompt(s);
    keys(s, &["clear", "Enter"]);
    prompt(s);

    tmux(&["resize-window", "-t", s, "-x", "120", "-y", "40"]);
    // The new size travels tmux -> CLI (SIGWINCH) -> sandbox terminal; ask until it has
    // arrived rather than racing it.
    let mut resized = false;
    for _ in 0..20 {
        keys(s, &["stty size", "Enter"]);
        prompt(s);
        if tmux(&["capture-pane", "-p", "-t", s]).contains("40 120") {
            resized = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    assert!(resized, "{}", tmux(&["capture-pane", "-p", "-t", s]));

    // Ctrl-C goes to the sandbox's foreground job, not to the CLI.
    keys(s, &["sleep 1000", "Enter"]);
    std::thread::sleep(Duration::from_millis(300));
    keys(s, &["C-c"]);
    keys(s, &["echo still-$((6*7))", "Enter"]);
    screen_with(s, "still-42");

    keys(s, &["exit 3", "Enter"]);
    let code = Path::new(&file("code")).to_path_buf();
    // The script writes the code, then the modes after: wait for the last one written.
    let after = Path::new(&file("after")).to_path_buf();
    for _ in 0..600 {
        if std::fs::read_to_string(&after).is_ok_and(|c| !c.is_empty()) {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let after = std::fs::read_to_string(&after);
    assert_eq!(std::fs::read_to_string(&code).unwrap().trim(), "3");
    assert_eq!(
        std::fs::read_to_string(file("before")).unwrap(),
        after.unwrap(),
        "the terminal's modes are restored"
    );
}

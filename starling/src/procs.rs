//! The demo's child processes: each role runs as `starling <role> …` (this executable), its
//! output appended to a log file in the run's directory, stopped when its owner is dropped
//! (SIGTERM, a grace period, then SIGKILL: an actor stops its vLLM server on SIGTERM, and a
//! SIGKILLed one would leave the server's processes running).
//!
//! A child started with [`Proc::spawn_group`] leads its own process group (the vLLM server,
//! whose engine runs in processes of its own): every signal goes to the whole group, and it
//! counts as running while any process of the group does.
//!
//! A demo stopped by a signal runs no destructor, so every live child is also in a registry
//! that [`stop_children_on_signal`] uses: on SIGTERM or SIGINT the demo passes SIGTERM on to
//! its children (which drain within their own grace periods), waits for them, SIGKILLs any
//! left after [`CHILD_GRACE`], and exits 128 + the signal. No child outlives the demo.

use std::collections::BTreeSet;
use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// The children alive now, by what a signal is sent to: a process id, or minus a process
/// group's id (`kill(2)`'s convention).
static CHILDREN: Mutex<BTreeSet<i32>> = Mutex::new(BTreeSet::new());

/// Set once a signal asked the demo to stop: from then on the signal thread owns the exit.
static STOPPING: AtomicBool = AtomicBool::new(false);

/// Once the demo is stopping, the calling thread waits for the signal thread to end the
/// process (so a child that exits on the passed-on SIGTERM is not reported as a failure).
pub(crate) fn wait_if_stopping() {
    while STOPPING.load(Ordering::SeqCst) {
        std::thread::park();
    }
}

/// How long a stopping demo waits for its children after passing the signal on (the hub's
/// own grace period is 10 s).
pub(crate) const CHILD_GRACE: Duration = Duration::from_secs(12);

fn children() -> std::sync::MutexGuard<'static, BTreeSet<i32>> {
    CHILDREN.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Starts the thread that stops the children when the demo gets SIGTERM or SIGINT.
pub(crate) fn stop_children_on_signal() -> Result<()> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT])
        .context("install signal handlers")?;
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            if let Some(sig) = signals.forever().next() {
                STOPPING.store(true, Ordering::SeqCst);
                eprintln!("stopping: signal {sig}; stopping the hub, relays and actors");
                stop_children();
                std::process::exit(128 + sig);
            }
        })
        .context("start the signal thread")?;
    Ok(())
}

/// SIGTERM to every child, then SIGKILL to those still running after [`CHILD_GRACE`].
fn stop_children() {
    let targets: Vec<i32> = children().iter().copied().collect();
    for &t in &targets {
        let _ = kill(Pid::from_raw(t), Signal::SIGTERM);
    }
    let deadline = Instant::now() + CHILD_GRACE;
    while Instant::now() < deadline && targets.iter().any(|&t| running(t)) {
        std::thread::sleep(Duration::from_millis(50));
    }
    for &t in targets.iter().filter(|&&t| running(t)) {
        let _ = kill(Pid::from_raw(t), Signal::SIGKILL);
    }
}

/// Whether `target` is still running (not gone, not a zombie waiting to be reaped): a process
/// id, or minus a process group's id (then: any process of the group).
fn running(target: i32) -> bool {
    if target < 0 {
        return group_running(-target);
    }
    proc_stat(&format!("/proc/{target}/stat")).is_some_and(|(state, _)| state != "Z")
}

/// Whether any process of group `pgid` is running (zombies left out).
fn group_running(pgid: i32) -> bool {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return false;
    };
    dir.filter_map(Result::ok)
        .filter(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))
        })
        .filter_map(|e| proc_stat(&format!("{}/stat", e.path().display())))
        .any(|(state, group)| state != "Z" && group == pgid)
}

/// A process's state letter and process group, from `/proc/PID/stat` (after the command
/// name, which may hold spaces and parentheses: `pid (comm) state ppid pgrp …`).
fn proc_stat(path: &str) -> Option<(String, i32)> {
    let s = std::fs::read_to_string(path).ok()?;
    let (_, rest) = s.rsplit_once(')')?;
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.to_owned();
    let group = fields.nth(1)?.parse().ok()?;
    Some((state, group))
}

/// A running child process; dropping it kills and reaps it (and, for a group leader, every
/// process of its group).
#[derive(Debug)]
pub(crate) struct Proc {
    pub(crate) name: String,
    pub(crate) log: PathBuf,
    child: Child,
    /// What signals go to: the process id, or minus its group's id.
    target: i32,
}

impl Proc {
    /// Starts `starling ROLE ARGS…` with stdout and stderr appended to `log`.
    pub(crate) fn start(name: &str, role: &str, args: &[String], log: &Path) -> Result<Self> {
        let exe = std::env::current_exe().context("locate the starling executable")?;
        let mut cmd = Command::new(exe);
        cmd.arg(role).args(args);
        Self::spawn(name, cmd, log)
    }

    /// Starts `cmd` (another program: the Python trainer) with stdout and stderr appended to
    /// `log`.
    pub(crate) fn spawn(name: &str, cmd: Command, log: &Path) -> Result<Self> {
        Self::spawn_as(name, cmd, log, false)
    }

    /// Starts `cmd` as the leader of a new process group, with stdout and stderr appended to
    /// `log`: stopping it stops every process it started (vLLM's engine processes).
    pub(crate) fn spawn_group(name: &str, mut cmd: Command, log: &Path) -> Result<Self> {
        cmd.process_group(0);
        Self::spawn_as(name, cmd, log, true)
    }

    fn spawn_as(name: &str, mut cmd: Command, log: &Path, group: bool) -> Result<Self> {
        let out = File::create(log).with_context(|| format!("create {}", log.display()))?;
        let err = out.try_clone().context("duplicate a log handle")?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .with_context(|| format!("start {name}"))?;
        let Ok(pid) = i32::try_from(child.id()) else {
            let mut child = child;
            let _ = child.kill();
            let _ = child.wait();
            bail!("start {name}: process id {} out of range", child.id());
        };
        let target = if group { -pid } else { pid };
        children().insert(target);
        Ok(Self {
            name: name.to_owned(),
            log: log.to_owned(),
            child,
            target,
        })
    }

    /// The exit status, once the process has exited.
    pub(crate) fn exited(&mut self) -> Result<Option<std::process::ExitStatus>> {
        self.child.try_wait().context("poll a child")
    }

    /// Fails with the end of the log if the process has exited.
    pub(crate) fn check_alive(&mut self) -> Result<()> {
        if let Some(status) = self.child.try_wait().context("poll a child")? {
            wait_if_stopping();
            bail!(
                "{} exited ({status}); the end of {}:\n{}",
                self.name,
                self.log.display(),
                tail(&self.log, 12)
            );
        }
        Ok(())
    }
}

impl Proc {
    /// Asks the process to stop (SIGTERM) without waiting: a role drains and stops what it
    /// started itself (an actor its vLLM server, whose engine processes a SIGKILLed actor
    /// would leave running).
    pub(crate) fn terminate(&self) {
        let _ = kill(Pid::from_raw(self.target), Signal::SIGTERM);
    }

    /// Whether the process (for a group leader: any process of its group) still runs.
    /// Reaps nothing, so a group's id cannot be reused while it is being signalled.
    fn still_running(&mut self) -> bool {
        if self.target < 0 {
            group_running(-self.target)
        } else {
            matches!(self.child.try_wait(), Ok(None))
        }
    }
}

/// Stops every process of `procs` at once: SIGTERM to all, then each is waited for (and
/// SIGKILLed after [`CHILD_GRACE`]) as it is dropped.
pub(crate) fn stop_all(procs: Vec<Proc>) {
    for p in &procs {
        p.terminate();
    }
    drop(procs);
}

impl Drop for Proc {
    /// SIGTERM, up to [`CHILD_GRACE`] to exit, then SIGKILL; reaped either way.
    fn drop(&mut self) {
        if self.still_running() {
            self.terminate();
            let deadline = Instant::now() + CHILD_GRACE;
            while Instant::now() < deadline && self.still_running() {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        // Best effort: the child (or its group) may already be gone.
        if self.target < 0 && group_running(-self.target) {
            let _ = kill(Pid::from_raw(self.target), Signal::SIGKILL);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        children().remove(&self.target);
    }
}

/// Runs `starling ROLE ARGS…` to completion; fails with its output if it fails.
pub(crate) fn run_once(role: &str, args: &[String]) -> Result<String> {
    let exe = std::env::current_exe().context("locate the starling executable")?;
    let out = Command::new(exe)
        .arg(role)
        .args(args)
        .output()
        .with_context(|| format!("run starling {role}"))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() {
        bail!("starling {role} {} failed: {}", args.join(" "), text.trim());
    }
    Ok(text)
}

/// The last `n` lines of a log file.
pub(crate) fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The processes of group `pgid` that are running.
    fn members(pgid: i32) -> usize {
        std::fs::read_dir("/proc")
            .expect("read /proc")
            .filter_map(Result::ok)
            .filter_map(|e| proc_stat(&format!("{}/stat", e.path().display())))
            .filter(|(state, group)| state != "Z" && *group == pgid)
            .count()
    }

    fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !done() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    #[test]
    fn dropping_a_group_leader_stops_every_process_of_its_group() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "sleep 60 & sleep 60 & wait"]);
        let p = Proc::spawn_group("sleepers", cmd, &dir.path().join("log")).expect("spawn");
        let pgid = -p.target;
        assert!(pgid > 0, "a group's target is minus its id");
        wait_for("the shell and its two sleeps", || members(pgid) == 3);
        drop(p);
        assert_eq!(members(pgid), 0);
        assert!(!children().contains(&-pgid), "left in the registry");
    }

    #[test]
    fn a_group_whose_leader_exited_is_stopped_all_the_same() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "sleep 60 & exit 0"]);
        let mut p = Proc::spawn_group("orphan", cmd, &dir.path().join("log")).expect("spawn");
        let pgid = -p.target;
        wait_for("the shell to exit", || {
            p.exited().is_ok_and(|s| s.is_some())
        });
        wait_for("its sleep", || members(pgid) == 1);
        assert!(p.still_running(), "a group with a live member runs");
        drop(p);
        assert_eq!(members(pgid), 0);
    }
}

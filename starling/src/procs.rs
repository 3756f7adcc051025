//! The demo's child processes: each role runs as `starling <role> …` (this executable), its
//! output appended to a log file in the run's directory, stopped when its owner is dropped
//! (SIGTERM, a grace period, then SIGKILL: an actor stops its vLLM server on SIGTERM, and a
//! SIGKILLed one would leave the server's processes running).
//!
//! A demo stopped by a signal runs no destructor, so every live child is also in a registry
//! that [`stop_children_on_signal`] uses: on SIGTERM or SIGINT the demo passes SIGTERM on to
//! its children (which drain within their own grace periods), waits for them, SIGKILLs any
//! left after [`CHILD_GRACE`], and exits 128 + the signal. No child outlives the demo.

use std::collections::BTreeSet;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// The children alive now, by process id.
static CHILDREN: Mutex<BTreeSet<u32>> = Mutex::new(BTreeSet::new());

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

fn children() -> std::sync::MutexGuard<'static, BTreeSet<u32>> {
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
    let pids: Vec<Pid> = children()
        .iter()
        .filter_map(|&p| i32::try_from(p).ok())
        .map(Pid::from_raw)
        .collect();
    for &p in &pids {
        let _ = kill(p, Signal::SIGTERM);
    }
    let deadline = Instant::now() + CHILD_GRACE;
    while Instant::now() < deadline && pids.iter().any(|&p| running(p)) {
        std::thread::sleep(Duration::from_millis(50));
    }
    for &p in pids.iter().filter(|&&p| running(p)) {
        let _ = kill(p, Signal::SIGKILL);
    }
}

/// Whether `pid` is still running (not gone, not a zombie waiting to be reaped).
fn running(pid: Pid) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next().map(|st| st != "Z"))
        })
        .unwrap_or(false)
}

/// A running child process; dropping it kills and reaps it.
#[derive(Debug)]
pub(crate) struct Proc {
    pub(crate) name: String,
    pub(crate) log: PathBuf,
    child: Child,
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
    pub(crate) fn spawn(name: &str, mut cmd: Command, log: &Path) -> Result<Self> {
        let out = File::create(log).with_context(|| format!("create {}", log.display()))?;
        let err = out.try_clone().context("duplicate a log handle")?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .with_context(|| format!("start {name}"))?;
        children().insert(child.id());
        Ok(Self {
            name: name.to_owned(),
            log: log.to_owned(),
            child,
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
        if let Ok(pid) = i32::try_from(self.child.id()) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
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
        if matches!(self.child.try_wait(), Ok(None)) {
            self.terminate();
            let deadline = Instant::now() + CHILD_GRACE;
            while Instant::now() < deadline && matches!(self.child.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        // Best effort: the child may already be gone.
        let _ = self.child.kill();
        let _ = self.child.wait();
        children().remove(&self.child.id());
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

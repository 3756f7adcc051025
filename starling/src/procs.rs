//! The demo's child processes: each role runs as `starling <role> …` (this executable), its
//! output appended to a log file in the run's directory, killed when its owner is dropped.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use anyhow::{Context, Result, bail};

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
        let out = File::create(log).with_context(|| format!("create {}", log.display()))?;
        let err = out.try_clone().context("duplicate a log handle")?;
        let child = Command::new(exe)
            .arg(role)
            .args(args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .with_context(|| format!("start {name}"))?;
        Ok(Self {
            name: name.to_owned(),
            log: log.to_owned(),
            child,
        })
    }

    /// Fails with the end of the log if the process has exited.
    pub(crate) fn check_alive(&mut self) -> Result<()> {
        if let Some(status) = self.child.try_wait().context("poll a child")? {
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

impl Drop for Proc {
    fn drop(&mut self) {
        // Best effort: the child may already be gone.
        let _ = self.child.kill();
        let _ = self.child.wait();
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

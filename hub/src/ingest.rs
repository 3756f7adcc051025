//! What a checkpoint must pass before the hub publishes it, and the hub's errors for each
//! (`POST /v1/versions`, `starling-hub publish`; `docs/api.md`).
//!
//! A publish names a path on the hub's machine. The hub reads it with its own privileges,
//! which include the cluster's signing key, so paths are confined to the directories the
//! operator named (`--publish-dir`): a path outside them is refused before the file system is
//! touched, with an answer that is the same whether the file exists or not; inside them,
//! symbolic links are resolved and every file is checked again by the path of its open
//! descriptor before a byte of it is read ([`Checkpoint::open_confined`]). FIFOs and devices
//! are refused without blocking. All of it runs on a blocking thread, never on the runtime.
//!
//! Then, in order, before anything of the version leaves the hub (no `Announce`, no frame;
//! step 4 says when it runs later):
//! 1. the header: valid, the file exactly as long as its tensors (so what is copied is
//!    bounded by the model's size), the run's tensors exactly, by name and shape (a missing or
//!    extra tensor is named);
//! 2. the hub's own copy (`snapshot`) of the bytes it validated, checked again;
//! 3. under the publish lock: a step number lower than the latest version's, and a checkpoint
//!    bit-identical to the latest version, are refused unless allowed (`step_backwards`,
//!    `unchanged`): a retried publish that had in fact succeeded is told which version it is;
//! 4. every element as BF16: a NaN or ±Inf is refused, naming each tensor and its counts,
//!    unless the request allows it (`"allow": ["nonfinite"]`).
//!
//! Step 4 reads every element only when the latest version is not known to be finite (the
//! first publish after a start, or after one that allowed `nonfinite`), before anything is
//! sent. Otherwise an unchanged element kept its finite bits, so only the changed ones need a
//! look, and the diff takes it in its own pass over them ([`DiffOptions`]'s
//! `refuse_nonfinite_changes`): no second read of the checkpoint (0.5–1 s at 1.5B, a pass
//! over 16 GB at 8B, before the first segment). The price is on the rare refused step: some
//! of its segments may have gone out when the diff meets the NaN; the version is then aborted
//! before its manifest, as any failed encode is, and every receiver drops what it staged.
//!
//! [`DiffOptions`]: starling_checkpoint::deltafile::DiffOptions
//!
//! Cost otherwise: a comparison that stops at the first changed chunk.

use std::path::{Component, Path, PathBuf};

use serde::Deserialize;
use starling_checkpoint::safetensors::{Checkpoint, CheckpointError, Layout};
use starling_checkpoint::scan::{NonFinite, first_change, nonfinite};
use starling_proto::delta::encode::NonFiniteChanges;
use thiserror::Error;

/// Checks a publish may skip, by the name the request gives them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Allow {
    /// Publish weights that hold NaN or ±Inf.
    Nonfinite,
    /// Publish a checkpoint identical to the latest version as a new version.
    Unchanged,
    /// Publish with a step number lower than the latest version's.
    StepBackwards,
}

/// What a publish asks for.
#[derive(Debug, Clone)]
pub(crate) struct PublishRequest {
    pub(crate) path: PathBuf,
    pub(crate) step: Option<u64>,
    pub(crate) allow: Vec<Allow>,
    /// The trainer gives the file to the hub: taken by a rename where it can be, else copied
    /// (`crate::snapshot`).
    pub(crate) handover: bool,
}

impl PublishRequest {
    pub(crate) fn allows(&self, a: Allow) -> bool {
        self.allow.contains(&a)
    }
}

/// A refused or failed publish; nothing of it was announced.
#[derive(Debug, Error)]
pub(crate) enum PublishError {
    /// The path is outside every `--publish-dir` (403 `path_not_allowed`).
    #[error("{0}")]
    PathNotAllowed(String),
    /// Not a readable checkpoint (422 `unreadable_checkpoint`).
    #[error("{0}")]
    Unreadable(String),
    /// Not the run's tensors (409 `layout_mismatch`).
    #[error("{0}")]
    Layout(String),
    /// NaN or ±Inf weights (422 `nonfinite_weights`).
    #[error("{0}")]
    NonFinite(String),
    /// Identical to the latest version (409 `unchanged`).
    #[error("{0}")]
    Unchanged(String),
    /// A step lower than the latest version's (409 `step_backwards`).
    #[error("{0}")]
    StepBackwards(String),
    /// The hub's own failure (500 `internal`).
    #[error("{0:#}")]
    Internal(anyhow::Error),
}

impl PublishError {
    /// The stable code of `docs/api.md`.
    pub(crate) fn code(&self) -> &'static str {
        match self {
            Self::PathNotAllowed(_) => "path_not_allowed",
            Self::Unreadable(_) => "unreadable_checkpoint",
            Self::Layout(_) => "layout_mismatch",
            Self::NonFinite(_) => "nonfinite_weights",
            Self::Unchanged(_) => "unchanged",
            Self::StepBackwards(_) => "step_backwards",
            Self::Internal(_) => "internal",
        }
    }

    /// The HTTP status of the code.
    pub(crate) fn status(&self) -> u16 {
        match self {
            Self::PathNotAllowed(_) => 403,
            Self::Unreadable(_) | Self::NonFinite(_) => 422,
            Self::Layout(_) | Self::Unchanged(_) | Self::StepBackwards(_) => 409,
            Self::Internal(_) => 500,
        }
    }

    /// A checkpoint error of the trainer's file, by its kind.
    fn of_source(path: &Path, e: CheckpointError) -> Self {
        match e {
            CheckpointError::LayoutMismatch(d) => {
                Self::Layout(format!("{}: not the run's model: {d}", path.display()))
            }
            CheckpointError::NotAllowed { .. } => Self::PathNotAllowed(format!(
                "{} leads outside the directories this hub publishes from",
                path.display()
            )),
            other => Self::Unreadable(format!(
                "{}: {}",
                path.display(),
                starling_process::error_chain(&other)
            )),
        }
    }
}

/// The directories checkpoints may be published from (`--publish-dir`), resolved at start.
#[derive(Debug, Clone, Default)]
pub struct PublishDirs {
    /// As named (made absolute): what a path's text is checked against.
    named: Vec<PathBuf>,
    /// Resolved (links followed): what a file's real path is checked against.
    real: Vec<PathBuf>,
}

impl PublishDirs {
    /// Resolves each directory (it must exist).
    pub fn new(dirs: &[PathBuf]) -> anyhow::Result<Self> {
        let mut out = PublishDirs::default();
        for d in dirs {
            let c = std::fs::canonicalize(d).map_err(|e| {
                anyhow::anyhow!(
                    "--publish-dir {}: {e} (it must be a directory)",
                    d.display()
                )
            })?;
            if !c.is_dir() {
                anyhow::bail!("--publish-dir {} is not a directory", d.display());
            }
            let named = std::path::absolute(d)
                .map_err(|e| anyhow::anyhow!("--publish-dir {}: {e}", d.display()))?;
            out.named.push(named);
            out.real.push(c);
        }
        Ok(out)
    }

    /// Whether a resolved path is inside one of the directories.
    pub(crate) fn contains(&self, real: &Path) -> bool {
        self.real.iter().any(|d| real.starts_with(d))
    }

    /// Whether a path's text puts it inside one of the directories (as named or resolved).
    fn contains_by_name(&self, path: &Path) -> bool {
        self.named
            .iter()
            .chain(&self.real)
            .any(|d| path.starts_with(d))
    }

    fn describe(&self) -> String {
        if self.named.is_empty() {
            "none: this hub was started without --publish-dir, so it publishes no path".into()
        } else {
            self.named
                .iter()
                .map(|d| d.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        }
    }

    /// `path` resolved, if it is inside the directories. A path outside them (by its text,
    /// before the file system is asked anything, or once its links are resolved) gets the
    /// same refusal whether it exists or not. Blocking.
    pub(crate) fn confine(&self, path: &Path) -> Result<PathBuf, PublishError> {
        let refuse = || {
            PublishError::PathNotAllowed(format!(
                "{} is outside the directories this hub publishes from ({}): write checkpoints \
                 under one of them, or start the hub with --publish-dir naming the trainer's",
                path.display(),
                self.describe()
            ))
        };
        if !path.is_absolute() {
            return Err(PublishError::Unreadable(format!(
                "path must be absolute: {}",
                path.display()
            )));
        }
        if path
            .components()
            .any(|c| matches!(c, Component::ParentDir | Component::CurDir))
            || !self.contains_by_name(path)
        {
            return Err(refuse());
        }
        let real = std::fs::canonicalize(path)
            .map_err(|e| PublishError::Unreadable(format!("{}: {e}", path.display())))?;
        if !self.contains(&real) {
            return Err(refuse());
        }
        Ok(real)
    }
}

/// Opens the trainer's checkpoint at `path` inside `dirs` and checks its header and lengths
/// against the run's `layout` (steps 1 of the module docs). Blocking.
pub(crate) fn open_source(
    dirs: &PublishDirs,
    layout: &Layout,
    path: &Path,
) -> Result<Checkpoint, PublishError> {
    let real = dirs.confine(path)?;
    let gate = |p: &Path| dirs.contains(p);
    let c =
        Checkpoint::open_confined(&real, &gate).map_err(|e| PublishError::of_source(path, e))?;
    c.check_lengths()
        .map_err(|e| PublishError::of_source(path, e))?;
    c.check_layout(layout)
        .map_err(|e| PublishError::of_source(path, e))?;
    Ok(c)
}

/// Checks the hub's copy (step 2): the run's tensors again (the trainer's file may have
/// changed while it was copied). Blocking.
pub(crate) fn check_copy(copy: &Path, source: &Path, layout: &Layout) -> Result<(), PublishError> {
    let c = Checkpoint::open(copy).map_err(|e| PublishError::of_source(source, e))?;
    c.check_lengths()
        .and_then(|()| c.check_layout(layout))
        .map_err(|e| PublishError::of_source(source, e))
}

/// Step 3 by a scan of every element of the hub's copy: no NaN or ±Inf. Blocking.
pub(crate) fn check_finite(copy: &Path, source: &Path) -> Result<(), PublishError> {
    let c = Checkpoint::open(copy).map_err(|e| PublishError::of_source(source, e))?;
    let bad = nonfinite(&c).map_err(|e| PublishError::of_source(source, e))?;
    if bad.is_empty() {
        return Ok(());
    }
    Err(PublishError::NonFinite(describe_nonfinite(source, &bad)))
}

/// Step 3's refusal when the diff found changed elements that became NaN or ±Inf.
pub(crate) fn nonfinite_changes(source: &Path, bad: &[NonFiniteChanges]) -> PublishError {
    let bad: Vec<NonFinite> = bad
        .iter()
        .map(|t| NonFinite {
            name: t.tensor.clone(),
            nan: t.nan,
            inf: t.inf,
        })
        .collect();
    PublishError::NonFinite(describe_nonfinite(source, &bad))
}

fn describe_nonfinite(source: &Path, bad: &[NonFinite]) -> String {
    const SHOWN: usize = 8;
    let mut list: Vec<String> = bad
        .iter()
        .take(SHOWN)
        .map(|t| format!("{} ({} NaN, {} ±Inf)", t.name, t.nan, t.inf))
        .collect();
    if bad.len() > SHOWN {
        list.push(format!("and {} more tensors", bad.len() - SHOWN));
    }
    format!(
        "{}: {} tensor{} hold{} NaN or ±Inf weights as BF16: {}; nothing was published (a \
         trainer that means it sends \"allow\": [\"nonfinite\"])",
        source.display(),
        bad.len(),
        if bad.len() == 1 { "" } else { "s" },
        if bad.len() == 1 { "s" } else { "" },
        list.join(", ")
    )
}

/// Refuses a checkpoint bit-identical to `base` (the latest version, `version`), step 4.
/// Blocking.
pub(crate) fn check_changed(
    base: &Path,
    copy: &Path,
    source: &Path,
    version: u64,
) -> Result<(), PublishError> {
    let old = Checkpoint::open(base)
        .map_err(|e| PublishError::Internal(anyhow::anyhow!("open the hub's snapshot: {e}")))?;
    let new = Checkpoint::open(copy).map_err(|e| PublishError::of_source(source, e))?;
    match first_change(&old, &new).map_err(|e| PublishError::of_source(source, e))? {
        Some(_) => Ok(()),
        None => Err(PublishError::Unchanged(format!(
            "{} is bit for bit version {version}, the latest: nothing to publish (a retried \
             publish that already succeeded is version {version}; a trainer that means it sends \
             \"allow\": [\"unchanged\"])",
            source.display()
        ))),
    }
}

/// Refuses a step lower than the latest version's (step 4).
pub(crate) fn check_step(
    step: Option<u64>,
    latest_step: Option<u64>,
    version: u64,
) -> Result<(), PublishError> {
    match (step, latest_step) {
        (Some(s), Some(p)) if s < p => Err(PublishError::StepBackwards(format!(
            "step {s} is before step {p}, which the latest version ({version}) was published \
             with; a trainer that resumed from an earlier checkpoint sends \"allow\": \
             [\"step_backwards\"]"
        ))),
        _ => Ok(()),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn paths_outside_the_publish_dirs_are_refused_alike_whether_they_exist_or_not() {
        let root = tempfile::tempdir().unwrap();
        let allowed = root.path().join("ckpt");
        let secret = root.path().join("secret");
        std::fs::create_dir_all(&allowed).unwrap();
        std::fs::create_dir_all(&secret).unwrap();
        std::fs::write(secret.join("signing.key"), b"0123456789").unwrap();
        let dirs = PublishDirs::new(std::slice::from_ref(&allowed)).unwrap();
        let answer = |p: &Path| match dirs.confine(p) {
            Err(PublishError::PathNotAllowed(m)) => m.replace(&p.display().to_string(), "P"),
            other => panic!("{p:?}: {other:?}"),
        };
        let exists = answer(&secret.join("signing.key"));
        let absent = answer(&secret.join("nothing-here"));
        assert_eq!(exists, absent, "the answer says nothing about the file");
        assert!(
            !exists.contains("10") && !exists.contains("0123"),
            "{exists}"
        );
        // `..` out of the directory, and a link inside it that leads out.
        answer(&allowed.join("../secret/signing.key"));
        std::os::unix::fs::symlink(secret.join("signing.key"), allowed.join("link")).unwrap();
        answer(&allowed.join("link"));
        // No directory configured: nothing is published.
        let none = PublishDirs::default();
        assert!(matches!(
            none.confine(&allowed.join("x")),
            Err(PublishError::PathNotAllowed(m)) if m.contains("--publish-dir")
        ));
    }

    #[test]
    fn a_fifo_is_refused_without_blocking() {
        let root = tempfile::tempdir().unwrap();
        let fifo = root.path().join("ckpt.safetensors");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        let dirs = PublishDirs::new(&[root.path().to_owned()]).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(open_source(&dirs, &Layout::new(), &fifo).map(|_| ()));
        });
        let r = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("opening a FIFO returns at once");
        assert!(
            matches!(&r, Err(PublishError::Unreadable(m)) if m.contains("not a regular file")),
            "{r:?}"
        );
    }

    #[test]
    fn steps_may_repeat_but_not_go_back() {
        assert!(check_step(Some(7), Some(7), 3).is_ok());
        assert!(check_step(Some(8), Some(7), 3).is_ok());
        assert!(check_step(None, Some(7), 3).is_ok());
        assert!(check_step(Some(1), None, 3).is_ok());
        assert!(matches!(
            check_step(Some(6), Some(7), 3),
            Err(PublishError::StepBackwards(m)) if m.contains("step 6 is before step 7")
        ));
    }
}

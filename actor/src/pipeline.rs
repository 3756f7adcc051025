//! The actor's weight pipeline: the [`Shell`] through which the receiving core
//! ([`starling_transport::follow`], run by [`starling_transport::drive`]) acts on the weights,
//! the store and the engine. Every decision — which source, what to fetch again, when a
//! version may be staged or activated, which source to drop — is the core's; this file only
//! does what it says and tells it how that went.
//!
//! - **Staging**: a version is begun as a [`Stager`] on the active weights (the core begins a
//!   version only once its base is active), and each frame is decoded and checked into it as
//!   it arrives, off the runtime's workers (`block_in_place`). The wire bytes are kept for the
//!   journal.
//! - **Activation**: seal (signature, every segment, base version and digest, post digest) and
//!   commit — a bare overwrite after every check, with an undo log — then journal the delta in
//!   the [`Store`] (durable before it is reported), load the engine at the job boundary, print
//!   `active VERSION DIGEST` and report `Active` upstream.
//! - **Anchors**: received next to the store while hashed (on a writer thread), checked
//!   against the hub's seal, this model and this version, then renamed into place.
//! - **Control round trip**: a `Ping` to the source followed each second, its `Pong` observed
//!   as `starling_actor_control_rtt_seconds` (what the relay measures to the hub, measured
//!   from each actor to its relay or hub).
//!
//! Prints `upstream ROLE NAME` on each subscription, `staged VERSION` when every frame of a
//! version is here, `restored anchor VERSION`, and `active VERSION DIGEST` after each
//! activation (`resume` and `refetch` lines come from [`starling_transport::drive`]).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use starling_checkpoint::deltafile::Model;
use starling_proto::delta::anchor::AnchorSeal;
use starling_proto::delta::apply::{Stager, StagingBuffers, UndoLog, VersionedWeights};
use starling_proto::delta::manifest::TrustPolicy;
use starling_proto::protocol::msg::{Message, PROTOCOL_VERSION, Role as MsgRole, StagingReport};
use starling_telemetry::Metrics;
use starling_transport::drive::Shell;
use starling_transport::endpoint::EndpointError;
use starling_transport::follow::Notice;
use starling_transport::framed::{DataStreamReader, StreamFrame};
use starling_transport::upstream::{Feed, SourceAddr, UpstreamError};
use tokio::sync::watch;

use crate::anchor;
use crate::engine::{Engine, StillStarting};
use crate::status::ActorStatus;
use crate::store::{Layout, Store};
use crate::worker::PipelineStatus;

/// A version being staged: its stager, its frames' wire bytes (for the journal) and the wall
/// time spent staging them (reported to the hub: [`StagingReport`]).
pub(crate) struct Staging {
    stager: Stager,
    raw: Vec<Vec<u8>>,
    busy: Duration,
}

/// The weight pipeline: the active weights, the store and the engine.
pub(crate) struct Pipeline<'a> {
    pub(crate) cfg: &'a crate::ActorConfig,
    pub(crate) name: &'a str,
    pub(crate) trust: &'a TrustPolicy,
    pub(crate) layout: Layout,
    pub(crate) store: Store,
    pub(crate) state: VersionedWeights<Model>,
    pub(crate) metrics: &'a Metrics,
    pub(crate) engine: Option<Arc<dyn Engine>>,
    pub(crate) status: watch::Sender<PipelineStatus>,
    pub(crate) shown: &'a ActorStatus,
    pub(crate) quarantine: Duration,
    /// Versions being staged (begun, not yet activated or discarded).
    pub(crate) staging: BTreeMap<u64, Staging>,
    /// The last activated version's undo log's vectors, which the next version stages into:
    /// freed instead, whether the next staging gets that memory back or faults fresh pages in
    /// would be up to the allocator's policy for idle memory (`apply::StagingBuffers`).
    pub(crate) staging_buffers: Arc<StagingBuffers>,
    /// The engine does not hold the active version: loading it failed after the version was
    /// committed (a vLLM server down or restarting). The engine's fingerprint then names the
    /// version it still holds, or none where it fenced itself, so the worker generates only
    /// with weights the engine proves and tags results with them; a tick tries to load the
    /// active version again when the retry is due.
    pub(crate) engine_behind: Option<EngineRetry>,
}

impl Shell for Pipeline<'_> {
    type Error = anyhow::Error;
    type Done = std::convert::Infallible;

    /// Who the actor is and what it holds.
    fn hello(&self) -> Message {
        Message::Hello {
            protocol: PROTOCOL_VERSION,
            role: MsgRole::Actor,
            name: self.name.to_owned(),
            region: self.cfg.region.clone(),
            model_id: self.cfg.model_id.clone(),
            active: Some((self.state.version(), self.state.digest().to_bytes())),
            link: Some(self.cfg.link.stated()),
        }
    }

    /// A stager on the active weights (the core begins a version only on its base).
    fn begin(&mut self, version: u64, _base: u64, _delta_id: [u8; 32]) -> bool {
        let stager = self
            .state
            .stager()
            .with_buffers(self.staging_buffers.clone());
        self.staging.insert(
            version,
            Staging {
                stager,
                raw: Vec::new(),
                busy: Duration::ZERO,
            },
        );
        true
    }

    /// Stages a frame against the untouched active weights (CPU work: off the runtime's
    /// workers).
    fn stage(&mut self, version: u64, frame: StreamFrame) -> bool {
        self.stage_batch(version, vec![frame])
    }

    /// Stages frames that came in together with one parallel decode of all their parts
    /// (`Stager::stage_frames`), so that an actor with more cores than a segment has parts
    /// keeps them busy when frames queue up behind its staging.
    fn stage_batch(&mut self, version: u64, frames: Vec<StreamFrame>) -> bool {
        let Some(s) = self.staging.get_mut(&version) else {
            return true;
        };
        let weights = self.state.weights();
        let t = Instant::now();
        let staged = tokio::task::block_in_place(|| match frames.as_slice() {
            [frame] => s.stager.stage_frame(frame.as_frame(), weights),
            _ => {
                let batch: Vec<_> = frames.iter().map(StreamFrame::as_frame).collect();
                s.stager.stage_frames(&batch, weights)
            }
        });
        s.busy += t.elapsed();
        s.raw.extend(frames.into_iter().map(|f| f.bytes));
        if let Err(e) = staged {
            let e = starling_process::error_chain(&e);
            tracing::warn!(version, "staging failed ({e}); fetching it again");
            self.staging.remove(&version);
            return false;
        }
        true
    }

    fn discard(&mut self, version: u64) {
        self.staging.remove(&version);
        self.status.send_modify(|s| s.unstage(version));
    }

    /// Seals and commits `version` (the weights are untouched unless every check passed),
    /// journals it, loads it into the engine and reports it. A version that does not verify
    /// is refused (`Some(false)`) and no longer reported staged; a store that fails stops the
    /// actor; an engine that fails to take the version is loaded again by the tick.
    async fn activate(
        &mut self,
        feed: &mut Feed,
        version: u64,
        started: Instant,
    ) -> Result<Option<bool>> {
        let Some(s) = self.staging.remove(&version) else {
            return Ok(Some(false));
        };
        // Every frame is staged by now (a version buffered while its base was not active was
        // said to be here before any of its frames was staged).
        let report = StagingReport {
            version,
            changes: s.stager.changes(),
            busy_ns: u64::try_from(s.busy.as_nanos()).unwrap_or(u64::MAX),
        };
        let (trust, state) = (self.trust, &mut self.state);
        let committed = tokio::task::block_in_place(|| -> Result<_> {
            let sealed = s.stager.seal(trust)?;
            let t = Instant::now();
            let written = state.commit(sealed)?;
            Ok((t.elapsed(), written))
        });
        let (apply, written) = match committed {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(version, "version refused: {e:#}");
                // Not staged any more: the hub stops counting on it until it is here again.
                self.status.send_modify(|s| s.unstage(version));
                return Ok(Some(false));
            }
        };
        self.status.send_modify(|s| s.staging = Some(report));
        self.metrics.observe_transfer(started.elapsed());
        self.metrics.observe_apply(apply);
        self.metrics.set_active(version);
        let frames: Vec<&[u8]> = s.raw.iter().map(Vec::as_slice).collect();
        tokio::task::block_in_place(|| self.store.record(version, &frames, &self.state))?;
        // The version is committed and journaled whatever the engine does: an engine that
        // fails to take it is loaded again by the tick, not the end of the actor.
        self.load_engine_or_retry(Some(&written));
        tracing::info!(
            version,
            engine_behind = self.engine_behind.is_some(),
            "version committed"
        );
        // The weights no longer need the undo log (nothing rolls a loaded version back).
        self.staging_buffers.recycle(written);
        println!("active {} {}", self.state.version(), self.state.digest());
        let digest = self.state.digest().to_bytes();
        feed.send_current(&Message::Active { version, digest })
            .await;
        Ok(Some(true))
    }

    async fn background(&mut self) -> Self::Done {
        std::future::pending().await
    }

    async fn finish(&mut self, _feed: &mut Feed, done: Self::Done) -> (u64, bool) {
        match done {}
    }

    async fn restore(&mut self, seal: AnchorSeal, stream: DataStreamReader) -> bool {
        let version = seal.version;
        match self.restore_anchor(seal, stream).await {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(version, "anchor refused: {e:#}");
                false
            }
        }
    }

    fn tick_every(&self) -> Option<Duration> {
        Some(TICK)
    }

    /// Measures the control round trip to the source followed now (the answer comes back to
    /// [`Shell::pong`]). Then loads the active version into an engine that lost it (its server
    /// died and was restarted); until that succeeds the engine's fingerprint does not match and
    /// the worker takes no work. A failure is retried when [`EngineRetry`] says.
    async fn tick(&mut self, feed: &mut Feed) {
        feed.ping().await;
        let retry_due = self.engine_behind.map(|r| r.due(Instant::now()));
        // An engine behind that still proves an older version (and works with it) is still
        // asked whether it died; one that proves nothing waits for its retry.
        let proves = self
            .engine
            .as_ref()
            .is_some_and(|e| e.fingerprint().is_some());
        if retry_due == Some(false) && !proves {
            return;
        }
        // Blocking: a vLLM engine may ask its server to digest the model (`--vllm-verify-every`;
        // the check spaces itself at least 20× its own last duration).
        let lost = retry_due == Some(true)
            || self
                .engine
                .as_ref()
                .is_some_and(|e| tokio::task::block_in_place(|| e.needs_reload()));
        if !lost {
            return;
        }
        if !self.engine_behind.is_some_and(|r| r.starting) {
            tracing::warn!(
                version = self.state.version(),
                "the engine does not hold the active version; loading it again"
            );
        }
        self.load_engine_or_retry(None);
    }

    fn pong(&mut self, rtt: Duration) {
        self.metrics.observe_control_rtt(rtt);
    }

    fn subscribed(&mut self, source: &SourceAddr, _after: u64) {
        println!("upstream {} {}", source.role.as_str(), source.name);
        self.shown.source(&source.name, source.role.as_str(), true);
    }

    fn left(&mut self, source: &SourceAddr) {
        self.shown.source(&source.name, source.role.as_str(), false);
    }

    fn not_reached(&mut self, error: UpstreamError) -> Result<()> {
        if let UpstreamError::Endpoint(EndpointError::ForeignCluster { .. }) = error {
            return Err(error).context("subscribe");
        }
        tracing::warn!(
            "source not reached: {}",
            starling_process::error_chain(&error)
        );
        Ok(())
    }

    fn notice(&mut self, n: Notice, source: Option<&SourceAddr>) -> Result<()> {
        let name = source.map_or("", |s| s.name.as_str());
        match n {
            Notice::Received { version } => {
                println!("staged {version}");
                self.metrics.staged();
                self.status.send_modify(|s| s.stage(version));
            }
            Notice::SourceDropped { .. } => {
                let quarantine_s = self.quarantine.as_secs_f64();
                tracing::error!(source = name, quarantine_s, "{n}");
                self.metrics.source_dropped(name);
            }
            Notice::Returning { .. } => tracing::info!(source = name, "{n}"),
            n => tracing::warn!(source = name, "{n}"),
        }
        Ok(())
    }
}

impl<'a> Pipeline<'a> {
    /// Restores an anchor ([`crate::anchor::receive`] verifies it); only then does it replace
    /// the active weights (renamed into place).
    async fn restore_anchor(
        &mut self,
        seal: AnchorSeal,
        mut stream: DataStreamReader,
    ) -> Result<()> {
        let expect = anchor::Expect {
            model_id: &self.cfg.model_id,
            trust: self.trust,
            layout: &self.layout,
            active: self.state.version(),
        };
        let got = anchor::receive(&seal, &mut stream, &self.cfg.store, expect).await?;
        tokio::task::block_in_place(|| self.store.install_snapshot(&got.file, seal.version))?;
        self.state =
            VersionedWeights::new(&self.cfg.model_id, got.weights, seal.version, got.digest);
        self.staging.clear();
        self.metrics.set_active(seal.version);
        // Restored once it is installed: the core and the store agree on the anchor whatever
        // the engine does (a failed load is retried by the tick, as after an activation).
        self.load_engine_or_retry(None);
        println!("restored anchor {}", seal.version);
        println!("active {} {}", self.state.version(), self.state.digest());
        Ok(())
    }

    /// [`Pipeline::load_engine`], and on failure the engine is behind until a tick loads
    /// the active version into it ([`Pipeline::engine_behind`]).
    fn load_engine_or_retry(&mut self, change: Option<&UndoLog>) {
        // A commit or a restore while the engine is behind does not try before the retry is
        // due: the try would block the pipeline as long as the failing one did. The tick's
        // retry loads the newest committed version.
        if self.engine_behind.is_some_and(|r| !r.due(Instant::now())) {
            tracing::info!(
                version = self.state.version(),
                "the engine is behind; the version is loaded at its next try"
            );
            return;
        }
        match self.load_engine(change) {
            Ok(()) => self.engine_behind = None,
            Err(e) if e.is::<StillStarting>() => {
                if self.engine_behind.is_none_or(|r| !r.starting) {
                    tracing::info!(
                        version = self.state.version(),
                        "the engine's server is starting; the active version is loaded once \
                         it answers, and versions are committed meanwhile"
                    );
                }
                self.engine_behind = Some(EngineRetry::while_starting(
                    self.engine_behind,
                    Instant::now(),
                ));
            }
            Err(e) => {
                let retry = EngineRetry::after_failure(self.engine_behind, Instant::now());
                tracing::error!(
                    version = self.state.version(),
                    retry_s = retry.wait.as_secs(),
                    "loading the active version into the engine failed; it takes no work \
                     until a load succeeds: {e:#}"
                );
                self.engine_behind = Some(retry);
            }
        }
    }

    /// Loads the active version into the engine (at the job boundary: a generation call in
    /// flight keeps the version it started with) and tells the worker.
    pub(crate) fn load_engine(&mut self, change: Option<&UndoLog>) -> Result<()> {
        let (version, digest) = (self.state.version(), self.state.digest().to_bytes());
        if let Some(engine) = &self.engine {
            let weights = self.state.weights();
            tokio::task::block_in_place(|| engine.load(weights, version, digest, change))?;
        }
        self.status.send_modify(|s| s.activate(version, digest));
        Ok(())
    }
}

/// How often the actor measures the control round trip to its source and asks its engine
/// whether it lost its weights (a dead vLLM server; not while an engine that is behind and
/// proves nothing waits for its retry).
const TICK: Duration = Duration::from_secs(1);

/// The longest wait between two tries to load the active version into an engine that is
/// behind.
const ENGINE_RETRY_MAX: Duration = Duration::from_secs(30);

/// When an engine that is behind is tried again: a tick after the first failure, then twice
/// as long after each failure, up to [`ENGINE_RETRY_MAX`], counted from the failure's end.
/// A try blocks the pipeline for as long as it takes (a full load digests the whole model),
/// so a try on every tick would leave the pipeline little time to stage and commit versions
/// between tries. An engine whose server is starting ([`StillStarting`]) is asked again at
/// every tick (each ask is a look at the server, not a failure) with the failures' backoff
/// kept for when the start fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct EngineRetry {
    at: Instant,
    wait: Duration,
    /// The last try found the engine's server starting.
    starting: bool,
}

impl EngineRetry {
    /// The retry after a failure at `now`, the one before it being `before`.
    fn after_failure(before: Option<Self>, now: Instant) -> Self {
        // (A first start that fails has no wait before it: zero, so one tick.)
        let wait = before.map_or(TICK, |r| (r.wait * 2).clamp(TICK, ENGINE_RETRY_MAX));
        Self {
            at: now + wait,
            wait,
            starting: false,
        }
    }

    /// The next look at a server that was starting at `now`: due at the next tick. The
    /// wait of the last failure before it stays, so a start that fails backs off from there.
    fn while_starting(before: Option<Self>, now: Instant) -> Self {
        Self {
            at: now + TICK / 2,
            wait: before.map_or(Duration::ZERO, |r| r.wait),
            starting: true,
        }
    }

    fn due(self, now: Instant) -> bool {
        now >= self.at
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_engine_behind_is_tried_again_ever_less_often_up_to_the_bound() {
        let t0 = Instant::now();
        let mut r = EngineRetry::after_failure(None, t0);
        assert_eq!(r.wait, TICK);
        assert!(!r.due(t0) && r.due(t0 + TICK));
        let mut waits = vec![r.wait.as_secs()];
        for _ in 0..7 {
            r = EngineRetry::after_failure(Some(r), t0);
            waits.push(r.wait.as_secs());
        }
        assert_eq!(waits, [1, 2, 4, 8, 16, 30, 30, 30]);
        // Counted from the failure's end, however long the try took.
        let late = t0 + Duration::from_secs(40);
        let r = EngineRetry::after_failure(Some(r), late);
        assert!(!r.due(late + Duration::from_secs(29)) && r.due(late + ENGINE_RETRY_MAX));
    }

    #[test]
    fn a_starting_server_is_looked_at_every_tick_and_a_failed_start_backs_off() {
        let t0 = Instant::now();
        // The first start: looked at by the next tick, and again while it starts.
        let mut r = EngineRetry::while_starting(None, t0);
        assert!(r.starting && !r.due(t0) && r.due(t0 + TICK));
        r = EngineRetry::while_starting(Some(r), t0 + TICK);
        assert!(r.due(t0 + 2 * TICK));
        // Its failure waits one tick; starts that fail after it back off as failures do.
        r = EngineRetry::after_failure(Some(r), t0);
        assert_eq!((r.wait, r.starting), (TICK, false));
        let mut waits = Vec::new();
        for _ in 0..6 {
            r = EngineRetry::while_starting(Some(r), t0);
            assert!(r.due(t0 + TICK));
            r = EngineRetry::after_failure(Some(r), t0);
            waits.push(r.wait.as_secs());
        }
        assert_eq!(waits, [2, 4, 8, 16, 30, 30]);
    }
}

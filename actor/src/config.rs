//! What an actor is configured with: its credentials and sources, the store, the link it
//! states, and the engine it generates with (`cli` builds these from the command line; tests
//! and `starling demo` build them directly).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use starling_engine::ModelConfig;
use starling_transport::link::LinkProfile;

use crate::engine::{BuiltinEngine, Engine};
use crate::vllm;

/// Where to subscribe: relays of the actor's region first, then the hub.
pub use starling_transport::upstream::SourceAddr as Source;

/// What the actor needs.
#[derive(Debug, Clone)]
pub struct ActorConfig {
    /// Credentials written by `starling-hub issue --role actor`.
    pub credentials: PathBuf,
    /// Tried in order; on failure or disconnect the next one (then around again).
    pub sources: Vec<Source>,
    /// The checkpoint to start from when the store holds none yet.
    pub init: PathBuf,
    /// Where the active weights are kept.
    pub store: PathBuf,
    pub region: String,
    pub model_id: String,
    pub link: LinkProfile,
    /// Where to serve `/metrics` (none: not served).
    pub http: Option<std::net::SocketAddr>,
    /// Generate rollouts with this engine (none: hold weights only).
    pub engine: Option<EngineSettings>,
    /// Read each version's full checkpoint from this directory instead of receiving deltas
    /// (the no-transfer baseline, [`crate::shared_dir`]); relays are not used.
    pub weights_dir: Option<PathBuf>,
}

/// The rollout engine and worker settings.
#[derive(Debug, Clone)]
pub struct EngineSettings {
    /// The model's HF `config.json`.
    pub model_config: PathBuf,
    /// Sequences decoded together.
    pub max_batch: u32,
    /// Groups claimed per generation call.
    pub claim: u32,
    /// Stretch each generation call to this many times its compute time (≥ 1; benchmarks).
    pub slowdown: f64,
    /// A label for the hardware (reported to the hub).
    pub hardware: String,
    /// Generate with a vLLM server (`vllm`) instead of the built-in engine.
    pub vllm: Option<vllm::VllmSettings>,
}

impl ActorConfig {
    /// The engine this configuration asks for (none: the actor holds weights only).
    pub(crate) fn build_engine(&self) -> Result<Option<Arc<dyn Engine>>> {
        Ok(match &self.engine {
            None => None,
            Some(e) if e.vllm.is_some() => {
                let settings = e.vllm.clone().context("vllm settings")?;
                Some(Arc::new(vllm::VllmEngine::new(
                    settings,
                    &e.model_config,
                    &self.model_id,
                    &self.store,
                    e.max_batch,
                )?))
            }
            Some(e) => {
                let config = ModelConfig::from_file(&e.model_config)
                    .with_context(|| format!("read {}", e.model_config.display()))?;
                Some(Arc::new(BuiltinEngine::new(
                    config,
                    &self.model_id,
                    e.max_batch,
                    e.slowdown,
                )?))
            }
        })
    }
}

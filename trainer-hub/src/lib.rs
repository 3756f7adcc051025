//! `starling-hub`: the trainer hub. The service (`serve`: publish, cut-through distribution,
//! the codec set of each version chosen by the links in `codecs`,
//! the HTTP API in `api`, the run board in `board`, status, events and dashboard in `status`), the cluster tools (`init`, `issue`, `keygen`), the delta
//! command-line tools (`delta diff|apply|inspect|verify`), the workload generator
//! (`bench gen`) and the small-scale demo.

pub mod anchors;
pub mod api;
mod archive;
mod board;
pub mod cli;
mod clock;
pub mod codecs;
mod durable;
pub mod ingest;
mod jobs;
pub mod keys;
pub mod limits;
mod results;
pub mod reward_service;
mod rollouts;
mod scoring;
pub mod serve;
mod snapshot;
mod status;
pub mod verify;

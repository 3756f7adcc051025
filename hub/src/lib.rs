//! `starling-hub`: the trainer hub. The service (`serve` wires it together: the hub's shared
//! parts in `hub`, publishing with cut-through distribution in `publish`, the codec set of
//! each version chosen by the links in `codecs`, the HTTP API in `api`, the run board in
//! `board`, status, events and dashboard in `status`), the cluster tools (`init`, `issue`,
//! `keygen`), the delta command-line tools (`delta diff|apply|inspect|verify`), the workload
//! generator (`bench gen`) and the small-scale demo.
//!
//! The modules form layers: `cli` on top, then `serve`, then what works on a running hub
//! (`api`, `status`, `publish`, `scoring`, `archive`), then `hub`, `jobs`, `durable` and
//! the rest; `clock` at the bottom. A module imports only from layers below it.

pub mod anchors;
pub mod api;
mod archive;
mod board;
pub mod cli;
mod clock;
pub mod codecs;
mod durable;
mod handover;
mod hub;
pub mod ingest;
mod jobs;
pub mod keys;
pub mod limits;
mod publish;
mod results;
pub mod reward_service;
mod rollouts;
mod scoring;
pub mod serve;
mod snapshot;
mod status;
pub mod verify;

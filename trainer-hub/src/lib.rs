//! `starling-hub`: the trainer hub. The service (`serve`: publish, cut-through distribution,
//! the HTTP API in `api`, the run board in `board`, status, events and dashboard in `status`), the cluster tools (`init`, `issue`, `keygen`), the delta
//! command-line tools (`delta diff|apply|inspect|verify`), the workload generator
//! (`bench gen`) and the small-scale demo.

pub mod anchors;
pub mod api;
mod board;
pub mod cli;
mod durable;
mod jobs;
pub mod keys;
pub mod limits;
mod rollouts;
pub mod serve;
mod snapshot;
mod status;
pub mod verify;

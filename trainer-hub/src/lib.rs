//! `starling-hub`: the trainer hub. This crate currently provides the delta command-line
//! tools (`delta diff|apply|inspect|verify`), key generation, the workload generator
//! (`bench gen`) and the small-scale demo; the hub service (ingest, distribution, ledger,
//! API) builds on them.

pub mod cli;
pub mod keys;
pub mod serve;

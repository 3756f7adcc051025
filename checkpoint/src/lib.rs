//! `starling-checkpoint`: checkpoints and deltas on disk.
//!
//! - [`safetensors`]: read single-file or sharded safetensors checkpoints range by range,
//!   casting F32/F16 to BF16 exactly as PyTorch does, with bounded memory;
//! - [`writer`]: write safetensors atomically (temporary file, fsync, rename);
//! - [`deltafile`]: diff two checkpoints into a `.sdc` (streaming, bounded memory), read
//!   a `.sdc` frame by frame, apply one to a checkpoint;
//! - [`scan`]: whole-checkpoint checks before publishing (NaN/±Inf by tensor, any change);
//! - [`workload`]: the deterministic generator of RL-like consecutive checkpoints.

#[cfg(target_endian = "big")]
compile_error!(
    "Starling reads little-endian tensor bytes in place; big-endian hosts are not supported"
);

pub mod deltafile;
pub mod safetensors;
pub mod scan;
pub mod workload;
pub mod writer;

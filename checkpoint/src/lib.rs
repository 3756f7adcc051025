//! Checkpoints on disk.

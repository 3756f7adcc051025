//! `starling-proto`: the pure core of Starling.
//!
//! Everything that defines what a delta checkpoint *is* lives here: the BF16 diff, the
//! per-part codecs, the segment and manifest structures, the container framing, the state
//! digest, and the transactional apply. The crate does no I/O, reads no clock (callers pass
//! creation times in) and spawns no tasks beyond rayon's data parallelism, which is what
//! makes it fast to test, fuzz and benchmark.
//!
//! Architecture invariants kept here:
//! - decoding yields **absolute new BF16 bit patterns**; applying is a pure overwrite, so an
//!   apply is idempotent and never does float arithmetic;
//! - every length read from input is bounded before it is trusted, and malformed input is a
//!   [`error::DecodeError`], never a panic;
//! - a frame's BLAKE3 is checked before any of its content is parsed.

pub mod anchor;
pub mod apply;
pub mod bf16;
pub mod codec;
pub mod container;
pub mod diff;
pub mod digest;
pub mod encode;
pub mod error;
pub mod hex_text;
pub mod manifest;
pub mod msg;
pub mod rollout;
pub mod segment;
pub mod wire;

pub use error::DecodeError;

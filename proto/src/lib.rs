//! `starling-proto`: the pure core of Starling.
//!
//! Everything that defines what a delta checkpoint *is* lives here, and the bytes peers
//! exchange about it:
//! - [`delta`]: the delta checkpoint format and its maths — the BF16 diff, the per-part
//!   codecs, the segment and manifest structures, the container framing, the state digest,
//!   the transactional apply and anchors' seals;
//! - [`protocol`]: the QUIC protocols' control messages (distribution and rollout jobs), which
//!   carry the delta's frames but add nothing to their format;
//! - shared by both: [`wire`] (varints and bounded length-prefixed fields), [`error`]
//!   ([`DecodeError`], re-exported here) and [`hex_text`] (the one spelling of hex).
//!
//! `protocol` depends on `delta`, never the reverse. The crate does no I/O, reads no clock
//! (callers pass creation times in) and spawns no tasks beyond rayon's data parallelism,
//! which is what makes it fast to test, fuzz and benchmark.
//!
//! Architecture invariants kept here:
//! - decoding yields **absolute new BF16 bit patterns**; applying is a pure overwrite, so an
//!   apply is idempotent and never does float arithmetic;
//! - every length read from input is bounded before it is trusted, and malformed input is a
//!   [`error::DecodeError`], never a panic;
//! - a frame's BLAKE3 is checked before any of its content is parsed.

pub mod delta;
pub mod error;
pub mod hex_text;
pub mod protocol;
pub mod wire;

pub use error::DecodeError;

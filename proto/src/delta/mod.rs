//! The delta checkpoint format and its maths: what a delta *is*, how it is made from two
//! versions of a model, and how a receiver checks and applies it (`docs/format.md`).
//!
//! From the bits up: [`bf16`] (bit patterns and the casts into them), [`diff`] (which
//! positions changed), [`codec`] (the per-part codecs), [`segment`] (parts packed into the unit
//! of streaming and verification), [`digest`] (the whole-state digest a delta moves),
//! [`manifest`] (what the delta turns into what, signed), [`container`] (the `.sdc` framing,
//! the same frames a wire carries), [`encode`] (the streaming encoder) and [`apply`] (staging,
//! sealing and committing, as a transaction); [`anchor`]: the signed seal of a full checkpoint,
//! under the same keys as manifests.
//!
//! Nothing here knows of the control messages that carry these frames between peers
//! ([`crate::protocol`] builds on this module, never the reverse).

pub mod anchor;
pub mod apply;
pub mod bf16;
pub mod codec;
pub mod container;
pub mod diff;
pub mod digest;
pub mod encode;
pub mod manifest;
pub mod segment;

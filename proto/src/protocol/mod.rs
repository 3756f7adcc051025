//! The QUIC protocols' messages: the control messages of distribution (hub ↔ relay ↔ actor)
//! and of the rollout job protocol (hub ↔ an actor's worker), as bytes.
//!
//! - [`msg`]: every control message and its framing (`type u8, body_len varint, body`), with
//!   a cheap [`msg::check`] before the allocating [`msg::Message::decode`];
//! - [`rollout`]: the plain data of rollout jobs, results and verdicts those messages carry,
//!   floats as exact bits.
//!
//! Segment and manifest frames travel as [`crate::delta::container`] defines them; messages
//! only name versions, segments and anchors ([`crate::delta::anchor::AnchorSeal`]). This module
//! depends on [`crate::delta`]; the delta format does not depend on it.

pub mod msg;
pub mod rollout;

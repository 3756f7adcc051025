//! `starling-transport`: who may talk to whom, and over what.
//!
//! - [`identity`]: the cluster's certificate authority and the credentials it issues to the
//!   hub, relays and actors (`starling-hub init` / `starling-hub issue`);
//! - [`endpoint`]: QUIC endpoints with mutual TLS against the cluster CA (a peer without valid
//!   credentials is refused during the handshake, before it can send anything), and the
//!   check that a peer's certificate proves the role and name it claims;
//! - [`link`]: transport parameters derived from a link profile (rate, RTT): BBR, and
//!   receive windows sized to the bandwidth-delay product so several streams do not overfill
//!   a long bottleneck and starve control traffic; [`ceiling`]: the sender's window capped at
//!   a peer's stated link rate × measured minimum RTT, so a bulk transfer leaves no standing
//!   queue for control messages to wait behind;
//! - [`framed`]: control messages over QUIC streams;
//! - [`admit`]: the Hello/Welcome/Refuse admission every server runs; [`connections`]: how
//!   many live connections of one kind (subscriptions, worker connections) an admitted
//!   certificate may hold; [`downstream`]: a relay's accept loop (admission, `Subscribe`, the
//!   subscription bound, serving until the subscriber leaves);
//! - [`book`]: the versions a server can send, each sendable while it still grows
//!   (cut-through);
//! - [`fanout`] and [`upstream`]: sending versions striped over several streams, and
//!   receiving them frame by frame; [`reception`]: what of a version is missing and when to
//!   ask for it again;
//! - [`follow`]: the receiving core of relays and actors (a version from announce to
//!   activation, the sources to follow), with no I/O and no clock, tested by simulation;
//!   [`upstream::Feed`] and [`drive`]: the I/O half and the loop both shells run, the relay and
//!   the actor each implementing [`drive::Shell`];
//! - [`anchor_file`]: receiving an anchor (full checkpoint) into a file, checked against its
//!   seal, off the event loop.
//!
//! Running a binary until it is stopped (signals, the service runner) is `starling-process`'s.

pub mod admit;
pub mod anchor_file;
pub mod book;
pub mod ceiling;
pub mod connections;
pub mod downstream;
pub mod drive;
pub mod endpoint;
pub mod fanout;
pub mod follow;
pub mod framed;
pub mod identity;
pub mod link;
pub mod reception;
pub mod upstream;

/// The ALPN protocol id of Starling's QUIC connections.
pub const ALPN: &[u8] = b"starling/1";

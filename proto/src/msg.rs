//! Control messages of the distribution protocol (hub ↔ relay ↔ actor), and their framing.
//!
//! Segment and manifest frames travel as the container defines them (self-hashing,
//! `crate::container`); everything else — who a peer is, what it has, what it needs, when to
//! activate — is one of these messages. A message is framed as `type u8, body_len varint,
//! body`. [`check`] tells whether a whole message is buffered (cheap, allocates nothing);
//! [`Message::decode`] then parses it, bounding every length. The transport adds TLS, so
//! messages carry no hash of their own.

use crate::error::DecodeError;
use crate::segment::MAX_NAME_LEN;
use crate::wire::{Reader, put_bytes, put_varint, varint_len};

/// Protocol version spoken by this build (in `Hello`).
pub const PROTOCOL_VERSION: u16 = 2;
/// The largest control message body accepted.
pub const MAX_MESSAGE_BODY: usize = 1 << 20;
/// The most streams one transmission of a version may be striped over.
pub const MAX_STRIPES: u16 = 64;

/// The most segment numbers one `Fetch` or `Staged` may list.
pub const MAX_SEQS: usize = 1 << 16;

/// What a peer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Role {
    Relay = 1,
    Actor = 2,
    /// The training side (holder of the hub's own credentials): may publish.
    Trainer = 3,
}

/// Why a peer refuses a request or a delta; each tells the other side what to do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum RefuseReason {
    /// The peer speaks another protocol version: upgrade one side.
    ProtocolVersion = 1,
    /// Credentials do not allow this role or name: fix the configuration.
    NotAuthorized = 2,
    /// The receiver's active version is not the delta's base: catch up (anchor + chain).
    WrongBase = 3,
    /// The requested version is no longer retained here: ask the hub or restore an anchor.
    VersionUnavailable = 4,
    /// A commit for a version that is not fully staged or not the next one.
    NotStaged = 5,
    /// A malformed or unexpected message.
    Protocol = 6,
}

/// One control message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// First message of a client: who it is and what it holds.
    Hello {
        protocol: u16,
        role: Role,
        name: String,
        region: String,
        model_id: String,
        /// Active version and state digest, if it holds weights at all.
        active: Option<(u64, [u8; 16])>,
        /// The link the peer receives over, as its operator stated it: (rate in bit/s, RTT in
        /// µs). The server caps what it keeps in flight to the peer accordingly.
        link: Option<(u64, u64)>,
    },
    /// The server's answer: the newest version it can serve.
    Welcome {
        latest_version: u64,
    },
    /// Send me every delta after `after_version` (and new ones as they come).
    Subscribe {
        after_version: u64,
    },
    /// The first message of a data stream: the frames that follow belong to `delta_id`.
    /// One transmission of a version (the first, or the answer to a `Fetch`) is striped
    /// over `stripes` streams that all carry the same `transmission` number, so a receiver
    /// knows when a transmission has ended on every stream.
    Announce {
        version: u64,
        base_version: u64,
        delta_id: [u8; 32],
        transmission: u32,
        stripes: u16,
    },
    /// Send these segments of `version` again (all of them when `seqs` is empty, and the
    /// manifest too).
    Fetch {
        version: u64,
        seqs: Vec<u32>,
    },
    /// Receiver report: `version` is staged except the `missing` segments.
    Staged {
        version: u64,
        missing: Vec<u32>,
    },
    /// Activate `version` at the next safe point. Idempotent; out of order is refused.
    Commit {
        version: u64,
    },
    /// Receiver report: now generating with `version`, whose digest is `digest`.
    Active {
        version: u64,
        digest: [u8; 16],
    },
    /// A refusal with a reason the peer can act on.
    Refuse {
        reason: RefuseReason,
        detail: String,
    },
    /// Trainer → hub: diff the checkpoint at `path` (on the hub's machine) against the current
    /// version and publish it.
    Publish {
        path: String,
    },
    /// Hub → trainer: published as `version`, with `changes` changed elements in `bytes`.
    Published {
        version: u64,
        changes: u64,
        bytes: u64,
    },
    /// Liveness and RTT probe; answered by a `Pong` with the same nonce.
    Ping {
        nonce: u64,
    },
    Pong {
        nonce: u64,
    },
    /// Receiver → server (a new source after failover): send `version` except the segments
    /// I already `have`, then `Commit` it; my subscription continues after it.
    Resume {
        version: u64,
        have: Vec<u32>,
    },
    /// Receiver → server: I hold `after_version` and you no longer have the deltas after it;
    /// send your newest anchor (a full checkpoint).
    FetchAnchor {
        after_version: u64,
    },
    /// The first message of a data stream carrying an anchor: `seal.size` bytes of
    /// safetensors follow; `seal` is signed by the hub (see `crate::anchor`).
    Anchor {
        seal: crate::anchor::AnchorSeal,
    },
}

impl Message {
    fn type_id(&self) -> u8 {
        match self {
            Self::Hello { .. } => 1,
            Self::Welcome { .. } => 2,
            Self::Subscribe { .. } => 3,
            Self::Announce { .. } => 4,
            Self::Fetch { .. } => 5,
            Self::Staged { .. } => 6,
            Self::Commit { .. } => 7,
            Self::Active { .. } => 8,
            Self::Refuse { .. } => 9,
            Self::Ping { .. } => 10,
            Self::Pong { .. } => 11,
            Self::Publish { .. } => 12,
            Self::Published { .. } => 13,
            Self::FetchAnchor { .. } => 14,
            Self::Anchor { .. } => 15,
            Self::Resume { .. } => 16,
        }
    }

    fn write_body(&self, out: &mut Vec<u8>) {
        match self {
            Self::Hello {
                protocol,
                role,
                name,
                region,
                model_id,
                active,
                link,
            } => {
                out.extend_from_slice(&protocol.to_le_bytes());
                out.push(*role as u8);
                put_bytes(out, name.as_bytes());
                put_bytes(out, region.as_bytes());
                put_bytes(out, model_id.as_bytes());
                match active {
                    None => out.push(0),
                    Some((v, d)) => {
                        out.push(1);
                        put_varint(out, *v);
                        out.extend_from_slice(d);
                    }
                }
                match link {
                    None => out.push(0),
                    Some((rate, rtt)) => {
                        out.push(1);
                        put_varint(out, *rate);
                        put_varint(out, *rtt);
                    }
                }
            }
            Self::Welcome { latest_version } => put_varint(out, *latest_version),
            Self::Subscribe { after_version } => put_varint(out, *after_version),
            Self::Announce {
                version,
                base_version,
                delta_id,
                transmission,
                stripes,
            } => {
                put_varint(out, *version);
                put_varint(out, *base_version);
                out.extend_from_slice(delta_id);
                put_varint(out, u64::from(*transmission));
                put_varint(out, u64::from(*stripes));
            }
            Self::Fetch { version, seqs }
            | Self::Resume {
                version,
                have: seqs,
            }
            | Self::Staged {
                version,
                missing: seqs,
            } => {
                put_varint(out, *version);
                put_seqs(out, seqs);
            }
            Self::Commit { version } => put_varint(out, *version),
            Self::Active { version, digest } => {
                put_varint(out, *version);
                out.extend_from_slice(digest);
            }
            Self::Refuse { reason, detail } => {
                out.push(*reason as u8);
                put_bytes(out, detail.as_bytes());
            }
            Self::Ping { nonce } | Self::Pong { nonce } => {
                out.extend_from_slice(&nonce.to_le_bytes())
            }
            Self::Publish { path } => put_bytes(out, path.as_bytes()),
            Self::FetchAnchor { after_version } => put_varint(out, *after_version),
            Self::Anchor { seal } => {
                put_varint(out, seal.version);
                put_varint(out, seal.size);
                out.extend_from_slice(&seal.hash);
                out.extend_from_slice(&seal.signature);
            }
            Self::Published {
                version,
                changes,
                bytes,
            } => {
                put_varint(out, *version);
                put_varint(out, *changes);
                put_varint(out, *bytes);
            }
        }
    }

    /// Appends the framed message to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let mut body = Vec::new();
        self.write_body(&mut body);
        out.push(self.type_id());
        put_varint(out, body.len() as u64);
        out.extend_from_slice(&body);
    }

    /// Length of the framed message.
    pub fn encoded_len(&self) -> usize {
        let mut body = Vec::new();
        self.write_body(&mut body);
        1 + varint_len(body.len() as u64) + body.len()
    }

    /// Parses one framed message at the start of `buf`; returns it and the bytes consumed.
    pub fn decode(buf: &[u8]) -> Result<(Self, usize), DecodeError> {
        let Some(total) = check(buf)? else {
            return Err(DecodeError::Truncated { what: "message" });
        };
        let mut r = Reader::new(&buf[..total]);
        let ty = r.u8("message type")?;
        let len = r.varint("message length")? as usize;
        let body = r.take(len, "message body")?;
        let mut r = Reader::new(body);
        let m = match ty {
            1 => {
                let protocol = r.u16_le("protocol version")?;
                let role = match r.u8("role")? {
                    1 => Role::Relay,
                    2 => Role::Actor,
                    3 => Role::Trainer,
                    id => return Err(DecodeError::UnknownCodec { what: "role", id }),
                };
                let name = r.str("peer name", MAX_NAME_LEN)?.to_owned();
                let region = r.str("region", MAX_NAME_LEN)?.to_owned();
                let model_id = r.str("model id", MAX_NAME_LEN)?.to_owned();
                let active = match r.u8("active flag")? {
                    0 => None,
                    1 => Some((r.varint("active version")?, r.array("active digest")?)),
                    f => return Err(DecodeError::malformed("hello", format!("active flag {f}"))),
                };
                let link = match r.u8("link flag")? {
                    0 => None,
                    1 => Some((r.varint("link rate")?, r.varint("link rtt")?)),
                    f => return Err(DecodeError::malformed("hello", format!("link flag {f}"))),
                };
                Self::Hello {
                    protocol,
                    role,
                    name,
                    region,
                    model_id,
                    active,
                    link,
                }
            }
            2 => Self::Welcome {
                latest_version: r.varint("version")?,
            },
            3 => Self::Subscribe {
                after_version: r.varint("version")?,
            },
            4 => Self::Announce {
                version: r.varint("version")?,
                base_version: r.varint("base version")?,
                delta_id: r.array("delta id")?,
                transmission: r.varint_at_most("transmission", u64::from(u32::MAX))? as u32,
                stripes: match r.varint_at_most("stripes", u64::from(MAX_STRIPES))? {
                    0 => return Err(DecodeError::malformed("announce", "zero stripes")),
                    n => n as u16,
                },
            },
            5 => Self::Fetch {
                version: r.varint("version")?,
                seqs: read_seqs(&mut r)?,
            },
            6 => Self::Staged {
                version: r.varint("version")?,
                missing: read_seqs(&mut r)?,
            },
            7 => Self::Commit {
                version: r.varint("version")?,
            },
            8 => Self::Active {
                version: r.varint("version")?,
                digest: r.array("digest")?,
            },
            9 => {
                let reason = match r.u8("refuse reason")? {
                    1 => RefuseReason::ProtocolVersion,
                    2 => RefuseReason::NotAuthorized,
                    3 => RefuseReason::WrongBase,
                    4 => RefuseReason::VersionUnavailable,
                    5 => RefuseReason::NotStaged,
                    6 => RefuseReason::Protocol,
                    id => {
                        return Err(DecodeError::UnknownCodec {
                            what: "refuse reason",
                            id,
                        });
                    }
                };
                Self::Refuse {
                    reason,
                    detail: r.str("refuse detail", MAX_NAME_LEN * 4)?.to_owned(),
                }
            }
            10 => Self::Ping {
                nonce: r.u64_le("nonce")?,
            },
            11 => Self::Pong {
                nonce: r.u64_le("nonce")?,
            },
            12 => Self::Publish {
                path: r.str("path", 4096)?.to_owned(),
            },
            13 => Self::Published {
                version: r.varint("version")?,
                changes: r.varint("changes")?,
                bytes: r.varint("bytes")?,
            },
            16 => Self::Resume {
                version: r.varint("version")?,
                have: read_seqs(&mut r)?,
            },
            14 => Self::FetchAnchor {
                after_version: r.varint("version")?,
            },
            15 => Self::Anchor {
                seal: crate::anchor::AnchorSeal {
                    version: r.varint("version")?,
                    size: r.varint("anchor size")?,
                    hash: r.array("anchor hash")?,
                    signature: r.array("anchor signature")?,
                },
            },
            id => {
                return Err(DecodeError::UnknownCodec {
                    what: "message type",
                    id,
                });
            }
        };
        r.finish("message")?;
        Ok((m, total))
    }
}

/// Whether a whole message is buffered at the start of `buf`: `Ok(Some(total_len))` if so,
/// `Ok(None)` if more bytes are needed, an error if the header is already invalid.
pub fn check(buf: &[u8]) -> Result<Option<usize>, DecodeError> {
    let Some(&ty) = buf.first() else {
        return Ok(None);
    };
    if !(1..=16).contains(&ty) {
        return Err(DecodeError::UnknownCodec {
            what: "message type",
            id: ty,
        });
    }
    let mut r = Reader::new(&buf[1..]);
    let len = match r.varint_at_most("message length", MAX_MESSAGE_BODY as u64) {
        Ok(l) => l as usize,
        Err(DecodeError::Truncated { .. }) => return Ok(None),
        Err(e) => return Err(e),
    };
    let total = 1 + r.position() + len;
    Ok((buf.len() >= total).then_some(total))
}

/// Segment numbers as ascending deltas (compact for runs of missing segments).
fn put_seqs(out: &mut Vec<u8>, seqs: &[u32]) {
    put_varint(out, seqs.len() as u64);
    let mut prev = 0u32;
    for (i, &s) in seqs.iter().enumerate() {
        put_varint(
            out,
            u64::from(if i == 0 { s } else { s.wrapping_sub(prev) }),
        );
        prev = s;
    }
}

fn read_seqs(r: &mut Reader<'_>) -> Result<Vec<u32>, DecodeError> {
    let n = r.varint_at_most("segment count", MAX_SEQS as u64)? as usize;
    let mut out = Vec::with_capacity(n.min(r.remaining()));
    let mut prev: u64 = 0;
    for i in 0..n {
        let d = r.varint("segment number")?;
        if i > 0 && d == 0 {
            return Err(DecodeError::malformed(
                "segment list",
                "not strictly ascending",
            ));
        }
        prev = if i == 0 { d } else { prev + d };
        if prev > u64::from(u32::MAX) {
            return Err(DecodeError::malformed(
                "segment list",
                "segment number above 2^32",
            ));
        }
        out.push(prev as u32);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn all_kinds() -> Vec<Message> {
        vec![
            Message::Hello {
                protocol: PROTOCOL_VERSION,
                role: Role::Actor,
                name: "a-1".into(),
                region: "eu".into(),
                model_id: "m".into(),
                active: Some((7, [1; 16])),
                link: None,
            },
            Message::Hello {
                protocol: PROTOCOL_VERSION,
                role: Role::Relay,
                name: "r".into(),
                region: "us".into(),
                model_id: "m".into(),
                active: None,
                link: Some((250_000_000, 150_000)),
            },
            Message::Welcome { latest_version: 9 },
            Message::Subscribe { after_version: 3 },
            Message::Announce {
                version: 4,
                base_version: 3,
                delta_id: [5; 32],
                transmission: 7,
                stripes: 4,
            },
            Message::Fetch {
                version: 4,
                seqs: vec![0, 2, 3, 300],
            },
            Message::Fetch {
                version: 4,
                seqs: vec![],
            },
            Message::Staged {
                version: 4,
                missing: vec![1],
            },
            Message::Commit { version: 4 },
            Message::Active {
                version: 4,
                digest: [2; 16],
            },
            Message::Refuse {
                reason: RefuseReason::WrongBase,
                detail: "active 2, delta base 3".into(),
            },
            Message::Ping { nonce: 42 },
            Message::Pong { nonce: 42 },
            Message::Publish {
                path: "/ckpt/step-7".into(),
            },
            Message::Published {
                version: 7,
                changes: 1000,
                bytes: 1300,
            },
            Message::FetchAnchor { after_version: 3 },
            Message::Resume {
                version: 5,
                have: vec![0, 1, 7],
            },
            Message::Anchor {
                seal: crate::anchor::AnchorSeal {
                    version: 16,
                    size: 1 << 33,
                    hash: [9; 32],
                    signature: [8; 64],
                },
            },
        ]
    }

    #[test]
    fn golden_bytes() {
        let mut out = Vec::new();
        Message::Commit { version: 300 }.encode(&mut out);
        assert_eq!(out, [7, 2, 0xac, 0x02]);
        let mut out = Vec::new();
        Message::Fetch {
            version: 1,
            seqs: vec![2, 5],
        }
        .encode(&mut out);
        assert_eq!(out, [5, 4, 1, 2, 2, 3]);
    }

    #[test]
    fn every_kind_round_trips_and_every_truncation_needs_more() {
        for m in all_kinds() {
            let mut buf = Vec::new();
            m.encode(&mut buf);
            assert_eq!(buf.len(), m.encoded_len());
            assert_eq!(check(&buf), Ok(Some(buf.len())));
            assert_eq!(Message::decode(&buf), Ok((m.clone(), buf.len())));
            for cut in 0..buf.len() {
                assert_eq!(check(&buf[..cut]), Ok(None), "{m:?} cut at {cut}");
                assert!(Message::decode(&buf[..cut]).is_err());
            }
            // Two messages back to back: the first is parsed exactly.
            let mut two = buf.clone();
            two.extend_from_slice(&buf);
            assert_eq!(Message::decode(&two).map(|(_, n)| n), Ok(buf.len()));
        }
    }

    #[test]
    fn oversized_and_unknown_are_refused_early() {
        let mut b = vec![5u8];
        put_varint(&mut b, (MAX_MESSAGE_BODY + 1) as u64);
        assert!(matches!(check(&b), Err(DecodeError::TooLarge { .. })));
        assert!(matches!(
            check(&[0, 0]),
            Err(DecodeError::UnknownCodec { .. })
        ));
        assert!(matches!(
            check(&[200]),
            Err(DecodeError::UnknownCodec { .. })
        ));
        // Non-ascending segment lists.
        assert!(Message::decode(&[5, 4, 1, 2, 2, 0]).is_err());
    }

    proptest! {
        #[test]
        fn fetch_lists_round_trip(mut seqs in proptest::collection::btree_set(any::<u32>(), 0..100).prop_map(|s| s.into_iter().collect::<Vec<_>>()), v in any::<u64>()) {
            seqs.sort_unstable();
            let m = Message::Fetch { version: v, seqs };
            let mut buf = Vec::new();
            m.encode(&mut buf);
            prop_assert_eq!(Message::decode(&buf), Ok((m, buf.len())));
        }

        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            if let Ok((m, n)) = Message::decode(&bytes) {
                prop_assert!(n <= bytes.len());
                let mut again = Vec::new();
                m.encode(&mut again);
                prop_assert_eq!(Message::decode(&again).map(|x| x.0), Ok(m));
            }
        }
    }
}

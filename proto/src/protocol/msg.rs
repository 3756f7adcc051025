//! Control messages of the distribution protocol (hub ↔ relay ↔ actor), and their framing.
//!
//! Segment and manifest frames travel as the container defines them (self-hashing,
//! `crate::delta::container`); everything else — who a peer is, what it has, what it needs,
//! when to activate — is one of these messages. A message is framed as `type u8, body_len varint,
//! body`. [`check`] tells whether a whole message is buffered (cheap, allocates nothing);
//! [`Message::decode`] then parses it, bounding every length. The transport adds TLS, so
//! messages carry no hash of their own.
//!
//! Besides distribution, the same framing carries the rollout job protocol between the hub
//! and an actor's worker connection (`Work`, `Heartbeat`, `StagingTime`, `Claim`, `Jobs`,
//! `Progress`, `Submit`, `Verdicts`; `docs/api.md`); their payloads are the types of
//! [`crate::protocol::rollout`], which keep their own invariants at decode.

use crate::delta::segment::MAX_NAME_LEN;
use crate::error::DecodeError;
use crate::protocol::rollout::{JobResult, JobSpec, MAX_JOBS_PER_MESSAGE, Verdict};
use crate::wire::{Reader, put_bytes, put_varint, varint_len};

/// Protocol version spoken by this build (in `Hello`). 2: `Hello` states the client's link.
/// 3: an actor's worker sends `StagingTime`, which a hub of version 2 would answer by
/// dropping the connection.
pub const PROTOCOL_VERSION: u16 = 3;
/// The oldest client version a server of this build admits ([`PROTOCOL_VERSION`] and every
/// version down to this one): each version since has only added messages a client sends, so
/// an older client never receives a message it does not know. A server refuses a client
/// outside the range at admission, naming both. A deployment therefore upgrades from the
/// top: the hub first, then the relays, then the actors, each step admitted by the one above
/// it (`docs/distribution.md`). A version that adds a message a server sends must either
/// raise this floor or send that message only to clients that said they know it.
pub const MIN_PEER_PROTOCOL: u16 = 2;
/// The largest control message body accepted: 16 MiB.
///
/// A `Submit` carries whole groups with every token and log-probability (about 7 bytes a
/// token): one group of 16 samples of 8k tokens is already ~0.9 MiB, so the former 1 MiB
/// limit could not hold even a few groups. 16 MiB holds a typical batch's worth while still
/// bounding what a receiver buffers for one message (`check` refuses a longer declared
/// length before anything is read).
pub const MAX_MESSAGE_BODY: usize = 16 << 20;
/// The most streams one transmission of a version may be striped over.
pub const MAX_STRIPES: u16 = 64;

/// The most segment numbers one `Fetch` or `Staged` may list.
pub const MAX_SEQS: usize = 1 << 16;

/// What a peer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
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
    /// The peer sent one kind of message faster than the receiver allows (the detail names
    /// the kind and the bound): slow down; the connection is closed.
    RateLimited = 7,
    /// The peer's credentials already hold as many connections of this kind as allowed:
    /// close one (or wait for a dead one to time out) before opening another.
    TooManyConnections = 8,
}

/// The message type ids `check` knows.
const KNOWN_TYPES: std::ops::RangeInclusive<u8> = 1..=25;

/// How long an actor's staging of one version took: `busy_ns` nanoseconds of wall time in its
/// staging calls (decoding against the base, the digest updates and the undo log, on as many
/// of its cores as staging uses) for `changes` changed elements. Time spent waiting on the
/// wire is not in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagingReport {
    pub version: u64,
    pub changes: u64,
    pub busy_ns: u64,
}

impl StagingReport {
    /// Staging seconds per changed element, where the version had changes.
    pub fn seconds_per_change(&self) -> Option<f64> {
        (self.changes > 0).then(|| self.busy_ns as f64 * 1e-9 / self.changes as f64)
    }
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
    /// Activate `version` at the next safe point. Idempotent. Versions activate strictly in
    /// order: a `Commit` for a later version than the next one is held until every version
    /// before it is active (a server may commit v+2 while the receiver is still activating
    /// v+1), is never applied on another base (the delta's base version and digest are checked
    /// at seal), and one for a version at or below the active one is ignored.
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
    /// version and publish it. With `handover` the trainer gives the file to the hub, which
    /// takes it by a rename where it can instead of copying it (message type 24 rather than 12,
    /// same body: a hub that predates it drops the connection on the unknown type).
    Publish {
        path: String,
        handover: bool,
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
    /// safetensors follow; `seal` is signed by the hub (see `crate::delta::anchor`).
    Anchor {
        seal: crate::delta::anchor::AnchorSeal,
    },
    /// Actor → hub, first on a worker connection: register (or re-register) as a rollout
    /// worker. `engine` and `hardware` are at most `MAX_NAME_LEN` bytes.
    Work {
        engine: String,
        hardware: String,
        max_batch: u32,
    },
    /// Actor → hub, every second: the active version and its digest (if any), and the
    /// version being staged (if any).
    Heartbeat {
        active: Option<(u64, [u8; 16])>,
        staged: Option<u64>,
    },
    /// Actor → hub: lease me up to `max` jobs (at most `MAX_JOBS_PER_MESSAGE`).
    Claim {
        max: u32,
    },
    /// Hub → actor: the jobs leased in answer to a `Claim` (possibly none).
    Jobs {
        jobs: Vec<JobSpec>,
    },
    /// Actor → hub: results, one per job.
    Submit {
        results: Vec<JobResult>,
    },
    /// Hub → actor: a verdict per submitted job id.
    Verdicts {
        verdicts: Vec<(u64, Verdict)>,
    },
    /// Actor → hub, about every second while generating: for each job it holds (at most
    /// `MAX_JOBS_PER_MESSAGE`), the tokens generated for it so far (all samples together).
    /// The hub extends the leases of an actor whose generation moves; no answer.
    Progress {
        jobs: Vec<(u64, u64)>,
    },
    /// Actor → hub, once per version it staged (and again on a new worker connection): how
    /// long staging took. The hub's codec choice predicts staging from the slowest actor's
    /// report (`starling-hub`'s `codecs`); no answer.
    StagingTime {
        report: StagingReport,
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
            Self::Publish {
                handover: false, ..
            } => 12,
            Self::Publish { handover: true, .. } => 24,
            Self::Published { .. } => 13,
            Self::FetchAnchor { .. } => 14,
            Self::Anchor { .. } => 15,
            Self::Resume { .. } => 16,
            Self::Work { .. } => 17,
            Self::Heartbeat { .. } => 18,
            Self::Claim { .. } => 19,
            Self::Jobs { .. } => 20,
            Self::Submit { .. } => 21,
            Self::Verdicts { .. } => 22,
            Self::Progress { .. } => 23,
            Self::StagingTime { .. } => 25,
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
                put_active(out, active);
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
            Self::Publish { path, .. } => put_bytes(out, path.as_bytes()),
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
            Self::Work {
                engine,
                hardware,
                max_batch,
            } => {
                put_bytes(out, engine.as_bytes());
                put_bytes(out, hardware.as_bytes());
                put_varint(out, u64::from(*max_batch));
            }
            Self::Heartbeat { active, staged } => {
                put_active(out, active);
                match staged {
                    None => out.push(0),
                    Some(v) => {
                        out.push(1);
                        put_varint(out, *v);
                    }
                }
            }
            Self::Claim { max } => put_varint(out, u64::from(*max)),
            Self::Jobs { jobs } => {
                put_varint(out, jobs.len() as u64);
                for j in jobs {
                    j.write(out);
                }
            }
            Self::Submit { results } => {
                put_varint(out, results.len() as u64);
                for res in results {
                    res.write(out);
                }
            }
            Self::Verdicts { verdicts } => {
                put_varint(out, verdicts.len() as u64);
                for (job, v) in verdicts {
                    put_varint(out, *job);
                    v.write(out);
                }
            }
            Self::Progress { jobs } => {
                put_varint(out, jobs.len() as u64);
                for (job, tokens) in jobs {
                    put_varint(out, *job);
                    put_varint(out, *tokens);
                }
            }
            Self::StagingTime { report } => {
                put_varint(out, report.version);
                put_varint(out, report.changes);
                put_varint(out, report.busy_ns);
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
                let active = read_active(&mut r, "hello")?;
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
                    7 => RefuseReason::RateLimited,
                    8 => RefuseReason::TooManyConnections,
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
            12 | 24 => Self::Publish {
                path: r.str("path", 4096)?.to_owned(),
                handover: ty == 24,
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
                seal: crate::delta::anchor::AnchorSeal {
                    version: r.varint("version")?,
                    size: r.varint("anchor size")?,
                    hash: r.array("anchor hash")?,
                    signature: r.array("anchor signature")?,
                },
            },
            17 => Self::Work {
                engine: r.str("engine", MAX_NAME_LEN)?.to_owned(),
                hardware: r.str("hardware", MAX_NAME_LEN)?.to_owned(),
                max_batch: r.varint_at_most("max batch", u64::from(u32::MAX))? as u32,
            },
            18 => Self::Heartbeat {
                active: read_active(&mut r, "heartbeat")?,
                staged: match r.u8("staged flag")? {
                    0 => None,
                    1 => Some(r.varint("staged version")?),
                    f => {
                        return Err(DecodeError::malformed(
                            "heartbeat",
                            format!("staged flag {f}"),
                        ));
                    }
                },
            },
            19 => Self::Claim {
                max: r.varint_at_most("claim size", MAX_JOBS_PER_MESSAGE as u64)? as u32,
            },
            20 => Self::Jobs {
                jobs: read_list(&mut r, "job count", JobSpec::read)?,
            },
            21 => Self::Submit {
                results: read_list(&mut r, "result count", JobResult::read)?,
            },
            22 => Self::Verdicts {
                verdicts: read_list(&mut r, "verdict count", |r| {
                    Ok((r.varint("job id")?, Verdict::read(r)?))
                })?,
            },
            25 => Self::StagingTime {
                report: StagingReport {
                    version: r.varint("staged version")?,
                    changes: r.varint("staged changes")?,
                    busy_ns: r.varint("staging time")?,
                },
            },
            23 => Self::Progress {
                jobs: read_list(&mut r, "progress count", |r| {
                    Ok((r.varint("job id")?, r.varint("tokens so far")?))
                })?,
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
    if !KNOWN_TYPES.contains(&ty) {
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

/// An optional (version, state digest): a flag byte, then the pair.
fn put_active(out: &mut Vec<u8>, active: &Option<(u64, [u8; 16])>) {
    match active {
        None => out.push(0),
        Some((v, d)) => {
            out.push(1);
            put_varint(out, *v);
            out.extend_from_slice(d);
        }
    }
}

fn read_active(
    r: &mut Reader<'_>,
    what: &'static str,
) -> Result<Option<(u64, [u8; 16])>, DecodeError> {
    match r.u8("active flag")? {
        0 => Ok(None),
        1 => Ok(Some((
            r.varint("active version")?,
            r.array("active digest")?,
        ))),
        f => Err(DecodeError::malformed(what, format!("active flag {f}"))),
    }
}

/// A count of at most `MAX_JOBS_PER_MESSAGE`, then that many items. Every item takes at
/// least one byte, so nothing reserves more than the bytes left could describe.
fn read_list<'a, T>(
    r: &mut Reader<'a>,
    what: &'static str,
    item: impl Fn(&mut Reader<'a>) -> Result<T, DecodeError>,
) -> Result<Vec<T>, DecodeError> {
    let n = r.varint_at_most(what, MAX_JOBS_PER_MESSAGE as u64)? as usize;
    let mut out = Vec::with_capacity(n.min(r.remaining()));
    for _ in 0..n {
        out.push(item(r)?);
    }
    Ok(out)
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
    use crate::protocol::rollout::{
        FinishReason, MAX_NEW_TOKENS, MAX_PROMPT_TOKENS, MAX_SAMPLES, MAX_SPANS, MAX_STOP_TOKENS,
        Sample, SamplingParams, VersionSpan,
    };
    use proptest::prelude::*;

    fn small_job() -> JobSpec {
        JobSpec {
            job: 1,
            version: 2,
            attempt: 0,
            lease_expires_ms: 1000,
            group: 3,
            prompt: vec![5, 300],
            n: 2,
            sampling: SamplingParams {
                temperature: 1.0,
                top_p: 0.5,
                top_k: 0,
                max_new_tokens: 8,
                stop_token_ids: vec![2],
                seed: 7,
            },
        }
    }

    fn small_result() -> JobResult {
        JobResult {
            job: 1,
            attempt: 0,
            version: 2,
            digest: [0x11; 16],
            elapsed_us: 500,
            samples: vec![Sample {
                tokens: vec![7, 2],
                logprobs: vec![-0.5, 0.0],
                finish: FinishReason::Stop,
                spans: vec![VersionSpan {
                    version: 2,
                    start: 0,
                    end: 2,
                }],
                ttft_us: 10,
                decode_us: 20,
            }],
        }
    }

    /// A result with two version spans, odd floats and an empty sample.
    fn mixed_result() -> JobResult {
        let three = Sample {
            tokens: vec![1, 151_643, u32::MAX],
            logprobs: vec![f32::from_bits(0x7fc0_1234), -0.0, f32::NEG_INFINITY],
            finish: FinishReason::Length,
            spans: vec![
                VersionSpan {
                    version: 4,
                    start: 0,
                    end: 1,
                },
                VersionSpan {
                    version: 5,
                    start: 1,
                    end: 3,
                },
            ],
            ttft_us: 1 << 40,
            decode_us: 0,
        };
        let empty = Sample {
            tokens: vec![],
            logprobs: vec![],
            finish: FinishReason::Aborted,
            spans: vec![],
            ttft_us: 0,
            decode_us: 0,
        };
        JobResult {
            job: u64::MAX,
            attempt: u32::MAX,
            version: 5,
            digest: [0xfe; 16],
            elapsed_us: 123_456,
            samples: vec![three, empty],
        }
    }

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
                handover: false,
            },
            Message::Publish {
                path: "/ckpt/step-8".into(),
                handover: true,
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
                seal: crate::delta::anchor::AnchorSeal {
                    version: 16,
                    size: 1 << 33,
                    hash: [9; 32],
                    signature: [8; 64],
                },
            },
            Message::Work {
                engine: "builtin-qwen3".into(),
                hardware: "cpu-16".into(),
                max_batch: 64,
            },
            Message::Heartbeat {
                active: Some((7, [3; 16])),
                staged: Some(8),
            },
            Message::Heartbeat {
                active: None,
                staged: None,
            },
            Message::Claim { max: 4 },
            Message::Progress { jobs: vec![] },
            Message::StagingTime {
                report: StagingReport {
                    version: 7,
                    changes: 1 << 40,
                    busy_ns: u64::MAX,
                },
            },
            Message::Progress {
                jobs: vec![(1, 0), (u64::MAX, 1 << 40)],
            },
            Message::Refuse {
                reason: RefuseReason::RateLimited,
                detail: "heartbeats above 20/s".into(),
            },
            Message::Refuse {
                reason: RefuseReason::TooManyConnections,
                detail: "2 worker connections".into(),
            },
            Message::Jobs { jobs: vec![] },
            Message::Jobs {
                jobs: vec![small_job(), {
                    let mut j = small_job();
                    j.prompt = vec![];
                    j.n = MAX_SAMPLES as u32;
                    j.sampling.temperature = f32::from_bits(1); // a subnormal
                    j.sampling.stop_token_ids = vec![];
                    j.sampling.seed = u64::MAX;
                    j
                }],
            },
            Message::Submit { results: vec![] },
            Message::Submit {
                results: vec![small_result(), mixed_result()],
            },
            Message::Verdicts {
                verdicts: vec![
                    (1, Verdict::Accepted),
                    (
                        2,
                        Verdict::Refused {
                            code: "stale".into(),
                            detail: "job 2: version 3 is older than the staleness bound".into(),
                        },
                    ),
                ],
            },
        ]
    }

    /// Frames `body` as a message of type `ty`.
    fn framed(ty: u8, body: &[u8]) -> Vec<u8> {
        let mut out = vec![ty];
        put_varint(&mut out, body.len() as u64);
        out.extend_from_slice(body);
        out
    }

    fn encoded(m: &Message) -> Vec<u8> {
        let mut out = Vec::new();
        m.encode(&mut out);
        out
    }

    fn submit_bytes(sample: Sample) -> Vec<u8> {
        let mut r = small_result();
        r.samples = vec![sample];
        encoded(&Message::Submit { results: vec![r] })
    }

    fn span(version: u64, start: u32, end: u32) -> VersionSpan {
        VersionSpan {
            version,
            start,
            end,
        }
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

        assert_eq!(encoded(&Message::Claim { max: 300 }), [19, 2, 0xac, 0x02]);
        let m = Message::Work {
            engine: "e".into(),
            hardware: "h".into(),
            max_batch: 8,
        };
        assert_eq!(encoded(&m), [17, 5, 1, b'e', 1, b'h', 8]);

        let mut hb = vec![18, 19, 1, 3];
        hb.extend_from_slice(&[0xaa; 16]);
        hb.push(0); // nothing staged
        let m = Message::Heartbeat {
            active: Some((3, [0xaa; 16])),
            staged: None,
        };
        assert_eq!(encoded(&m), hb);
        let m = Message::Heartbeat {
            active: None,
            staged: Some(300),
        };
        assert_eq!(encoded(&m), [18, 4, 0, 1, 0xac, 0x02]);

        #[rustfmt::skip]
        let jobs = [
            20, 25, // type, body length
            1, // one job
            1, 2, 0, 0xe8, 0x07, 3, // job 1, version 2, attempt 0, lease 1000 ms, group 3
            2, 5, 0xac, 0x02, // prompt [5, 300]
            2, // n
            0x00, 0x00, 0x80, 0x3f, // temperature 1.0 (bits 0x3f80_0000, little-endian)
            0x00, 0x00, 0x00, 0x3f, // top_p 0.5
            0, 8, // top_k 0, max_new_tokens 8
            1, 2, // stop tokens [2]
            7, // seed
        ];
        assert_eq!(
            encoded(&Message::Jobs {
                jobs: vec![small_job()]
            }),
            jobs
        );

        #[rustfmt::skip]
        let submit = [
            21, 42, // type, body length
            1, // one result
            1, 0, 2, // job 1, attempt 0, version 2
            0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11,
            0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, // digest
            0xf4, 0x03, // elapsed 500 µs
            1, // one sample
            2, 7, 2, // tokens [7, 2]
            2, 0x00, 0x00, 0x00, 0xbf, 0x00, 0x00, 0x00, 0x00, // logprobs [-0.5, 0.0]
            1, // finish: stop
            1, 2, 0, 2, // spans [version 2: 0..2]
            10, 20, // ttft 10 µs, decode 20 µs
        ];
        assert_eq!(
            encoded(&Message::Submit {
                results: vec![small_result()]
            }),
            submit
        );

        let m = Message::Verdicts {
            verdicts: vec![
                (1, Verdict::Accepted),
                (
                    2,
                    Verdict::Refused {
                        code: "late".into(),
                        detail: String::new(),
                    },
                ),
            ],
        };
        assert_eq!(
            encoded(&m),
            [22, 11, 2, 1, 1, 2, 2, 4, b'l', b'a', b't', b'e', 0]
        );

        // Two jobs: 7 at 300 tokens, 9 at none yet.
        let m = Message::Progress {
            jobs: vec![(7, 300), (9, 0)],
        };
        assert_eq!(encoded(&m), [23, 6, 2, 7, 0xac, 0x02, 9, 0]);

        // Version 300 staged: 5 changes in 1000 ns.
        let m = Message::StagingTime {
            report: StagingReport {
                version: 300,
                changes: 5,
                busy_ns: 1000,
            },
        };
        assert_eq!(encoded(&m), [25, 5, 0xac, 0x02, 5, 0xe8, 0x07]);
        let m = Message::Refuse {
            reason: RefuseReason::RateLimited,
            detail: "hb".into(),
        };
        assert_eq!(encoded(&m), [9, 4, 7, 2, b'h', b'b']);
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
    fn every_body_truncation_and_extension_is_refused() {
        // The frame says the body is shorter (or longer) than the fields it holds: every body
        // is self-delimiting, so no proper prefix decodes, and extra bytes are refused.
        for m in all_kinds() {
            let mut body = Vec::new();
            m.write_body(&mut body);
            let ty = m.type_id();
            for cut in 0..body.len() {
                assert!(
                    Message::decode(&framed(ty, &body[..cut])).is_err(),
                    "{m:?} body cut at {cut}"
                );
            }
            let mut longer = body.clone();
            longer.push(0);
            assert!(matches!(
                Message::decode(&framed(ty, &longer)),
                Err(DecodeError::TrailingBytes { .. })
            ));
        }
    }

    #[test]
    fn malformed_samples_are_refused() {
        let good = small_result().samples.remove(0);
        assert!(Message::decode(&submit_bytes(good.clone())).is_ok());

        let bad = |s: Sample| {
            assert!(s.validate().is_err(), "{s:?} validates");
            assert!(
                matches!(
                    Message::decode(&submit_bytes(s.clone())),
                    Err(DecodeError::Malformed { .. })
                ),
                "{s:?} decodes"
            );
        };
        // One log-probability short, and one too many.
        bad(Sample {
            logprobs: vec![-0.5],
            ..good.clone()
        });
        bad(Sample {
            logprobs: vec![-0.5, 0.0, 0.0],
            ..good.clone()
        });
        let three = Sample {
            tokens: vec![1, 2, 3],
            logprobs: vec![0.0; 3],
            spans: vec![span(1, 0, 3)],
            ..good.clone()
        };
        assert!(three.validate().is_ok());
        let with = |spans: Vec<VersionSpan>| Sample {
            spans,
            ..three.clone()
        };
        assert!(with(vec![span(1, 0, 1), span(2, 1, 3)]).validate().is_ok());
        bad(with(vec![span(1, 0, 2), span(2, 1, 3)])); // overlap
        bad(with(vec![span(1, 0, 1), span(2, 2, 3)])); // gap
        bad(with(vec![span(1, 0, 4)])); // past the end
        bad(with(vec![span(1, 0, 3), span(2, 3, 4)])); // past the end, after a full cover
        bad(with(vec![span(1, 0, 2)])); // falls short
        bad(with(vec![span(1, 1, 3)])); // does not start at 0
        bad(with(vec![span(2, 1, 3), span(1, 0, 1)])); // out of order
        bad(with(vec![span(1, 0, 0), span(1, 0, 3)])); // empty span
        bad(with(vec![span(1, 0, 3), span(1, 3, 3)])); // empty span at the end
        bad(with(vec![span(1, 3, 1)])); // reversed
        bad(with(vec![])); // tokens without spans
        bad(Sample {
            tokens: vec![],
            logprobs: vec![],
            spans: vec![span(1, 0, 0)],
            ..good.clone()
        });
        // An unknown finish reason.
        let mut b = submit_bytes(good);
        let finish = b.len() - 7; // finish, span count, span (3), ttft, decode
        assert_eq!(b[finish], FinishReason::Stop as u8);
        b[finish] = 4;
        assert!(matches!(
            Message::decode(&b),
            Err(DecodeError::UnknownCodec { .. })
        ));
    }

    #[test]
    fn malformed_jobs_are_refused() {
        let bad = |j: JobSpec| {
            assert!(j.validate().is_err(), "{j:?} validates");
            let b = encoded(&Message::Jobs { jobs: vec![j] });
            assert!(Message::decode(&b).is_err());
        };
        bad(JobSpec {
            n: 0,
            ..small_job()
        });
        bad(JobSpec {
            n: MAX_SAMPLES as u32 + 1,
            ..small_job()
        });
        let mut j = small_job();
        j.sampling.max_new_tokens = MAX_NEW_TOKENS as u32 + 1;
        bad(j);
        let mut j = small_job();
        j.sampling.stop_token_ids = vec![1; MAX_STOP_TOKENS + 1];
        bad(j);
        bad(JobSpec {
            prompt: vec![1; MAX_PROMPT_TOKENS + 1],
            ..small_job()
        });
        // At the bounds, all is well.
        let mut j = small_job();
        j.n = MAX_SAMPLES as u32;
        j.prompt = vec![1; MAX_PROMPT_TOKENS];
        j.sampling.max_new_tokens = MAX_NEW_TOKENS as u32;
        j.sampling.stop_token_ids = vec![1; MAX_STOP_TOKENS];
        let m = Message::Jobs { jobs: vec![j] };
        assert_eq!(Message::decode(&encoded(&m)).map(|x| x.0), Ok(m));
        // A verdict of an unknown kind, a refusal code over its bound.
        assert!(matches!(
            Message::decode(&[22, 3, 1, 9, 3]),
            Err(DecodeError::UnknownCodec { .. })
        ));
        let m = Message::Verdicts {
            verdicts: vec![(
                1,
                Verdict::Refused {
                    code: "x".repeat(crate::protocol::rollout::MAX_CODE_LEN + 1),
                    detail: String::new(),
                },
            )],
        };
        assert!(matches!(
            Message::decode(&encoded(&m)),
            Err(DecodeError::TooLarge { .. })
        ));
    }

    #[test]
    fn counts_over_their_bounds_fail_before_allocating() {
        // Each body is the fields before one count, then that count: first u32::MAX with
        // nothing after it, then one over the bound. Both must be refused as too large
        // (nothing was reserved for them); a count within its bound but beyond the bytes left
        // is merely truncated.
        let job_head: &[u8] = &[1, 2, 0, 0, 3]; // job, version, attempt, lease, group
        let sampling_head: &[u8] = &[0, 0, 0x80, 0x3f, 0, 0, 0, 0x3f, 0]; // floats, top_k
        let result_head: Vec<u8> = [&[1u8, 0, 2][..], &[0; 16], &[0]].concat();
        let cases: Vec<(u8, Vec<u8>, usize)> = vec![
            (19, vec![], MAX_JOBS_PER_MESSAGE),
            (20, vec![], MAX_JOBS_PER_MESSAGE),
            (21, vec![], MAX_JOBS_PER_MESSAGE),
            (22, vec![], MAX_JOBS_PER_MESSAGE),
            (23, vec![], MAX_JOBS_PER_MESSAGE),
            (20, [&[1u8][..], job_head].concat(), MAX_PROMPT_TOKENS),
            (20, [&[1u8][..], job_head, &[0]].concat(), MAX_SAMPLES),
            (
                20,
                [&[1u8][..], job_head, &[0, 1], sampling_head].concat(),
                MAX_NEW_TOKENS,
            ),
            (
                20,
                [&[1u8][..], job_head, &[0, 1], sampling_head, &[8]].concat(),
                MAX_STOP_TOKENS,
            ),
            (21, [&[1u8][..], &result_head].concat(), MAX_SAMPLES),
            (
                21,
                [&[1u8][..], &result_head, &[1]].concat(),
                MAX_NEW_TOKENS,
            ),
            (
                21,
                [&[1u8][..], &result_head, &[1, 0]].concat(),
                MAX_NEW_TOKENS,
            ),
            (
                21,
                [&[1u8][..], &result_head, &[1, 0, 0, 1]].concat(),
                MAX_SPANS,
            ),
        ];
        for (ty, head, limit) in cases {
            for count in [u64::from(u32::MAX), limit as u64 + 1] {
                let mut body = head.clone();
                put_varint(&mut body, count);
                let got = Message::decode(&framed(ty, &body));
                assert!(
                    matches!(got, Err(DecodeError::TooLarge { value, .. }) if value == count),
                    "type {ty}, head {head:?}, count {count}: {got:?}"
                );
            }
            let mut body = head.clone();
            put_varint(&mut body, limit as u64);
            body.push(1);
            let got = Message::decode(&framed(ty, &body));
            if ty == 19 {
                // A claim is a bare number: the extra byte trails.
                assert!(matches!(got, Err(DecodeError::TrailingBytes { .. })));
            } else {
                assert!(
                    matches!(got, Err(DecodeError::Truncated { .. })),
                    "type {ty}, head {head:?}: {got:?}"
                );
            }
        }
        // Work's strings and max_batch.
        let mut body = Vec::new();
        put_varint(&mut body, u64::from(u32::MAX));
        assert!(matches!(
            Message::decode(&framed(17, &body)),
            Err(DecodeError::TooLarge { .. })
        ));
        let body = [&[0u8, 0][..], &[0x80, 0x80, 0x80, 0x80, 0x10]].concat(); // 2^32
        assert!(matches!(
            Message::decode(&framed(17, &body)),
            Err(DecodeError::TooLarge { .. })
        ));
        // A progress entry cut after its job id, and an unknown refusal reason.
        assert!(matches!(
            Message::decode(&[23, 2, 1, 7]),
            Err(DecodeError::Truncated { .. })
        ));
        assert!(matches!(
            Message::decode(&[9, 2, 9, 0]),
            Err(DecodeError::UnknownCodec { .. })
        ));
        // Bad option flags.
        assert!(Message::decode(&[18, 2, 2, 0]).is_err());
        assert!(Message::decode(&[18, 2, 0, 2]).is_err());
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
        fn progress_round_trips(jobs in proptest::collection::vec((any::<u64>(), any::<u64>()), 0..64)) {
            let m = Message::Progress { jobs };
            let buf = encoded(&m);
            prop_assert_eq!(buf.len(), m.encoded_len());
            prop_assert_eq!(Message::decode(&buf), Ok((m, buf.len())));
        }

        #[test]
        fn jobs_round_trip(jobs in proptest::collection::vec(job_spec(), 0..4)) {
            let m = Message::Jobs { jobs };
            let buf = encoded(&m);
            prop_assert_eq!(buf.len(), m.encoded_len());
            let (back, n) = Message::decode(&buf).expect("a valid job decodes");
            prop_assert_eq!(n, buf.len());
            let (Message::Jobs { jobs: a }, Message::Jobs { jobs: b }) = (&m, &back) else {
                panic!("not Jobs: {back:?}");
            };
            for (a, b) in a.iter().zip(b) {
                prop_assert_eq!(a.sampling.temperature.to_bits(), b.sampling.temperature.to_bits());
                prop_assert_eq!(a.sampling.top_p.to_bits(), b.sampling.top_p.to_bits());
            }
            prop_assert_eq!(back, m);
        }

        #[test]
        fn results_round_trip_bit_for_bit(results in proptest::collection::vec(job_result(), 0..4)) {
            let m = Message::Submit { results };
            let buf = encoded(&m);
            prop_assert_eq!(buf.len(), m.encoded_len());
            let (back, n) = Message::decode(&buf).expect("a valid result decodes");
            prop_assert_eq!(n, buf.len());
            let (Message::Submit { results: a }, Message::Submit { results: b }) = (&m, &back) else {
                panic!("not Submit: {back:?}");
            };
            prop_assert_eq!(a.len(), b.len());
            for (a, b) in a.iter().zip(b) {
                for (a, b) in a.samples.iter().zip(&b.samples) {
                    let bits = |s: &Sample| s.logprobs.iter().map(|p| p.to_bits()).collect::<Vec<_>>();
                    prop_assert_eq!(bits(a), bits(b));
                    prop_assert_eq!(&a.tokens, &b.tokens);
                    prop_assert_eq!(&a.spans, &b.spans);
                }
            }
            prop_assert_eq!(back, m);
        }

        #[test]
        fn perturbed_rollout_messages_never_panic(
            which in 0usize..4,
            flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..4),
        ) {
            let m = match which {
                0 => Message::Jobs { jobs: vec![small_job()] },
                1 => Message::Submit { results: vec![mixed_result()] },
                2 => Message::Progress { jobs: vec![(1, 300), (u64::MAX, 0)] },
                _ => Message::Verdicts { verdicts: vec![(1, Verdict::Accepted), (2, Verdict::Refused { code: "c".into(), detail: "d".into() })] },
            };
            let mut buf = encoded(&m);
            for (at, x) in flips {
                let at = at % buf.len();
                buf[at] ^= x;
            }
            if let Ok((m, n)) = Message::decode(&buf) {
                prop_assert!(n <= buf.len());
                if let Message::Submit { results } = &m {
                    for r in results {
                        prop_assert!(r.validate().is_ok());
                    }
                }
                if let Message::Jobs { jobs } = &m {
                    for j in jobs {
                        prop_assert!(j.validate().is_ok());
                    }
                }
                let again = encoded(&m);
                prop_assert_eq!(Message::decode(&again).map(|x| x.0), Ok(m));
            }
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

    /// Any bit pattern, with the awkward ones (NaN payloads of both kinds and signs, ±0, ±inf,
    /// subnormals) drawn often.
    fn f32_bits() -> impl Strategy<Value = f32> {
        prop_oneof![
            any::<u32>(),
            prop::sample::select(vec![
                0x7fc0_0000u32, // quiet NaN
                0xffc0_0001,    // negative quiet NaN with a payload
                0x7f80_0001,    // signalling NaN
                0x7fbf_ffff,    // signalling NaN, full payload
                0x0000_0000,    // +0
                0x8000_0000,    // -0
                0x7f80_0000,    // +inf
                0xff80_0000,    // -inf
                0x0000_0001,    // smallest subnormal
                0x807f_ffff,    // largest negative subnormal
            ]),
        ]
        .prop_map(f32::from_bits)
    }

    fn job_spec() -> impl Strategy<Value = JobSpec> {
        (
            (
                any::<u64>(),
                any::<u64>(),
                any::<u32>(),
                any::<u64>(),
                any::<u32>(),
            ),
            proptest::collection::vec(any::<u32>(), 0..200),
            1..=MAX_SAMPLES as u32,
            (
                f32_bits(),
                f32_bits(),
                any::<u32>(),
                0..=MAX_NEW_TOKENS as u32,
            ),
            proptest::collection::vec(any::<u32>(), 0..=MAX_STOP_TOKENS),
            any::<u64>(),
        )
            .prop_map(
                |(
                    (job, version, attempt, lease_expires_ms, group),
                    prompt,
                    n,
                    (t, p, k, m),
                    stop,
                    seed,
                )| {
                    JobSpec {
                        job,
                        version,
                        attempt,
                        lease_expires_ms,
                        group,
                        prompt,
                        n,
                        sampling: SamplingParams {
                            temperature: t,
                            top_p: p,
                            top_k: k,
                            max_new_tokens: m,
                            stop_token_ids: stop,
                            seed,
                        },
                    }
                },
            )
    }

    fn sample() -> impl Strategy<Value = Sample> {
        proptest::collection::vec(any::<u32>(), 0..100).prop_flat_map(|tokens| {
            let len = tokens.len();
            (
                Just(tokens),
                proptest::collection::vec(f32_bits(), len),
                proptest::collection::btree_set(1..len.max(2), 0..8),
                proptest::collection::vec(any::<u64>(), 9),
                prop::sample::select(vec![
                    FinishReason::Stop,
                    FinishReason::Length,
                    FinishReason::Aborted,
                ]),
                any::<u64>(),
                any::<u64>(),
            )
                .prop_map(
                    move |(tokens, logprobs, cuts, versions, finish, ttft_us, decode_us)| {
                        // Cut 0..len at the chosen interior points: the spans tile the tokens.
                        let mut bounds = vec![0];
                        bounds.extend(cuts.into_iter().filter(|&c| c < len));
                        bounds.push(len);
                        let spans = if len == 0 {
                            vec![]
                        } else {
                            bounds
                                .windows(2)
                                .zip(&versions)
                                .map(|(w, &v)| span(v, w[0] as u32, w[1] as u32))
                                .collect()
                        };
                        Sample {
                            tokens,
                            logprobs,
                            finish,
                            spans,
                            ttft_us,
                            decode_us,
                        }
                    },
                )
        })
    }

    fn job_result() -> impl Strategy<Value = JobResult> {
        (
            (
                any::<u64>(),
                any::<u32>(),
                any::<u64>(),
                any::<[u8; 16]>(),
                any::<u64>(),
            ),
            proptest::collection::vec(sample(), 0..5),
        )
            .prop_map(
                |((job, attempt, version, digest, elapsed_us), samples)| JobResult {
                    job,
                    attempt,
                    version,
                    digest,
                    elapsed_us,
                    samples,
                },
            )
    }
}

//! Which codecs a version is encoded with: `--codecs fast|small|auto`.
//!
//! The smallest codecs (`small`: positions counted within base-exponent classes and ULP
//! steps, both range-coded) make a delta ~1.5× smaller than the first release's (`fast`:
//! Rice or LEB128 positions, ULP residual + zstd), but cost several times the CPU per change
//! to encode and to stage. Which of them delivers a version sooner depends on the link: over a
//! slow link the bytes are the latency, over a fast one the encoder and the actors' staging
//! are. With `auto` the hub decides per version, from
//! - each region's link: what its relay (or an actor subscribed to the hub) stated in
//!   `Hello`, or `--peer-link`; with no link known, a LAN;
//! - this version's own pair: before it is encoded, one part-sized range of its largest
//!   tensor is diffed, encoded and decoded with both sets, twice, the faster pass counting
//!   (tens of milliseconds), which gives each set's encode and decode time per element and
//!   its bytes per change, and the density;
//! - how fast the hub's whole encodes ran against that single-core sample (its parallel
//!   speed-up and its share of a busy machine), measured on every publish;
//!
//! and takes the set whose predicted latency is smallest for the slowest region (the small set
//! only where it wins clearly: `SMALL_MUST_WIN_BY`). Staging is what the slowest actor
//! reported in its heartbeats: the wall time its staging of a recent version took per change,
//! on its own cores (`StagingReport`), carried over to the other set by the sample's ratio of
//! the two sets' decode times. Before any actor with a worker has reported (and for actors
//! without one, which send no heartbeats) it is the decode of every change on one core at the
//! hub's measured speed. With cut-through (the default) a version's segments go out as they
//! are encoded and actors stage them as they arrive, so encoder, link and staging work at
//! once and the slowest of them sets the pace: `max(encode, wire, staging)`. With
//! `--store-and-forward` the hub sends only once the whole delta is durable, so the encode
//! comes first: `encode + max(wire, staging)`. (The pipeline's fill and drain, one segment's
//! encode and staging, are milliseconds and left out.) `GET /v1/status` (`codecs`) and the
//! dashboard say which set was chosen and why, with the estimates of both.
//!
//! The prediction is a model, not a measurement: its inputs are in the status so an operator
//! can check it against the versions' delivery times, and pin a set (`fast`, `small`) when
//! it is wrong.

use std::time::Instant;

use serde_json::{Value, json};
use starling_checkpoint::safetensors::{Checkpoint, SourceDtype, TensorInfo};
use starling_proto::delta::diff::{RangeDiff, diff_range_into, diff_range_ranked_into};
use starling_proto::delta::segment::{CodecChoice, EncodedPart};
use starling_proto::protocol::msg::StagingReport;
use starling_transport::link::LinkProfile;

/// What the operator asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CodecPolicy {
    /// Always the first release's codecs (fastest to encode and stage).
    Fast,
    /// Always the smallest codecs.
    Small,
    /// Per version, the set predicted to reach the slowest region first (the small set
    /// only where it is predicted to win by 15%).
    Auto,
}

impl CodecPolicy {
    pub fn name(self) -> &'static str {
        match self {
            Self::Fast => "fast",
            Self::Small => "small",
            Self::Auto => "auto",
        }
    }
}

/// A set of codecs the encoder may choose from, per part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CodecSet {
    Small,
    Fast,
}

impl CodecSet {
    pub const ALL: [CodecSet; 2] = [CodecSet::Small, CodecSet::Fast];

    pub fn name(self) -> &'static str {
        match self {
            Self::Small => "small",
            Self::Fast => "fast",
        }
    }

    /// The encoder's candidates.
    pub fn choice(self) -> CodecChoice {
        match self {
            Self::Small => CodecChoice::default(),
            Self::Fast => CodecChoice::fast(),
        }
    }

    fn index(self) -> usize {
        match self {
            Self::Small => 0,
            Self::Fast => 1,
        }
    }
}

/// Elements of the sample (one encoder part).
const SAMPLE_ELEMS: usize = 1 << 22;
/// Times each set is run on the sample; the fastest counts.
const SAMPLE_PASSES: usize = 2;

/// `auto` takes the small set only where its predicted latency is at most this share of the
/// fast set's. The model is kinder to the small set than delivery is: it takes the overlap of
/// encode, wire and staging as perfect, and the encoder's speed from a sample on an idle
/// core, while a slower encoder also leaves the sender short of data, which on a long lossy
/// link costs goodput. Measured (`docs/benchmarks.md`, "Delta delivery over emulated WAN
/// links"): at 300 Mbit/s, 150 ms, 0.5% loss the small set was predicted 0.91× the fast set's
/// time and took 2.4–2.8× as long; at 50 Mbit/s, and at 100 Mbit/s without loss, it was
/// predicted 0.70× and took 0.72–0.83×.
const SMALL_MUST_WIN_BY: f64 = 0.85;

/// Weight of a new observation in the running figures.
const EMA: f64 = 0.5;

/// How many recent versions' codec sets the chooser remembers: a staging report of an older
/// version (or of one this hub did not choose) is not used.
const RECENT_VERSIONS: usize = 16;

/// A report is taken within this factor of the sample's one-core figure either way: an actor
/// with 100 times a core's speed, or a hundredth of it, is beyond any machine a report could
/// honestly describe, and one broken (or hostile) actor's figure must not pin the choice.
const REPORT_WITHIN: f64 = 100.0;

/// The most actors whose staging reports are kept (a worker connection per actor is bounded
/// by the hub's limits; this bounds the map whatever they are).
const MAX_REPORTS: usize = 4096;

/// One set's cost on the sample, one core.
#[derive(Debug, Clone, Copy, PartialEq)]
struct SampleCost {
    /// Diff and encode, seconds.
    encode_s: f64,
    /// Decode against the base (what staging does besides the digest), seconds.
    decode_s: f64,
    /// Coded payload bytes.
    bytes: u64,
}

/// Both sets measured on one range of a version's pair.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    tensor: String,
    elements: u64,
    changes: u64,
    costs: [SampleCost; 2],
}

/// Diffs, encodes and decodes one part-sized range of the largest BF16 tensor of `old` →
/// `new` with both sets. `None` when the checkpoints have no BF16 tensor or it cannot be
/// read (the choice then falls back to the last one or the policy's default).
pub fn sample(old: &Checkpoint, new: &Checkpoint) -> Option<Sample> {
    let (to, tn) = old
        .tensors()
        .iter()
        .zip(new.tensors())
        .filter(|(t, _)| t.dtype == SourceDtype::Bf16)
        .max_by_key(|(t, _)| t.numel())?;
    let numel = to.numel();
    let len = usize::try_from(numel).ok()?.min(SAMPLE_ELEMS);
    let start = (numel - len as u64) / 2;
    let o = range(old, to, start, len)?;
    let n = range(new, tn, start, len)?;
    let mut measured: [Option<SampleCost>; 2] = [None; 2];
    let mut changes = 0;
    let mut d = RangeDiff::default();
    // Each set twice, keeping its faster time: the first pass pays for the pages the diff's
    // vectors fault in and for whatever else the machine is doing at that moment, which
    // would otherwise count against whichever set is measured first.
    for _ in 0..SAMPLE_PASSES {
        for set in CodecSet::ALL {
            let t = Instant::now();
            match set {
                CodecSet::Small => diff_range_ranked_into(&o, &n, &mut d),
                CodecSet::Fast => diff_range_into(&o, &n, &mut d),
            }
            let part = EncodedPart::encode(&to.name, start, &o, &n, &d, &set.choice());
            let encode_s = t.elapsed().as_secs_f64();
            let t = Instant::now();
            let decoded = part.decode_changes(&o).ok()?;
            let decode_s = t.elapsed().as_secs_f64();
            changes = decoded.positions.len() as u64;
            let c = &mut measured[set.index()];
            *c = Some(SampleCost {
                encode_s: c.map_or(encode_s, |c| c.encode_s.min(encode_s)),
                decode_s: c.map_or(decode_s, |c| c.decode_s.min(decode_s)),
                bytes: part.payload_len() as u64,
            });
        }
    }
    let costs = [measured[0]?, measured[1]?];
    Some(Sample {
        tensor: to.name.clone(),
        elements: len as u64,
        changes,
        costs,
    })
}

fn range(c: &Checkpoint, t: &TensorInfo, start: u64, len: usize) -> Option<Vec<u16>> {
    if let Some(s) = c.bf16_range(t, start, len) {
        return Some(s.to_vec());
    }
    let mut v = vec![0u16; len];
    c.read_bf16(t, start, &mut v).ok()?;
    Some(v)
}

/// A subscriber's link, as the board knows it.
#[derive(Debug, Clone, PartialEq)]
pub struct PeerLink {
    pub peer: String,
    pub region: String,
    pub link: LinkProfile,
}

/// One set's predicted delivery of a version.
#[derive(Debug, Clone, PartialEq)]
pub struct Estimate {
    pub set: CodecSet,
    pub bytes: f64,
    pub encode_s: f64,
    /// On the slowest link.
    pub wire_s: f64,
    pub stage_s: f64,
    pub latency_s: f64,
}

impl Estimate {
    fn json(&self) -> Value {
        json!({
            "set": self.set.name(),
            "bytes": self.bytes.round(),
            "encode_s": round3(self.encode_s),
            "wire_s": round3(self.wire_s),
            "stage_s": round3(self.stage_s),
            "latency_s": round3(self.latency_s),
        })
    }
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// The choice for one version.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub version: u64,
    pub set: CodecSet,
    pub why: String,
    pub estimates: Vec<Estimate>,
    /// The slowest link the estimates assumed (`None`: no link known, a LAN).
    pub slowest: Option<PeerLink>,
    /// The actor report staging was predicted from (`None`: the hub's sample, one core).
    pub staging_from: Option<ReportedStaging>,
}

/// The slowest actor's staging report, as the estimates used it.
#[derive(Debug, Clone, PartialEq)]
pub struct ReportedStaging {
    pub actor: String,
    pub report: StagingReport,
    /// The set the reported version was encoded with.
    pub set: CodecSet,
    /// Seconds per change for each set (the reported one as measured, the other scaled by
    /// the decode times' ratio).
    pub per_change_s: [f64; 2],
    /// Whether the measured figure was outside `REPORT_WITHIN` of the sample's and taken at
    /// that bound.
    pub clamped: bool,
}

/// Costs assumed before anything was measured (codec-bench on the 2-vCPU development
/// machine, 1–5% density, the small set with its table-driven codecs): per element scanned
/// and per change, one core.
const PRIOR_ENCODE_NS_PER_ELEM: [f64; 2] = [1.0, 0.6];
const PRIOR_BYTES_PER_CHANGE: [f64; 2] = [0.8, 1.25];
const PRIOR_DECODE_NS_PER_CHANGE: [f64; 2] = [55.0, 25.0];

/// The per-version chooser. Owned by the hub; every method is cheap but `sample`.
#[derive(Debug)]
pub struct Chooser {
    policy: CodecPolicy,
    /// Whole encodes' wall time ÷ the sample's one-core prediction for the same set.
    speedup: [Option<f64>; 2],
    /// Changes of the last version (a step resembles the one before).
    last_changes: Option<u64>,
    last: Option<Decision>,
    /// The last whole encode: set, wall seconds, changes.
    observed: Option<(CodecSet, f64, u64)>,
    threads: usize,
    /// Whether segments go out as they are encoded (the hub's default), so that encode, wire
    /// and staging overlap.
    cut_through: bool,
    /// The set each of the last `RECENT_VERSIONS` decisions chose.
    sets: std::collections::BTreeMap<u64, CodecSet>,
    /// Each actor's newest staging report.
    reports: std::collections::BTreeMap<String, StagingReport>,
}

impl Chooser {
    pub fn new(policy: CodecPolicy, encode_threads: usize, cut_through: bool) -> Self {
        Self {
            policy,
            speedup: [None; 2],
            last_changes: None,
            last: None,
            observed: None,
            threads: encode_threads.max(1),
            cut_through,
            sets: Default::default(),
            reports: Default::default(),
        }
    }

    /// An actor's heartbeat carried a staging report. Reports of a version older than the
    /// chooser remembers are dropped as they come (a later heartbeat brings a newer one).
    /// A version without changes says nothing of speed and leaves the actor's last report.
    pub fn report_staging(&mut self, actor: &str, report: StagingReport) {
        let known = self.sets.contains_key(&report.version);
        let full = self.reports.len() >= MAX_REPORTS && !self.reports.contains_key(actor);
        if !known || full || report.changes == 0 {
            return;
        }
        self.reports.insert(actor.to_owned(), report);
    }

    /// The actor is gone: its report no longer describes anyone who stages.
    pub fn forget_actor(&mut self, actor: &str) {
        self.reports.remove(actor);
    }

    /// `version` was sent as a full checkpoint (`--full-broadcast`), not with the set decided:
    /// reports of it describe neither set.
    pub fn sent_dense(&mut self, version: u64) {
        self.sets.remove(&version);
        self.reports.retain(|_, r| r.version != version);
    }

    /// The slowest actor by its staging report of a version whose set is known, its figure
    /// carried to both sets by `decode_s` (seconds per change of each set, from the sample or
    /// the priors).
    fn slowest_reported(&self, decode_s: [f64; 2]) -> Option<ReportedStaging> {
        self.reports
            .iter()
            .filter_map(|(actor, r)| {
                let set = *self.sets.get(&r.version)?;
                let own = decode_s[set.index()];
                let reported = r.seconds_per_change()?;
                let measured = if own > 0.0 {
                    reported.clamp(own / REPORT_WITHIN, own * REPORT_WITHIN)
                } else {
                    reported
                };
                let per_change_s = std::array::from_fn(|i| {
                    if i == set.index() || own <= 0.0 {
                        measured
                    } else {
                        measured * decode_s[i] / own
                    }
                });
                Some(ReportedStaging {
                    actor: actor.clone(),
                    report: *r,
                    set,
                    per_change_s,
                    clamped: measured != reported,
                })
            })
            .max_by(|a, b| a.per_change_s[0].total_cmp(&b.per_change_s[0]))
    }

    pub fn policy(&self) -> CodecPolicy {
        self.policy
    }

    /// Predicts both sets' delivery of the next version (`elements` in the model) over
    /// `links` and picks one under the policy.
    pub fn decide(
        &mut self,
        version: u64,
        elements: u64,
        sample: Option<&Sample>,
        links: &[PeerLink],
    ) -> Decision {
        let density = sample.map(|s| s.changes as f64 / s.elements.max(1) as f64);
        let changes = self
            .last_changes
            .map(|c| c as f64)
            .or(density.map(|d| d * elements as f64))
            .unwrap_or(0.01 * elements as f64);
        let slowest = links
            .iter()
            .min_by_key(|l| l.link.rate_bps)
            .cloned()
            .or_else(|| {
                Some(PeerLink {
                    peer: "(none known)".into(),
                    region: "LAN".into(),
                    link: LinkProfile::LAN,
                })
            });
        let measured_decode = |i: usize| match sample.filter(|s| s.changes > 0) {
            Some(s) => s.costs[i].decode_s / s.changes as f64,
            None => PRIOR_DECODE_NS_PER_CHANGE[i] * 1e-9,
        };
        let staging_from = self.slowest_reported([measured_decode(0), measured_decode(1)]);
        let estimates: Vec<Estimate> = CodecSet::ALL
            .into_iter()
            .map(|set| {
                let i = set.index();
                let measured = sample.filter(|s| s.changes > 0).map(|s| s.costs[i]);
                let (per_elem_s, bytes_per_change, decode_per_change_s) = match (sample, measured) {
                    (Some(s), Some(c)) => (
                        c.encode_s / s.elements as f64,
                        c.bytes as f64 / s.changes as f64,
                        c.decode_s / s.changes as f64,
                    ),
                    _ => (
                        PRIOR_ENCODE_NS_PER_ELEM[i] * 1e-9,
                        PRIOR_BYTES_PER_CHANGE[i],
                        PRIOR_DECODE_NS_PER_CHANGE[i] * 1e-9,
                    ),
                };
                // The whole encode runs on several cores (and shares them with whatever else
                // the machine does): scale the one-core figure by what the last encodes
                // achieved, with this set or, not measured yet, the other one.
                let speedup = self.speedup[i]
                    .or(self.speedup[1 - i])
                    .unwrap_or(1.0 / self.threads as f64);
                let encode_s = per_elem_s * elements as f64 * speedup;
                let bytes = bytes_per_change * changes;
                let wire_s = slowest.as_ref().map_or(0.0, |l| {
                    bytes * 8.0 / l.link.rate_bps.max(1) as f64 + l.link.rtt.as_secs_f64()
                });
                let stage_s = staging_from
                    .as_ref()
                    .map_or(decode_per_change_s, |r| r.per_change_s[i])
                    * changes;
                let latency_s = if self.cut_through {
                    encode_s.max(wire_s).max(stage_s)
                } else {
                    encode_s + wire_s.max(stage_s)
                };
                Estimate {
                    set,
                    bytes,
                    encode_s,
                    wire_s,
                    stage_s,
                    latency_s,
                }
            })
            .collect();
        let latency = |set: CodecSet| estimates[set.index()].latency_s;
        // The small set only where it clearly wins: see `SMALL_MUST_WIN_BY`.
        let best = if latency(CodecSet::Small) <= SMALL_MUST_WIN_BY * latency(CodecSet::Fast) {
            CodecSet::Small
        } else {
            CodecSet::Fast
        };
        let set = match self.policy {
            CodecPolicy::Fast => CodecSet::Fast,
            CodecPolicy::Small => CodecSet::Small,
            CodecPolicy::Auto => best,
        };
        let why = explain(
            self.policy,
            set,
            &estimates,
            slowest.as_ref(),
            sample,
            staging_from.as_ref(),
            self.cut_through,
        );
        self.sets.insert(version, set);
        while self.sets.len() > RECENT_VERSIONS {
            self.sets.pop_first();
        }
        let sets = &self.sets;
        self.reports.retain(|_, r| sets.contains_key(&r.version));
        let d = Decision {
            version,
            set,
            why,
            estimates,
            slowest,
            staging_from,
        };
        self.last = Some(d.clone());
        d
    }

    /// What a whole encode with `set` did: `changes` in `elements`, `wall_s` seconds.
    pub fn observe(
        &mut self,
        set: CodecSet,
        elements: u64,
        sample: Option<&Sample>,
        changes: u64,
        wall_s: f64,
    ) {
        self.last_changes = Some(changes);
        self.observed = Some((set, wall_s, changes));
        let Some(s) = sample else { return };
        let one_core = s.costs[set.index()].encode_s / s.elements.max(1) as f64 * elements as f64;
        if one_core > 0.0 && wall_s > 0.0 {
            let r = wall_s / one_core;
            let e = &mut self.speedup[set.index()];
            *e = Some(e.map_or(r, |old| old * (1.0 - EMA) + r * EMA));
        }
    }

    /// The `codecs` object of `GET /v1/status`.
    pub fn status(&self) -> Value {
        let Some(d) = &self.last else {
            return json!({
                "policy": self.policy.name(),
                "chosen": null,
                "why": "no version encoded since the hub started",
            });
        };
        json!({
            "policy": self.policy.name(),
            "version": d.version,
            "chosen": d.set.name(),
            "why": d.why,
            "slowest_link": d.slowest.as_ref().map(|l| json!({
                "peer": l.peer,
                "region": l.region,
                "rate_mbit": l.link.rate_bps as f64 / 1e6,
                "rtt_ms": l.link.rtt.as_secs_f64() * 1e3,
            })),
            "estimates": d.estimates.iter().map(Estimate::json).collect::<Vec<_>>(),
            // Whose staging the estimates assumed: an actor's report, or the hub's sample.
            "staging_from": d.staging_from.as_ref().map(|r| json!({
                "actor": r.actor,
                "version": r.report.version,
                "set": r.set.name(),
                "changes": r.report.changes,
                "busy_ms": r.report.busy_ns as f64 / 1e6,
                "ns_per_change": CodecSet::ALL.iter().map(|s| (s.name(), (r.per_change_s[s.index()] * 1e10).round() / 10.0)).collect::<std::collections::BTreeMap<_, _>>(),
                "clamped": r.clamped,
            })),
            "encode_speedup": CodecSet::ALL.iter().map(|s| (s.name(), self.speedup[s.index()])).collect::<std::collections::BTreeMap<_, _>>(),
            "last_encode": self.observed.map(|(s, w, c)| json!({
                "set": s.name(), "wall_s": round3(w), "changes": c,
            })),
        })
    }
}

fn explain(
    policy: CodecPolicy,
    set: CodecSet,
    estimates: &[Estimate],
    slowest: Option<&PeerLink>,
    sample: Option<&Sample>,
    staging_from: Option<&ReportedStaging>,
    cut_through: bool,
) -> String {
    let link = slowest.map_or_else(
        || "no link known".to_owned(),
        |l| {
            format!(
                "slowest link {} ({}) {:.0} Mbit/s, {:.0} ms",
                l.region,
                l.peer,
                l.link.rate_bps as f64 / 1e6,
                l.link.rtt.as_secs_f64() * 1e3
            )
        },
    );
    let each: Vec<String> = estimates
        .iter()
        .map(|e| {
            format!(
                "{} {:.2} s = {}",
                e.set.name(),
                e.latency_s,
                if cut_through {
                    format!(
                        "max(encode {:.2}, wire {:.2}, staging {:.2})",
                        e.encode_s, e.wire_s, e.stage_s
                    )
                } else {
                    format!(
                        "encode {:.2} + max(wire {:.2}, staging {:.2})",
                        e.encode_s, e.wire_s, e.stage_s
                    )
                }
            )
        })
        .collect();
    let basis = match sample {
        Some(s) if s.changes > 0 => format!(
            "measured on {} elements of {} ({:.2}% changed)",
            s.elements,
            s.tensor,
            100.0 * s.changes as f64 / s.elements as f64
        ),
        _ => "no measured sample: prior costs".to_owned(),
    };
    let basis = match staging_from {
        Some(r) => format!(
            "{basis}; staging as the slowest actor, {}, reported it: version {} ({}) {:.1} ns per change{}",
            r.actor,
            r.report.version,
            r.set.name(),
            r.per_change_s[r.set.index()] * 1e9,
            if r.clamped {
                format!(
                    ", taken at the bound of {REPORT_WITHIN}× the sample's (it reported {:.1})",
                    r.report.seconds_per_change().unwrap_or(0.0) * 1e9
                )
            } else {
                String::new()
            }
        ),
        None => format!("{basis}; staging on one core at the hub's speed (no actor report)"),
    };
    match policy {
        CodecPolicy::Auto => {
            let small = estimates[CodecSet::Small.index()].latency_s;
            let fast = estimates[CodecSet::Fast.index()].latency_s;
            let reason = if set == CodecSet::Fast && small < fast {
                format!(
                    "fast: small predicts only {:.2}× its time, above the {SMALL_MUST_WIN_BY} it must win by",
                    small / fast
                )
            } else {
                format!("{} predicts the earliest delivery", set.name())
            };
            format!("auto: {reason} ({}; {link}; {basis})", each.join("; "))
        }
        p => format!(
            "pinned by --codecs {} (predicted: {}; {link}; {basis})",
            p.name(),
            each.join("; ")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// One part of 4 M elements, as codec-bench measures the sets on one core: small
    /// 2 ms + 40 ns per change to encode, 70 ns per change to decode, 0.8 bytes per change;
    /// fast half the encode, 25 ns per change to decode, 1.2 bytes per change.
    fn sample(changes: u64) -> Sample {
        let c = changes as f64;
        Sample {
            tensor: "t".into(),
            elements: 1 << 22,
            changes,
            costs: [
                SampleCost {
                    encode_s: 0.002 + c * 40e-9,
                    decode_s: c * 70e-9,
                    bytes: changes * 8 / 10,
                },
                SampleCost {
                    encode_s: 0.001 + c * 20e-9,
                    decode_s: c * 25e-9,
                    bytes: changes * 12 / 10,
                },
            ],
        }
    }

    fn link(mbit: u64, rtt_ms: u64) -> Vec<PeerLink> {
        vec![PeerLink {
            peer: "r1".into(),
            region: "eu".into(),
            link: LinkProfile {
                rate_bps: mbit * 1_000_000,
                rtt: Duration::from_millis(rtt_ms),
            },
        }]
    }

    #[test]
    fn slow_links_get_the_small_codecs_and_fast_links_the_fast_ones() {
        let s = sample(100_000);
        let elements = 2_000_000_000;
        let mut c = Chooser::new(CodecPolicy::Auto, 16, true);
        // 50 Mbit/s: the wire dominates; the smaller delta wins.
        let d = c.decide(1, elements, Some(&s), &link(50, 50));
        assert_eq!(d.set, CodecSet::Small, "{}", d.why);
        // 10 Gbit/s: encode and staging dominate; the cheaper codecs win.
        let d = c.decide(2, elements, Some(&s), &link(10_000, 1));
        assert_eq!(d.set, CodecSet::Fast, "{}", d.why);
        assert!(d.why.starts_with("auto: fast"), "{}", d.why);
        // The slowest region decides.
        let mut both = link(10_000, 1);
        both.extend(link(50, 50));
        assert_eq!(c.decide(3, elements, Some(&s), &both).set, CodecSet::Small);
    }

    #[test]
    fn cut_through_overlaps_staging_with_the_wire_and_store_and_forward_encodes_first() {
        let s = sample(100_000);
        let elements = 2_000_000_000;
        let l = link(100, 1);
        // One encode thread: encode, wire and staging all take seconds here.
        let ct = Chooser::new(CodecPolicy::Auto, 1, true).decide(1, elements, Some(&s), &l);
        let saf = Chooser::new(CodecPolicy::Auto, 1, false).decide(1, elements, Some(&s), &l);
        for (d, cut) in [(&ct, true), (&saf, false)] {
            for e in &d.estimates {
                let want = if cut {
                    e.encode_s.max(e.wire_s).max(e.stage_s)
                } else {
                    e.encode_s + e.wire_s.max(e.stage_s)
                };
                assert_eq!(e.latency_s, want, "{}", d.why);
            }
        }
        // Segments staged as they arrive: small's staging hides under its wire time, and its
        // fewer bytes win. Sent only once encoded: small's longer encode comes first and the
        // fast set wins. (Adding staging after the wire, as if it did not overlap, would pick
        // the fast set in both.)
        assert_eq!(ct.set, CodecSet::Small, "{}", ct.why);
        assert!(ct.why.contains("= max(encode "), "{}", ct.why);
        assert_eq!(saf.set, CodecSet::Fast, "{}", saf.why);
        assert!(saf.why.contains(" + max(wire "), "{}", saf.why);
        let serial = |e: &Estimate| e.encode_s.max(e.wire_s) + e.stage_s;
        assert!(serial(&ct.estimates[1]) < serial(&ct.estimates[0]));
    }

    #[test]
    fn the_small_set_must_win_clearly() {
        let s = sample(100_000);
        let elements = 2_000_000_000;
        let mut c = Chooser::new(CodecPolicy::Auto, 1, true);
        // Small 3.34 s (its staging), fast 458 Mbit / rate: at 130 Mbit/s fast is 3.52 s, so
        // small predicts 0.95× the time, not enough; at 110 Mbit/s (4.16 s), 0.80×, enough.
        let d = c.decide(1, elements, Some(&s), &link(130, 1));
        let ratio = d.estimates[0].latency_s / d.estimates[1].latency_s;
        assert!(
            ratio > SMALL_MUST_WIN_BY && ratio < 1.0,
            "{ratio}: {}",
            d.why
        );
        assert_eq!(d.set, CodecSet::Fast, "{}", d.why);
        assert!(
            d.why.starts_with("auto: fast: small predicts only 0.9"),
            "{}",
            d.why
        );
        let d = c.decide(2, elements, Some(&s), &link(110, 1));
        assert!(d.estimates[0].latency_s <= SMALL_MUST_WIN_BY * d.estimates[1].latency_s);
        assert_eq!(d.set, CodecSet::Small, "{}", d.why);
        assert!(
            d.why.starts_with("auto: small predicts the earliest"),
            "{}",
            d.why
        );
    }

    #[test]
    fn the_slowest_actors_staging_report_replaces_the_one_core_estimate() {
        let s = sample(100_000);
        let elements = 2_000_000_000;
        let l = link(1000, 1);
        let mut c = Chooser::new(CodecPolicy::Auto, 16, true);
        // No report yet: staging on one core at the sample's speed (small 3.3 s, fast 1.2 s)
        // outweighs small's 0.15 s less on the wire.
        let d = c.decide(1, elements, Some(&s), &l);
        assert_eq!((d.set, d.staging_from.as_ref()), (CodecSet::Fast, None));
        assert!(d.why.contains("(no actor report)"), "{}", d.why);
        let report = |version, ns_per_change: u64| StagingReport {
            version,
            changes: 1_000_000,
            busy_ns: ns_per_change * 1_000_000,
        };
        // A report of a version the chooser did not decide is not used.
        c.report_staging("a0", report(99, 1000));
        // An actor that staged version 1 (fast) at 2.5 ns per change, 10× the sample's one
        // core: small's staging scales by the sample's decode ratio (70/25) to 7 ns, 0.33 s,
        // below its wire time; small now wins.
        c.report_staging(
            "a1",
            StagingReport {
                busy_ns: 2_500_000,
                ..report(1, 0)
            },
        );
        let d = c.decide(2, elements, Some(&s), &l);
        let from = d.staging_from.clone().expect("a report");
        assert_eq!((from.actor.as_str(), from.set), ("a1", CodecSet::Fast));
        assert!((from.per_change_s[1] - 2.5e-9).abs() < 1e-15);
        assert!((from.per_change_s[0] - 7e-9).abs() < 1e-15);
        let changes = 0.1 / 4.194304 * elements as f64;
        assert!((d.estimates[0].stage_s - 7e-9 * changes).abs() < 1e-6);
        assert_eq!(d.set, CodecSet::Small, "{}", d.why);
        assert!(
            d.why
                .contains("slowest actor, a1, reported it: version 1 (fast) 2.5 ns"),
            "{}",
            d.why
        );
        // A slower actor (version 2, small, 50 ns per change: 2.4 s) sets the pace.
        c.report_staging("a2", report(2, 50));
        let d = c.decide(3, elements, Some(&s), &l);
        assert_eq!(
            d.staging_from.as_ref().map(|r| r.actor.as_str()),
            Some("a2")
        );
        assert_eq!(d.set, CodecSet::Fast, "{}", d.why);
        let st = c.status();
        assert_eq!(st["staging_from"]["actor"], "a2");
        assert_eq!(st["staging_from"]["set"], "small");
        assert_eq!(st["staging_from"]["ns_per_change"]["small"], 50.0);
        // Gone: the next decision goes by the actors still here.
        c.forget_actor("a2");
        let d = c.decide(4, elements, Some(&s), &l);
        assert_eq!(d.staging_from.map(|r| r.actor), Some("a1".to_owned()));
        // Reports of versions older than the chooser remembers are dropped.
        for v in 5..5 + RECENT_VERSIONS as u64 {
            c.decide(v, elements, Some(&s), &l);
        }
        assert!(c.decide(100, elements, Some(&s), &l).staging_from.is_none());
    }

    #[test]
    fn an_outlandish_report_is_bounded_and_an_empty_one_keeps_the_last() {
        let s = sample(100_000);
        let (elements, l) = (2_000_000_000, link(1000, 1));
        let mut c = Chooser::new(CodecPolicy::Auto, 16, true);
        c.decide(1, elements, Some(&s), &l);
        let good = StagingReport {
            version: 1,
            changes: 1_000_000,
            busy_ns: 30_000_000,
        };
        c.report_staging("a1", good);
        // No changes: nothing said of speed; the last report stands.
        c.report_staging("a1", StagingReport { changes: 0, ..good });
        let d = c.decide(2, elements, Some(&s), &l);
        assert_eq!(d.staging_from.map(|r| r.report), Some(good));
        // A broken actor's 1.8e10 s per change is taken at 100× the sample's 25 ns.
        let wild = StagingReport {
            version: 2,
            changes: 1,
            busy_ns: u64::MAX,
        };
        c.report_staging("broken", wild);
        let d = c.decide(3, elements, Some(&s), &l);
        let from = d.staging_from.clone().expect("a report");
        assert_eq!((from.actor.as_str(), from.clamped), ("broken", true));
        assert!((from.per_change_s[1] - 2.5e-6).abs() < 1e-12, "{from:?}");
        assert!(
            d.why.contains("taken at the bound of 100× the sample's"),
            "{}",
            d.why
        );
        assert!(d.estimates.iter().all(|e| e.latency_s.is_finite()));
        // A version sent as a full checkpoint: its reports describe no set.
        c.report_staging("broken", StagingReport { version: 3, ..good });
        c.sent_dense(3);
        c.forget_actor("broken");
        c.report_staging("a2", StagingReport { version: 3, ..good });
        let d = c.decide(4, elements, Some(&s), &l);
        assert_eq!(d.staging_from.map(|r| r.actor), Some("a1".to_owned()));
    }

    #[test]
    fn a_pinned_policy_is_kept_and_says_so() {
        let s = sample(100_000);
        let mut c = Chooser::new(CodecPolicy::Small, 16, true);
        let d = c.decide(1, 2_000_000_000, Some(&s), &link(10_000, 1));
        assert_eq!(d.set, CodecSet::Small);
        assert!(d.why.starts_with("pinned by --codecs small"), "{}", d.why);
        let st = c.status();
        assert_eq!(st["chosen"], "small");
        assert_eq!(st["policy"], "small");
        assert_eq!(st["estimates"].as_array().map(Vec::len), Some(2));
    }

    #[test]
    fn observed_encodes_scale_the_prediction() {
        let s = sample(100_000);
        let elements = 1u64 << 30;
        let mut c = Chooser::new(CodecPolicy::Auto, 1, true);
        let before = c.decide(1, elements, Some(&s), &link(1000, 1)).estimates[0].encode_s;
        // The whole encode took a quarter of the one-core prediction (4 cores).
        let one_core = s.costs[0].encode_s / f64::from(1u32 << 22) * elements as f64;
        c.observe(CodecSet::Small, elements, Some(&s), 100_000, one_core / 4.0);
        let after = c.decide(2, elements, Some(&s), &link(1000, 1)).estimates[0].encode_s;
        assert!(
            (after - before / 4.0).abs() < 1e-9 * before,
            "{before} → {after}"
        );
    }

    #[test]
    fn without_a_sample_or_links_it_still_decides() {
        let mut c = Chooser::new(CodecPolicy::Auto, 2, true);
        let d = c.decide(1, 1_000_000, None, &[]);
        assert!(d.why.contains("prior costs"), "{}", d.why);
        assert!(d.estimates.iter().all(|e| e.latency_s.is_finite()));
        // A sample without changes falls back to the priors for what it cannot measure.
        let d = c.decide(2, 1_000_000, Some(&sample(0)), &[]);
        assert!(d.estimates.iter().all(|e| e.latency_s.is_finite()));
    }
}

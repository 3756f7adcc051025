//! The plain data of rollout jobs and their results, as the job protocol carries them
//! (`docs/api.md`, "The actors' job protocol"; framed by [`crate::protocol::msg`]).
//!
//! The hub leases a group to an actor as a [`JobSpec`] (prompt token ids, `n`, sampling);
//! the actor answers with a [`JobResult`] holding all `n` [`Sample`]s, each with its tokens,
//! their log-probabilities and the [`VersionSpan`]s saying which weights produced which
//! tokens; the hub answers each result with a [`Verdict`]. Each type writes itself with
//! `write` and reads itself with `read`; `crate::protocol::msg` frames them.
//!
//! Why exact bits: the trainer uses the actor's log-probabilities as the behaviour policy's,
//! so they travel as the little-endian bits of each `f32` (`to_bits`) and arrive bit for bit,
//! NaN payloads, `-0.0` and subnormals included. For the same reason the types holding
//! floats compare them **by bits** (so `Message` keeps `Eq`): `NaN == NaN` when the bits
//! are equal, and `0.0 != -0.0`.
//!
//! Invariants kept at decode (malformed input is a [`DecodeError`], never a panic), and
//! checked by the `validate` methods for values built in memory:
//! - every count is bounded by its `MAX_*` constant before anything is allocated, and no
//!   allocation reserves more elements than bytes remain to describe them;
//! - a sample has exactly one log-probability per token;
//! - a sample's spans are non-empty, in order, and tile its tokens exactly: the first starts
//!   at 0, each starts where the previous ended, the last ends at `tokens.len()` (so a sample
//!   without tokens has no spans);
//! - a job asks for `1 ..= MAX_SAMPLES` samples of at most `MAX_NEW_TOKENS` tokens each.
//!
//! What is *not* checked here, because it needs the job's context: that a result has `n`
//! samples, that span versions are not older than the result's, that sampling parameters
//! are in range. The hub judges those per result and answers with a [`Verdict`].
//!
//! Encoding: integers and token ids are LEB128 varints (`u32` fields refuse values above
//! `u32::MAX`), `f32`s are 4 little-endian bytes of their bits, lists are a varint count
//! followed by their elements, strings are length-prefixed UTF-8.

use crate::delta::segment::MAX_NAME_LEN;
use crate::error::DecodeError;
use crate::wire::{Reader, put_bytes, put_varint, varint_len};

/// The most prompt tokens one job may carry.
pub const MAX_PROMPT_TOKENS: usize = 1 << 16;
/// The most tokens one sample may have (and the largest `max_new_tokens`).
pub const MAX_NEW_TOKENS: usize = 1 << 16;
/// The most samples per group (`n`), and so per result.
pub const MAX_SAMPLES: usize = 1024;
/// The most stop token ids in one job's sampling parameters.
pub const MAX_STOP_TOKENS: usize = 64;
/// The most version spans in one sample (one per version switch during generation).
pub const MAX_SPANS: usize = 64;
/// The most jobs, results or verdicts in one message, and the largest `Claim`.
pub const MAX_JOBS_PER_MESSAGE: usize = 4096;
/// The longest refusal code in a [`Verdict`].
pub const MAX_CODE_LEN: usize = 64;
/// The longest refusal detail in a [`Verdict`] (as a `Refuse`'s detail).
pub const MAX_DETAIL_LEN: usize = 4 * MAX_NAME_LEN;

/// How to sample a group's completions.
///
/// Compares its floats by bits (see the module documentation).
#[derive(Debug, Clone)]
pub struct SamplingParams {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: u32,
    pub max_new_tokens: u32,
    pub stop_token_ids: Vec<u32>,
    pub seed: u64,
}

/// One leased group: hub → actor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobSpec {
    pub job: u64,
    pub version: u64,
    pub attempt: u32,
    pub lease_expires_ms: u64,
    pub group: u32,
    pub prompt: Vec<u32>,
    pub n: u32,
    pub sampling: SamplingParams,
}

/// Half-open token span [start, end) generated with `version`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VersionSpan {
    pub version: u64,
    pub start: u32,
    pub end: u32,
}

/// Why a sample ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FinishReason {
    /// A stop token was generated.
    Stop = 1,
    /// `max_new_tokens` were generated.
    Length = 2,
    /// Generation was cut short (shutdown, lease lost).
    Aborted = 3,
}

/// One completion of a group.
///
/// Compares its log-probabilities by bits (see the module documentation).
#[derive(Debug, Clone)]
pub struct Sample {
    pub tokens: Vec<u32>,
    /// One per token, exactly as the engine computed them.
    pub logprobs: Vec<f32>,
    pub finish: FinishReason,
    /// Which version produced which tokens: they tile `0..tokens.len()`.
    pub spans: Vec<VersionSpan>,
    pub ttft_us: u64,
    pub decode_us: u64,
}

/// An actor's result for one job: all n samples of the group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobResult {
    pub job: u64,
    pub attempt: u32,
    pub version: u64,
    pub digest: [u8; 16],
    pub elapsed_us: u64,
    pub samples: Vec<Sample>,
}

/// The hub's judgement of one submitted result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Accepted,
    /// `code` is machine-readable (at most [`MAX_CODE_LEN`] bytes), `detail` a sentence (at
    /// most [`MAX_DETAIL_LEN`] bytes); longer ones do not decode.
    Refused {
        code: String,
        detail: String,
    },
}

impl PartialEq for SamplingParams {
    fn eq(&self, other: &Self) -> bool {
        self.temperature.to_bits() == other.temperature.to_bits()
            && self.top_p.to_bits() == other.top_p.to_bits()
            && self.top_k == other.top_k
            && self.max_new_tokens == other.max_new_tokens
            && self.stop_token_ids == other.stop_token_ids
            && self.seed == other.seed
    }
}

/// Bitwise equality of the floats is reflexive.
impl Eq for SamplingParams {}

impl PartialEq for Sample {
    fn eq(&self, other: &Self) -> bool {
        self.tokens == other.tokens
            && self.logprobs.len() == other.logprobs.len()
            && self
                .logprobs
                .iter()
                .zip(&other.logprobs)
                .all(|(a, b)| a.to_bits() == b.to_bits())
            && self.finish == other.finish
            && self.spans == other.spans
            && self.ttft_us == other.ttft_us
            && self.decode_us == other.decode_us
    }
}

/// Bitwise equality of the floats is reflexive.
impl Eq for Sample {}

impl SamplingParams {
    /// Checks the bounds decoding enforces.
    pub fn validate(&self) -> Result<(), DecodeError> {
        bounded(
            "stop token count",
            self.stop_token_ids.len(),
            MAX_STOP_TOKENS,
        )?;
        bounded(
            "max new tokens",
            self.max_new_tokens as usize,
            MAX_NEW_TOKENS,
        )
    }

    pub fn write(&self, out: &mut Vec<u8>) {
        put_f32(out, self.temperature);
        put_f32(out, self.top_p);
        put_varint(out, u64::from(self.top_k));
        put_varint(out, u64::from(self.max_new_tokens));
        put_u32s(out, &self.stop_token_ids);
        put_varint(out, self.seed);
    }

    pub fn read(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        let p = Self {
            temperature: read_f32(r, "temperature")?,
            top_p: read_f32(r, "top p")?,
            top_k: read_u32(r, "top k")?,
            max_new_tokens: r.varint_at_most("max new tokens", MAX_NEW_TOKENS as u64)? as u32,
            stop_token_ids: read_u32s(r, ("stop token count", "stop token"), MAX_STOP_TOKENS)?,
            seed: r.varint("seed")?,
        };
        p.validate()?;
        Ok(p)
    }
}

impl JobSpec {
    /// Checks the bounds and invariants decoding enforces.
    pub fn validate(&self) -> Result<(), DecodeError> {
        bounded("prompt token count", self.prompt.len(), MAX_PROMPT_TOKENS)?;
        if self.n == 0 {
            return Err(DecodeError::malformed("job", "n = 0"));
        }
        bounded("samples per group", self.n as usize, MAX_SAMPLES)?;
        self.sampling.validate()
    }

    pub fn write(&self, out: &mut Vec<u8>) {
        put_varint(out, self.job);
        put_varint(out, self.version);
        put_varint(out, u64::from(self.attempt));
        put_varint(out, self.lease_expires_ms);
        put_varint(out, u64::from(self.group));
        put_u32s(out, &self.prompt);
        put_varint(out, u64::from(self.n));
        self.sampling.write(out);
    }

    pub fn read(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        let j = Self {
            job: r.varint("job id")?,
            version: r.varint("job version")?,
            attempt: read_u32(r, "attempt")?,
            lease_expires_ms: r.varint("lease expiry")?,
            group: read_u32(r, "group index")?,
            prompt: read_u32s(r, ("prompt token count", "prompt token"), MAX_PROMPT_TOKENS)?,
            n: r.varint_at_most("samples per group", MAX_SAMPLES as u64)? as u32,
            sampling: SamplingParams::read(r)?,
        };
        j.validate()?;
        Ok(j)
    }
}

impl FinishReason {
    /// The name the trainer API uses.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Aborted => "aborted",
        }
    }

    fn from_u8(id: u8) -> Result<Self, DecodeError> {
        match id {
            1 => Ok(Self::Stop),
            2 => Ok(Self::Length),
            3 => Ok(Self::Aborted),
            id => Err(DecodeError::UnknownCodec {
                what: "finish reason",
                id,
            }),
        }
    }
}

impl VersionSpan {
    fn write(&self, out: &mut Vec<u8>) {
        put_varint(out, self.version);
        put_varint(out, u64::from(self.start));
        put_varint(out, u64::from(self.end));
    }

    fn read(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        Ok(Self {
            version: r.varint("span version")?,
            start: read_u32(r, "span start")?,
            end: read_u32(r, "span end")?,
        })
    }
}

impl Sample {
    /// Checks the bounds and invariants decoding enforces: one log-probability per token,
    /// spans that tile the tokens exactly.
    pub fn validate(&self) -> Result<(), DecodeError> {
        let len = self.tokens.len();
        bounded("sample token count", len, MAX_NEW_TOKENS)?;
        if self.logprobs.len() != len {
            return Err(DecodeError::malformed(
                "sample",
                format!("{} log-probabilities for {len} tokens", self.logprobs.len()),
            ));
        }
        bounded("span count", self.spans.len(), MAX_SPANS)?;
        validate_spans(&self.spans, len)
    }

    pub fn write(&self, out: &mut Vec<u8>) {
        put_u32s(out, &self.tokens);
        put_varint(out, self.logprobs.len() as u64);
        for &p in &self.logprobs {
            put_f32(out, p);
        }
        out.push(self.finish as u8);
        put_varint(out, self.spans.len() as u64);
        for s in &self.spans {
            s.write(out);
        }
        put_varint(out, self.ttft_us);
        put_varint(out, self.decode_us);
    }

    pub fn read(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        let tokens = read_u32s(r, ("sample token count", "sample token"), MAX_NEW_TOKENS)?;
        let n = r.varint_at_most("log-probability count", MAX_NEW_TOKENS as u64)? as usize;
        let mut logprobs = Vec::with_capacity(n.min(r.remaining() / 4));
        for _ in 0..n {
            logprobs.push(read_f32(r, "log-probability")?);
        }
        let finish = FinishReason::from_u8(r.u8("finish reason")?)?;
        let n = r.varint_at_most("span count", MAX_SPANS as u64)? as usize;
        let mut spans = Vec::with_capacity(n.min(r.remaining() / 3));
        for _ in 0..n {
            spans.push(VersionSpan::read(r)?);
        }
        let s = Self {
            tokens,
            logprobs,
            finish,
            spans,
            ttft_us: r.varint("time to first token")?,
            decode_us: r.varint("decode time")?,
        };
        s.validate()?;
        Ok(s)
    }
}

impl JobResult {
    /// Checks the bounds and invariants decoding enforces, sample by sample.
    pub fn validate(&self) -> Result<(), DecodeError> {
        bounded("sample count", self.samples.len(), MAX_SAMPLES)?;
        self.samples.iter().try_for_each(Sample::validate)
    }

    pub fn write(&self, out: &mut Vec<u8>) {
        put_varint(out, self.job);
        put_varint(out, u64::from(self.attempt));
        put_varint(out, self.version);
        out.extend_from_slice(&self.digest);
        put_varint(out, self.elapsed_us);
        put_varint(out, self.samples.len() as u64);
        for s in &self.samples {
            s.write(out);
        }
    }

    pub fn read(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        let job = r.varint("job id")?;
        let attempt = read_u32(r, "attempt")?;
        let version = r.varint("result version")?;
        let digest = r.array("result digest")?;
        let elapsed_us = r.varint("elapsed time")?;
        let n = r.varint_at_most("sample count", MAX_SAMPLES as u64)? as usize;
        // A sample takes at least 6 bytes (two counts, finish, span count, two times).
        let mut samples = Vec::with_capacity(n.min(r.remaining() / 6));
        for _ in 0..n {
            samples.push(Sample::read(r)?);
        }
        Ok(Self {
            job,
            attempt,
            version,
            digest,
            elapsed_us,
            samples,
        })
    }
}

impl Verdict {
    pub fn write(&self, out: &mut Vec<u8>) {
        match self {
            Self::Accepted => out.push(1),
            Self::Refused { code, detail } => {
                out.push(2);
                put_bytes(out, code.as_bytes());
                put_bytes(out, detail.as_bytes());
            }
        }
    }

    pub fn read(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        match r.u8("verdict")? {
            1 => Ok(Self::Accepted),
            2 => Ok(Self::Refused {
                code: r.str("refusal code", MAX_CODE_LEN)?.to_owned(),
                detail: r.str("refusal detail", MAX_DETAIL_LEN)?.to_owned(),
            }),
            id => Err(DecodeError::UnknownCodec {
                what: "verdict",
                id,
            }),
        }
    }
}

/// Spans must be non-empty and tile `0..len` in order.
fn validate_spans(spans: &[VersionSpan], len: usize) -> Result<(), DecodeError> {
    let mut at = 0usize;
    for (i, s) in spans.iter().enumerate() {
        let (start, end) = (s.start as usize, s.end as usize);
        if start != at {
            let what = if start < at {
                "overlaps"
            } else {
                "leaves a gap"
            };
            return Err(DecodeError::malformed(
                "version spans",
                format!("span {i} [{start}, {end}) {what} after token {at}"),
            ));
        }
        if end <= start {
            return Err(DecodeError::malformed(
                "version spans",
                format!("span {i} [{start}, {end}) is empty"),
            ));
        }
        if end > len {
            return Err(DecodeError::malformed(
                "version spans",
                format!("span {i} [{start}, {end}) runs past the {len} tokens"),
            ));
        }
        at = end;
    }
    if at != len {
        return Err(DecodeError::malformed(
            "version spans",
            format!("spans cover {at} of {len} tokens"),
        ));
    }
    Ok(())
}

fn bounded(what: &'static str, value: usize, limit: usize) -> Result<(), DecodeError> {
    if value > limit {
        return Err(DecodeError::TooLarge {
            what,
            value: value as u64,
            limit: limit as u64,
        });
    }
    Ok(())
}

fn put_f32(out: &mut Vec<u8>, v: f32) {
    out.extend_from_slice(&v.to_bits().to_le_bytes());
}

fn read_f32(r: &mut Reader<'_>, what: &'static str) -> Result<f32, DecodeError> {
    Ok(f32::from_bits(r.u32_le(what)?))
}

fn read_u32(r: &mut Reader<'_>, what: &'static str) -> Result<u32, DecodeError> {
    Ok(r.varint_at_most(what, u64::from(u32::MAX))? as u32)
}

fn put_u32s(out: &mut Vec<u8>, v: &[u32]) {
    put_varint(out, v.len() as u64);
    for &x in v {
        put_varint(out, u64::from(x));
    }
}

/// A count of at most `limit`, then that many `u32` varints (each at least one byte).
fn read_u32s(
    r: &mut Reader<'_>,
    (count, item): (&'static str, &'static str),
    limit: usize,
) -> Result<Vec<u32>, DecodeError> {
    let n = r.varint_at_most(count, limit as u64)? as usize;
    let mut v = Vec::with_capacity(n.min(r.remaining()));
    for _ in 0..n {
        v.push(read_u32(r, item)?);
    }
    Ok(v)
}

/// The most bytes one encoded [`Sample`] of at most `max_new_tokens` tokens can take: every
/// token id and count at its longest varint, four bytes per log-probability, every span used
/// with its longest fields, both times at their longest.
pub fn max_sample_len(max_new_tokens: u32) -> u64 {
    let t = u64::from(max_new_tokens);
    let count = varint_len(t) as u64;
    let span = 10 + 5 + 5;
    count + 5 * t + count + 4 * t + 1 + 1 + MAX_SPANS as u64 * span + 10 + 10
}

/// The most bytes one encoded [`JobResult`] of `n` samples of at most `max_new_tokens`
/// tokens each can take (what a group asking for that must be able to send).
pub fn max_result_len(n: u32, max_new_tokens: u32) -> u64 {
    // job, attempt, version, digest, elapsed, sample count.
    let head = 10 + 5 + 10 + 16 + 10 + varint_len(u64::from(n)) as u64;
    head + u64::from(n) * max_sample_len(max_new_tokens)
}

impl JobResult {
    /// The length of [`JobResult::write`]'s output, computed without encoding.
    pub fn encoded_len(&self) -> usize {
        let v = |x: u64| varint_len(x);
        let mut len = v(self.job)
            + v(u64::from(self.attempt))
            + v(self.version)
            + 16
            + v(self.elapsed_us)
            + v(self.samples.len() as u64);
        for s in &self.samples {
            len += v(s.tokens.len() as u64)
                + s.tokens.iter().map(|&t| v(u64::from(t))).sum::<usize>()
                + v(s.logprobs.len() as u64)
                + 4 * s.logprobs.len()
                + 1
                + v(s.spans.len() as u64)
                + s.spans
                    .iter()
                    .map(|sp| v(sp.version) + v(u64::from(sp.start)) + v(u64::from(sp.end)))
                    .sum::<usize>()
                + v(s.ttft_us)
                + v(s.decode_us);
        }
        len
    }
}

/// Splits results into runs that each fit one `Submit` whose body is at most `max_body`
/// bytes (a count, then the results), in order and at most [`MAX_JOBS_PER_MESSAGE`] each, so
/// that no result sinks the others: a result too large for any message goes alone (the
/// receiver refuses that one by name).
pub fn split_for_messages(results: Vec<JobResult>, max_body: usize) -> Vec<Vec<JobResult>> {
    let mut out: Vec<Vec<JobResult>> = Vec::new();
    let mut current: Vec<JobResult> = Vec::new();
    let mut used = 0usize;
    for r in results {
        let len = r.encoded_len();
        let body = |count: usize, bytes: usize| varint_len(count as u64) + bytes;
        let fits = current.len() < MAX_JOBS_PER_MESSAGE
            && body(current.len() + 1, used.saturating_add(len)) <= max_body;
        if !fits && !current.is_empty() {
            out.push(std::mem::take(&mut current));
            used = 0;
        }
        used = used.saturating_add(len);
        current.push(r);
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(logprobs: Vec<f32>) -> Sample {
        let len = logprobs.len() as u32;
        Sample {
            tokens: vec![9; logprobs.len()],
            logprobs,
            finish: FinishReason::Length,
            spans: if len > 0 {
                vec![VersionSpan {
                    version: 1,
                    start: 0,
                    end: len,
                }]
            } else {
                vec![]
            },
            ttft_us: 1,
            decode_us: 2,
        }
    }

    fn result_of(job: u64, n: usize, tokens: usize) -> JobResult {
        let mut s = sample(vec![-0.5; tokens]);
        s.tokens = vec![u32::MAX; tokens];
        JobResult {
            job,
            attempt: 1,
            version: 3,
            digest: [7; 16],
            elapsed_us: 1_000,
            samples: vec![s; n],
        }
    }

    #[test]
    fn encoded_len_is_exact_and_bounded_by_the_group_maximum() {
        for (n, t) in [(1, 0), (1, 5), (3, 200), (2, 70_000)] {
            let r = result_of(u64::MAX, n, t);
            let mut out = Vec::new();
            r.write(&mut out);
            assert_eq!(out.len(), r.encoded_len(), "n {n}, tokens {t}");
            assert!(out.len() as u64 <= max_result_len(n as u32, t as u32));
        }
        // The worst case a group may ask for: 16 samples of 65,536 tokens fit a message, 32
        // do not.
        let body = crate::protocol::msg::MAX_MESSAGE_BODY as u64;
        assert!(max_result_len(16, MAX_NEW_TOKENS as u32) + 3 <= body);
        assert!(max_result_len(32, MAX_NEW_TOKENS as u32) > body);
    }

    #[test]
    fn results_are_split_into_messages_that_fit_in_order() {
        let small = |job| result_of(job, 2, 100);
        let len = small(0).encoded_len();
        let rs: Vec<JobResult> = (0..10).map(small).collect();
        // Room for three results (and the count) per message.
        let parts = split_for_messages(rs.clone(), 3 * len + 1);
        assert_eq!(parts.iter().map(Vec::len).collect::<Vec<_>>(), [3, 3, 3, 1]);
        let back: Vec<u64> = parts.iter().flatten().map(|r| r.job).collect();
        assert_eq!(back, (0..10).collect::<Vec<_>>(), "every result, in order");
        for p in &parts {
            let body =
                varint_len(p.len() as u64) + p.iter().map(JobResult::encoded_len).sum::<usize>();
            assert!(body <= 3 * len + 1);
        }
        // One result too large for any message goes alone; the others are unaffected.
        let mut rs = vec![small(0), result_of(1, 4, 1_000), small(2)];
        rs.extend((3..5).map(small));
        let parts = split_for_messages(rs, 2 * len + 1);
        let jobs: Vec<Vec<u64>> = parts
            .iter()
            .map(|p| p.iter().map(|r| r.job).collect())
            .collect();
        assert_eq!(jobs, [vec![0], vec![1], vec![2, 3], vec![4]]);
        assert!(split_for_messages(Vec::new(), 100).is_empty());
    }

    #[test]
    fn finish_reasons_have_their_api_names() {
        assert_eq!(FinishReason::Stop.as_str(), "stop");
        assert_eq!(FinishReason::Length.as_str(), "length");
        assert_eq!(FinishReason::Aborted.as_str(), "aborted");
        for f in [
            FinishReason::Stop,
            FinishReason::Length,
            FinishReason::Aborted,
        ] {
            assert_eq!(FinishReason::from_u8(f as u8), Ok(f));
        }
        assert!(FinishReason::from_u8(0).is_err());
    }

    #[test]
    fn floats_compare_by_bits() {
        let nan = f32::from_bits(0x7fc0_0001);
        assert_eq!(sample(vec![nan]), sample(vec![nan]));
        assert_ne!(sample(vec![nan]), sample(vec![f32::from_bits(0x7fc0_0002)]));
        assert_ne!(sample(vec![0.0]), sample(vec![-0.0]));
        assert_ne!(sample(vec![0.0]), sample(vec![0.0, 0.0]));
        let p = SamplingParams {
            temperature: f32::NAN,
            top_p: 1.0,
            top_k: 0,
            max_new_tokens: 1,
            stop_token_ids: vec![],
            seed: 0,
        };
        assert_eq!(p, p.clone());
        assert_ne!(
            p,
            SamplingParams {
                top_p: -1.0,
                ..p.clone()
            }
        );
    }

    #[test]
    fn samples_read_back_bit_for_bit() {
        let s = sample(vec![
            f32::from_bits(0xffbf_ffff),
            -0.0,
            f32::from_bits(1),
            f32::INFINITY,
        ]);
        let mut out = Vec::new();
        s.write(&mut out);
        let mut r = Reader::new(&out);
        let back = Sample::read(&mut r).expect("a valid sample reads");
        assert!(r.is_empty());
        let bits = |s: &Sample| s.logprobs.iter().map(|p| p.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&back), bits(&s));
        // A sample without tokens has no spans, and is valid.
        assert_eq!(sample(vec![]).validate(), Ok(()));
    }
}

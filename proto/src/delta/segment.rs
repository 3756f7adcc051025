//! Parts and segments.
//!
//! A **part** is the coded delta of one contiguous element range `[start, start + len)` of
//! one tensor, either sparse (positions + values) or dense. A **segment** is a sequence of
//! parts (one range of a large tensor, or several small tensors) with the id of the delta
//! it belongs to and its sequence number: the unit of streaming, verification,
//! retransmission and parallel apply. A segment is decodable on its own, in any order,
//! given only the base values of the ranges it covers.

use crate::delta::codec::index::Position;
use crate::delta::codec::{self, DenseCodec, IndexCodec, ValueCodec};
use crate::delta::diff::RangeDiff;
use crate::error::DecodeError;
use crate::wire::{Reader, put_bytes, put_varint};

/// The largest element range one part may cover. It bounds every allocation a decoder
/// makes for one part (2 bytes per element for dense, 8 per position for sparse).
pub const MAX_PART_ELEMS: u64 = 1 << 26;
/// The longest tensor name accepted.
pub const MAX_NAME_LEN: usize = 1024;
/// The most parts one segment may hold.
pub const MAX_PARTS_PER_SEGMENT: u64 = 1 << 16;

/// How one part is coded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PartPayload {
    Sparse {
        index: IndexCodec,
        value: ValueCodec,
        index_bytes: Vec<u8>,
        value_bytes: Vec<u8>,
    },
    Dense {
        codec: DenseCodec,
        bytes: Vec<u8>,
    },
}

/// One coded part.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncodedPart {
    pub tensor: String,
    pub start: u64,
    pub len: u64,
    pub changes: u64,
    pub payload: PartPayload,
}

/// Which candidates the encoder may try for a part.
#[derive(Debug, Clone)]
pub struct CodecChoice {
    pub index: Vec<IndexCodec>,
    pub value: Vec<ValueCodec>,
    pub dense: Vec<DenseCodec>,
    /// Try every allowed candidate on every part, instead of skipping the ones that cheap
    /// statistics show cannot win (see [`CodecChoice::default`]).
    pub exhaustive: bool,
    pub zstd_level: i32,
}

impl Default for CodecChoice {
    /// All codecs allowed. The base-conditioned ones are always tried and win on nearly
    /// every part of a real step: the table-driven `exp-class-gaps+rans` / `ulp-step+rans`
    /// from 256 changes in a part, the adaptive `exp-class-gaps+rc` / `ulp-step+rc` below
    /// 4096 (see [`EncodedPart::encode`]). Restrict `index` and `value` to
    /// [`IndexCodec::V1`] / [`ValueCodec::V1`] for readers from before them or for a ~2×
    /// faster encode at ~1.5× the size. Candidates that cannot win are skipped by
    /// cheap statistics:
    /// the bitmap only from density 1/8 (below it Rice gaps are within a few percent of the
    /// mask entropy and a bitmap pass costs more than the whole sparse encode), raw+zstd
    /// values only when the ULP residual took a byte or more per change (raw values carry
    /// ~11 bits of mantissa and exponent, so they cannot win below that), dense only from
    /// density 1/8. The exact-size candidates
    /// (LEB128 gaps, raw values) are sized without encoding.
    fn default() -> Self {
        Self {
            index: IndexCodec::ALL.to_vec(),
            value: ValueCodec::ALL.to_vec(),
            dense: DenseCodec::ALL.to_vec(),
            exhaustive: false,
            zstd_level: 1,
        }
    }
}

impl CodecChoice {
    /// The codecs of the first release (Rice/LEB128/bitmap positions, ULP residual + zstd
    /// or raw values, the dense forms): ~1.5× the bytes of [`CodecChoice::default`] at RL
    /// densities, for a fraction of its CPU per change (no range coder, no per-element class
    /// count). What a sender picks when the link is fast and the CPU is the bottleneck, or
    /// to reach readers from before the exponent-class codecs.
    pub fn fast() -> Self {
        Self {
            index: IndexCodec::V1.to_vec(),
            value: ValueCodec::V1.to_vec(),
            ..Self::default()
        }
    }

    /// Exactly one sparse form, no dense fallback (for tests and baselines).
    pub fn only(index: IndexCodec, value: ValueCodec) -> Self {
        Self {
            index: vec![index],
            value: vec![value],
            dense: vec![],
            exhaustive: true,
            zstd_level: 1,
        }
    }

    /// Exactly one dense form.
    pub fn only_dense(codec: DenseCodec) -> Self {
        Self {
            index: vec![],
            value: vec![],
            dense: vec![codec],
            exhaustive: true,
            zstd_level: 1,
        }
    }
}

impl EncodedPart {
    /// Codes the diff of `old` → `new` over one range, choosing the smallest candidate.
    pub fn encode(
        tensor: &str,
        start: u64,
        old: &[u16],
        new: &[u16],
        diff: &RangeDiff,
        choice: &CodecChoice,
    ) -> Self {
        let len = old.len() as u64;
        let n = diff.len() as u64;
        let level = choice.zstd_level;
        let all = choice.exhaustive;
        let allowed_i = |c| choice.index.contains(&c);
        let allowed_v = |c| choice.value.contains(&c);

        let mut best_index = Best::default();
        // The base-conditioned mask scans the whole range once; it is the usual winner. Its
        // table-driven form is tried first, from RANS_MIN_CHANGES changes; the adaptive one
        // where the table-driven one is not tried and on small parts (where the tables'
        // parameter bytes and set-up can outweigh what they save), or exhaustively.
        let rans_i = allowed_i(IndexCodec::ExpClassGapsRans) && (all || n >= RANS_MIN_CHANGES);
        for (class_codec, wanted) in [
            (IndexCodec::ExpClassGapsRans, rans_i),
            (
                IndexCodec::ExpClassGapsRc,
                allowed_i(IndexCodec::ExpClassGapsRc) && (all || !rans_i || n < SMALL_PART_CHANGES),
            ),
        ] {
            if !wanted || len > u64::from(u32::MAX) {
                continue;
            }
            best_index.offer(class_codec, || match &diff.class_totals {
                // A ranked diff already counted the classes: no second pass over the base.
                Some(totals) if diff.ranks.len() == diff.len() => {
                    if class_codec == IndexCodec::ExpClassGapsRc {
                        codec::index::encode_exp_class_gaps_ranked(&diff.old, &diff.ranks, totals)
                    } else {
                        codec::index::encode_exp_class_gaps_rans_ranked(
                            &diff.old,
                            &diff.ranks,
                            totals,
                        )
                    }
                }
                _ => codec::index::encode(class_codec, &diff.positions, len, level, old),
            });
        }
        // Rice gaps code close to the order-0 entropy of the mask; the exponent-class codec
        // is usually ~0.7× that. Try Rice only where the classes told little (or the part
        // is too small for the contexts to learn).
        if allowed_i(IndexCodec::RiceGaps)
            && (all
                || n < SMALL_PART_CHANGES
                || best_index.is_empty()
                || best_index.beaten_by(mask_order0_bytes(n, len) * 9 / 10))
        {
            best_index.offer(IndexCodec::RiceGaps, || {
                codec::index::encode(IndexCodec::RiceGaps, &diff.positions, len, level, old)
            });
        }
        // LEB128 spends at least a byte per gap: size it only when the best so far does not.
        if allowed_i(IndexCodec::Leb128Gaps)
            && (all || best_index.beaten_by(diff.len()))
            && best_index.beaten_by(codec::index::leb128_gaps_len(&diff.positions))
        {
            best_index.offer(IndexCodec::Leb128Gaps, || {
                codec::index::encode(IndexCodec::Leb128Gaps, &diff.positions, len, level, old)
            });
        }
        if allowed_i(IndexCodec::Leb128GapsZstd) && (all || best_index.is_empty()) {
            best_index.offer(IndexCodec::Leb128GapsZstd, || {
                codec::index::encode(IndexCodec::Leb128GapsZstd, &diff.positions, len, level, old)
            });
        }
        if allowed_i(IndexCodec::BitmapZstd) && (all || best_index.is_empty() || n * 8 >= len) {
            best_index.offer(IndexCodec::BitmapZstd, || {
                codec::index::encode(IndexCodec::BitmapZstd, &diff.positions, len, level, old)
            });
        }

        let mut best_value = Best::default();
        let rans_v = allowed_v(ValueCodec::UlpStepRans) && (all || n >= RANS_MIN_CHANGES);
        // A lower bound of the zstd candidate's size, when the table-driven coder counted it.
        let mut zstd_at_least = None;
        if rans_v {
            let (bytes, order0) = codec::value::encode_ulp_step_rans(&diff.new, &diff.old);
            zstd_at_least = Some(order0);
            best_value.offer(ValueCodec::UlpStepRans, || bytes);
        }
        if allowed_v(ValueCodec::UlpStepRc) && (all || !rans_v || n < SMALL_PART_CHANGES) {
            best_value.offer(ValueCodec::UlpStepRc, || {
                codec::value::encode(ValueCodec::UlpStepRc, &diff.new, &diff.old, level)
            });
        }
        // zstd's literals cost at least their order-0 entropy: the byte tokens of the ULP
        // residual cannot beat a range-coded step already below it (matches aside, which
        // steps of independent weights do not have).
        if allowed_v(ValueCodec::UlpResidualZstd)
            && (all
                || n < SMALL_PART_CHANGES
                || best_value.is_empty()
                || best_value.beaten_by(
                    zstd_at_least
                        .unwrap_or_else(|| codec::value::step_order0_bytes(&diff.old, &diff.new)),
                ))
        {
            best_value.offer(ValueCodec::UlpResidualZstd, || {
                codec::value::encode(ValueCodec::UlpResidualZstd, &diff.new, &diff.old, level)
            });
        }
        if allowed_v(ValueCodec::Raw) && best_value.beaten_by(diff.len() * 2) {
            best_value.offer(ValueCodec::Raw, || {
                codec::value::encode(ValueCodec::Raw, &diff.new, &diff.old, level)
            });
        }
        if allowed_v(ValueCodec::RawZstd)
            && (all || best_value.is_empty() || !best_value.beaten_by(diff.len()))
        {
            best_value.offer(ValueCodec::RawZstd, || {
                codec::value::encode(ValueCodec::RawZstd, &diff.new, &diff.old, level)
            });
        }

        let sparse = match (best_index.0, best_value.0) {
            (Some((index, index_bytes)), Some((value, value_bytes))) => Some(PartPayload::Sparse {
                index,
                value,
                index_bytes,
                value_bytes,
            }),
            _ => None,
        };
        let mut best = sparse;
        if all || best.is_none() || n * 8 >= len {
            for &c in &choice.dense {
                let bytes = codec::dense::encode(c, new, old, level);
                if best.as_ref().is_none_or(|b| bytes.len() < payload_len(b)) {
                    best = Some(PartPayload::Dense { codec: c, bytes });
                }
            }
        }
        // No codec allowed at all: fall back to the always-valid SparrowRL form (built only
        // then: an eager fallback cost every part a LEB128 and a raw encode, 4–5% of the
        // default set's encode).
        let payload = best.unwrap_or_else(|| PartPayload::Sparse {
            index: IndexCodec::Leb128Gaps,
            value: ValueCodec::Raw,
            index_bytes: codec::index::encode(
                IndexCodec::Leb128Gaps,
                &diff.positions,
                len,
                level,
                old,
            ),
            value_bytes: codec::value::encode(ValueCodec::Raw, &diff.new, &diff.old, level),
        });
        Self {
            tensor: tensor.to_owned(),
            start,
            len,
            changes: n,
            payload,
        }
    }

    /// Bytes of coded payload (index + values, or dense).
    pub fn payload_len(&self) -> usize {
        payload_len(&self.payload)
    }

    /// Serializes the part into a segment body.
    pub fn write(&self, out: &mut Vec<u8>) {
        put_bytes(out, self.tensor.as_bytes());
        put_varint(out, self.start);
        put_varint(out, self.len);
        put_varint(out, self.changes);
        match &self.payload {
            PartPayload::Sparse {
                index,
                value,
                index_bytes,
                value_bytes,
            } => {
                out.push(0);
                out.push(*index as u8);
                out.push(*value as u8);
                put_bytes(out, index_bytes);
                put_bytes(out, value_bytes);
            }
            PartPayload::Dense { codec, bytes } => {
                out.push(1);
                out.push(*codec as u8);
                put_bytes(out, bytes);
            }
        }
    }

    /// Parses one part, bounding every length.
    pub fn read(r: &mut Reader<'_>, max_bytes: usize) -> Result<Self, DecodeError> {
        let tensor = r.str("tensor name", MAX_NAME_LEN)?.to_owned();
        let start = r.varint("part start")?;
        let len = r.varint_at_most("part length", MAX_PART_ELEMS)?;
        if start.checked_add(len).is_none() {
            return Err(DecodeError::malformed(
                "part",
                "range end overflows 64 bits",
            ));
        }
        let changes = r.varint_at_most("part changes", len)?;
        let payload = match r.u8("part form")? {
            0 => {
                let index = IndexCodec::from_id(r.u8("index codec")?)?;
                let value = ValueCodec::from_id(r.u8("value codec")?)?;
                let index_bytes = r.bytes("index payload", max_bytes)?.to_vec();
                let value_bytes = r.bytes("value payload", max_bytes)?.to_vec();
                PartPayload::Sparse {
                    index,
                    value,
                    index_bytes,
                    value_bytes,
                }
            }
            1 => {
                let codec = DenseCodec::from_id(r.u8("dense codec")?)?;
                let bytes = r.bytes("dense payload", max_bytes)?.to_vec();
                PartPayload::Dense { codec, bytes }
            }
            f => return Err(DecodeError::malformed("part", format!("unknown form {f}"))),
        };
        Ok(Self {
            tensor,
            start,
            len,
            changes,
            payload,
        })
    }

    /// Whether decoding needs the base values of the range.
    pub fn needs_base(&self) -> bool {
        match &self.payload {
            PartPayload::Sparse { index, value, .. } => index.needs_base() || value.needs_base(),
            PartPayload::Dense { codec, .. } => codec.needs_base(),
        }
    }

    /// Decodes to absolute new bits. `base` must be the base values of exactly this
    /// part's range when [`needs_base`](Self::needs_base) says so.
    pub fn decode(&self, base: Option<&[u16]>) -> Result<DecodedPart, DecodeError> {
        if let Some(b) = base
            && b.len() as u64 != self.len
        {
            return Err(DecodeError::malformed(
                "part",
                format!(
                    "base range has {} elements, part covers {}",
                    b.len(),
                    self.len
                ),
            ));
        }
        let changes = match &self.payload {
            PartPayload::Sparse {
                index,
                value,
                index_bytes,
                value_bytes,
            } => {
                let positions =
                    codec::index::decode(*index, index_bytes, self.changes, self.len, base)?;
                let old: Option<Vec<u16>> = match (value.needs_base(), base) {
                    (true, Some(b)) => Some(positions.iter().map(|&p| b[p as usize]).collect()),
                    _ => None,
                };
                let values =
                    codec::value::decode(*value, value_bytes, positions.len(), old.as_deref())?;
                Changes::Sparse { positions, values }
            }
            PartPayload::Dense { codec, bytes } => {
                let values = codec::dense::decode(*codec, bytes, self.len as usize, base)?;
                Changes::Dense { values }
            }
        };
        Ok(DecodedPart {
            tensor: self.tensor.clone(),
            start: self.start,
            len: self.len,
            changes,
        })
    }

    /// Refuses a base range that is not exactly as long as this part.
    fn check_base(&self, base: &[u16]) -> Result<(), DecodeError> {
        if base.len() as u64 != self.len {
            return Err(DecodeError::malformed(
                "part",
                format!(
                    "base range has {} elements, part covers {}",
                    base.len(),
                    self.len
                ),
            ));
        }
        Ok(())
    }

    /// Decodes against the base values of exactly this part's range into the changed
    /// positions (relative to the part start), their new bits and their old bits — what
    /// staging keeps — reading each old value once. A dense part's changes are the elements
    /// whose bits differ.
    pub fn decode_changes(&self, base: &[u16]) -> Result<SparseChanges, DecodeError> {
        let (mut positions, mut new, mut old) = (Vec::new(), Vec::new(), Vec::new());
        self.decode_changes_as::<u64>(base, &mut positions, &mut new, &mut old)?;
        Ok(SparseChanges {
            positions,
            new,
            old,
        })
    }

    /// [`decode_changes`](Self::decode_changes) in the form a receiver stages: positions as
    /// `u32` relative to the part start (a part covers at most [`MAX_PART_ELEMS`] = 2²⁶
    /// elements), so a staged change takes 8 bytes (position, old and new bits) instead of 12:
    /// on a version's first staging, faulting in fresh pages is a large share of its time.
    pub fn decode_changes_compact(&self, base: &[u16]) -> Result<CompactChanges, DecodeError> {
        let mut out = CompactChanges::default();
        self.decode_changes_compact_into(base, &mut out)?;
        Ok(out)
    }

    /// [`decode_changes_compact`](Self::decode_changes_compact) into `out`'s vectors, cleared
    /// first and grown only where their capacity falls short: a receiver that hands the
    /// vectors of one version's undo log to the next version's staging takes no fresh pages
    /// (`apply::StagingBuffers`). On error `out` holds nothing meaningful.
    pub fn decode_changes_compact_into(
        &self,
        base: &[u16],
        out: &mut CompactChanges,
    ) -> Result<(), DecodeError> {
        let CompactChanges {
            positions,
            new,
            old,
        } = out;
        self.decode_changes_as::<u32>(base, positions, new, old)
    }

    /// Positions (as `P`), new bits and old bits of this part's changes, into these vectors
    /// (cleared first; their capacity is reused).
    fn decode_changes_as<P: Position>(
        &self,
        base: &[u16],
        positions: &mut Vec<P>,
        new: &mut Vec<u16>,
        old: &mut Vec<u16>,
    ) -> Result<(), DecodeError> {
        self.check_base(base)?;
        positions.clear();
        new.clear();
        old.clear();
        match &self.payload {
            PartPayload::Sparse {
                index,
                value,
                index_bytes,
                value_bytes,
            } => {
                codec::index::decode_into(
                    *index,
                    index_bytes,
                    self.changes,
                    self.len,
                    Some(base),
                    positions,
                )?;
                old.extend(
                    positions
                        .iter()
                        .map(|&p| base[Into::<u64>::into(p) as usize]),
                );
                codec::value::decode_into(*value, value_bytes, old.len(), Some(old), new)
            }
            PartPayload::Dense { codec, bytes } => {
                let values = codec::dense::decode(*codec, bytes, self.len as usize, Some(base))?;
                for (i, (&o, n)) in base.iter().zip(values).enumerate() {
                    if o != n {
                        positions.push(P::at(i as u64));
                        new.push(n);
                        old.push(o);
                    }
                }
                Ok(())
            }
        }
    }

    /// The codec names, for inspection.
    pub fn codec_names(&self) -> (&'static str, &'static str) {
        match &self.payload {
            PartPayload::Sparse { index, value, .. } => (index.name(), value.name()),
            PartPayload::Dense { codec, .. } => (codec.name(), ""),
        }
    }

    /// A bit per codec used, for the manifest's per-tensor codec summary.
    pub fn codec_mask(&self) -> u32 {
        match &self.payload {
            PartPayload::Sparse { index, value, .. } => {
                (1 << *index as u32) | (1 << (8 + *value as u32))
            }
            PartPayload::Dense { codec, .. } => 1 << (16 + *codec as u32),
        }
    }
}

/// Below this many changes in a part, every candidate is tried: the adaptive codecs' learning
/// costs more than the size estimates that skip candidates account for.
const SMALL_PART_CHANGES: u64 = 4096;
/// Below this many changes a part's table-driven codecs are not tried: their parameter bytes
/// (4 per class, 2 per step context, ~50–100 in all) and the decoder's tables (a 4 KB slot map
/// per class) cost more than adaptive contexts learning a few hundred changes.
const RANS_MIN_CHANGES: u64 = 256;

/// The order-0 entropy, in bytes (rounded down), of a mask of `n` changes among `len`
/// elements.
fn mask_order0_bytes(n: u64, len: u64) -> usize {
    if n == 0 || n >= len {
        return 0;
    }
    let p = n as f64 / len as f64;
    let bits = -(n as f64) * p.log2() - (len - n) as f64 * (1.0 - p).log2();
    (bits / 8.0) as usize
}

/// The smallest candidate seen so far.
struct Best<C>(Option<(C, Vec<u8>)>);

impl<C> Default for Best<C> {
    fn default() -> Self {
        Self(None)
    }
}

impl<C> Best<C> {
    fn is_empty(&self) -> bool {
        self.0.is_none()
    }

    /// Whether a candidate of `size` bytes would beat the current best.
    fn beaten_by(&self, size: usize) -> bool {
        self.0.as_ref().is_none_or(|(_, b)| size < b.len())
    }

    fn offer(&mut self, codec: C, encode: impl FnOnce() -> Vec<u8>) {
        let bytes = encode();
        if self.beaten_by(bytes.len()) {
            self.0 = Some((codec, bytes));
        }
    }
}

fn payload_len(p: &PartPayload) -> usize {
    match p {
        PartPayload::Sparse {
            index_bytes,
            value_bytes,
            ..
        } => index_bytes.len() + value_bytes.len(),
        PartPayload::Dense { bytes, .. } => bytes.len(),
    }
}

/// The changes of one part as [`EncodedPart::decode_changes`] returns them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SparseChanges {
    /// Positions relative to the part start, increasing.
    pub positions: Vec<u64>,
    pub new: Vec<u16>,
    pub old: Vec<u16>,
}

/// The changes of one part as a receiver stages them
/// ([`EncodedPart::decode_changes_compact`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CompactChanges {
    /// Positions relative to the part start, increasing (a part is at most 2²⁶ long).
    pub positions: Vec<u32>,
    pub new: Vec<u16>,
    pub old: Vec<u16>,
}

/// Decoded absolute new bits of one part.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodedPart {
    pub tensor: String,
    pub start: u64,
    pub len: u64,
    pub changes: Changes,
}

/// The new bits of a part: at some positions (relative to the part start), or all of them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Changes {
    Sparse {
        positions: Vec<u64>,
        values: Vec<u16>,
    },
    Dense {
        values: Vec<u16>,
    },
}

/// A segment: parts of one delta, numbered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    pub delta_id: [u8; 32],
    pub seq: u32,
    pub parts: Vec<EncodedPart>,
}

impl Segment {
    /// The segment body (without the frame envelope).
    pub fn encode_body(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.body_len_hint());
        self.write_body(&mut out);
        out
    }

    /// An upper estimate of the body length, for buffer capacity.
    pub fn body_len_hint(&self) -> usize {
        64 + self
            .parts
            .iter()
            .map(|p| p.payload_len() + p.tensor.len() + 64)
            .sum::<usize>()
    }

    /// Appends the segment body to `out`.
    pub fn write_body(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.delta_id);
        put_varint(out, u64::from(self.seq));
        put_varint(out, self.parts.len() as u64);
        for p in &self.parts {
            p.write(out);
        }
    }

    /// Parses a segment body. Lengths are bounded by the body itself.
    pub fn decode_body(body: &[u8]) -> Result<Self, DecodeError> {
        let mut r = Reader::new(body);
        let delta_id = r.array::<32>("segment delta id")?;
        let seq = r.varint_at_most("segment sequence number", u64::from(u32::MAX))? as u32;
        let n = r.varint_at_most("segment part count", MAX_PARTS_PER_SEGMENT)?;
        let mut parts = Vec::with_capacity((n as usize).min(body.len() / 8 + 1));
        for _ in 0..n {
            parts.push(EncodedPart::read(&mut r, body.len())?);
        }
        r.finish("segment")?;
        Ok(Self {
            delta_id,
            seq,
            parts,
        })
    }

    pub fn changes(&self) -> u64 {
        self.parts.iter().map(|p| p.changes).sum()
    }

    /// The delta id and sequence number at the start of a segment body, without parsing
    /// the parts: what a forwarder needs to index a segment it passes on.
    pub fn peek_id(body: &[u8]) -> Result<([u8; 32], u32), DecodeError> {
        let mut r = Reader::new(body);
        let delta_id = r.array::<32>("segment delta id")?;
        let seq = r.varint_at_most("segment sequence number", u64::from(u32::MAX))? as u32;
        Ok((delta_id, seq))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::delta::diff::diff_range;
    use proptest::prelude::*;

    fn part_round_trip(old: &[u16], new: &[u16], choice: &CodecChoice) -> EncodedPart {
        let d = diff_range(old, new);
        let p = EncodedPart::encode("t", 5, old, new, &d, choice);
        let mut body = Vec::new();
        p.write(&mut body);
        let mut r = Reader::new(&body);
        let q = EncodedPart::read(&mut r, body.len()).expect("reads");
        assert!(r.is_empty());
        assert_eq!(p, q);
        let dec = q.decode(Some(old)).expect("decodes");
        let mut rebuilt = old.to_vec();
        match dec.changes {
            Changes::Sparse { positions, values } => {
                for (p, v) in positions.iter().zip(values) {
                    rebuilt[*p as usize] = v;
                }
            }
            Changes::Dense { values } => rebuilt = values,
        }
        assert_eq!(rebuilt, new);
        p
    }

    fn every_choice() -> Vec<CodecChoice> {
        let mut v = vec![CodecChoice::default()];
        for i in IndexCodec::ALL {
            for c in ValueCodec::ALL {
                v.push(CodecChoice::only(i, c));
            }
        }
        for d in DenseCodec::ALL {
            v.push(CodecChoice::only_dense(d));
        }
        v
    }

    proptest! {
        #[test]
        fn parts_round_trip_adversarial_bits_with_every_codec(
            pairs in proptest::collection::vec((any::<u16>(), any::<u16>(), 0u8..4), 0..400)
        ) {
            // Adversarial patterns: NaN payloads, ±0, ±Inf, subnormals, sign crossings.
            const SPECIAL: [u16; 10] = [0x7FC0, 0x7FC1, 0xFFFF, 0x0000, 0x8000, 0x7F80, 0xFF80, 0x0001, 0x8001, 0x007F];
            let old: Vec<u16> = pairs.iter().map(|p| p.0).collect();
            let new: Vec<u16> = pairs.iter().map(|&(o, n, k)| match k {
                0 => o,
                1 => n,
                2 => SPECIAL[(n % 10) as usize],
                _ => o ^ 0x8000,
            }).collect();
            for choice in every_choice() {
                part_round_trip(&old, &new, &choice);
            }
        }
    }

    #[test]
    fn empty_and_all_changed_and_single_element_ranges() {
        for choice in every_choice() {
            part_round_trip(&[], &[], &choice);
            part_round_trip(&[1], &[1], &choice);
            part_round_trip(&[1], &[2], &choice);
            let old: Vec<u16> = (0..3000).map(|i| i as u16).collect();
            let new: Vec<u16> = old.iter().map(|v| v.wrapping_add(1)).collect();
            part_round_trip(&old, &new, &choice);
        }
    }

    #[test]
    fn v1_choice_never_uses_later_codecs_and_base_needs_are_reported() {
        let old: Vec<u16> = (0..5000)
            .map(|i| 0x3C00 | (i * 7919 % 0x3FF) as u16)
            .collect();
        let new: Vec<u16> = old
            .iter()
            .enumerate()
            .map(|(i, &v)| if i % 13 == 0 { v + 1 } else { v })
            .collect();
        let d = diff_range(&old, &new);
        let v1 = CodecChoice {
            index: IndexCodec::V1.to_vec(),
            value: ValueCodec::V1.to_vec(),
            ..CodecChoice::default()
        };
        let p = EncodedPart::encode("w", 0, &old, &new, &d, &v1);
        let PartPayload::Sparse { index, value, .. } = p.payload else {
            panic!("sparse expected");
        };
        assert!(IndexCodec::V1.contains(&index) && ValueCodec::V1.contains(&value));
        // By default the context-modelled codecs win on such a part.
        let p = part_round_trip(&old, &new, &CodecChoice::default());
        assert_eq!(
            p.codec_names(),
            ("exp-class-gaps+rc", "ulp-step+rc"),
            "{:?}",
            p.codec_names()
        );
        // A part whose positions need the base says so, even with raw values, and refuses
        // to decode without it.
        let p = EncodedPart::encode(
            "w",
            0,
            &old,
            &new,
            &d,
            &CodecChoice::only(IndexCodec::ExpClassGapsRc, ValueCodec::Raw),
        );
        assert!(p.needs_base());
        assert!(p.decode(None).is_err());
        assert!(p.decode(Some(&old[1..])).is_err());
        assert!(p.decode(Some(&old)).is_ok());
    }

    #[test]
    fn dense_fallback_wins_when_everything_changed() {
        let old: Vec<u16> = (0..10_000).map(|i| (i * 7919) as u16).collect();
        let new: Vec<u16> = old.iter().map(|v| v ^ 0x5A5A).collect();
        let p = part_round_trip(&old, &new, &CodecChoice::default());
        assert!(
            matches!(p.payload, PartPayload::Dense { .. }),
            "{:?}",
            p.codec_names()
        );
    }

    #[test]
    fn segment_body_golden_prefix_and_round_trip() {
        let old = [0x3F80u16, 0x3F80, 0x3F80];
        let new = [0x3F80u16, 0x3F81, 0x3F80];
        let d = diff_range(&old, &new);
        let part = EncodedPart::encode(
            "w",
            0,
            &old,
            &new,
            &d,
            &CodecChoice::only(IndexCodec::Leb128Gaps, ValueCodec::Raw),
        );
        let seg = Segment {
            delta_id: [7; 32],
            seq: 3,
            parts: vec![part],
        };
        let body = seg.encode_body();
        let mut expected = vec![7u8; 32];
        // seq 3, one part, name "w", start 0, len 3, 1 change, sparse, leb128, raw,
        // index payload [1] (gap 1), value payload 81 3f.
        expected.extend_from_slice(&[3, 1, 1, b'w', 0, 3, 1, 0, 1, 3, 1, 1, 2, 0x81, 0x3F]);
        assert_eq!(body, expected);
        assert_eq!(Segment::decode_body(&body).expect("decodes"), seg);
    }

    #[test]
    fn truncated_segment_bodies_are_errors() {
        let old: Vec<u16> = (0..500).collect();
        let new: Vec<u16> = old
            .iter()
            .map(|v| if v % 7 == 0 { v + 1 } else { *v })
            .collect();
        let d = diff_range(&old, &new);
        let part = EncodedPart::encode("w", 0, &old, &new, &d, &CodecChoice::default());
        let body = Segment {
            delta_id: [1; 32],
            seq: 0,
            parts: vec![part],
        }
        .encode_body();
        for cut in 0..body.len() {
            assert!(Segment::decode_body(&body[..cut]).is_err(), "cut at {cut}");
        }
    }
}

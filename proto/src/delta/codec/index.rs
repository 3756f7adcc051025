//! Index codecs: the sorted positions of changed elements within a part.
//!
//! Positions are `u64` throughout, so no tensor is capped at 2^31 or 2^32 elements. All
//! gap codecs code `x₀ = p₀` and `xᵢ = pᵢ − pᵢ₋₁ − 1`, so any decoded sequence is strictly
//! increasing by construction; the decoder then checks the count and the range bound.
//!
//! [`IndexCodec::ExpClassGapsRc`] conditions the change mask on the base: both sides hold the
//! base values, so each element's exponent class is known to the decoder before it reads a
//! bit, and gaps are counted within a class (the exact stream is in `docs/format.md`). Its
//! decoder scans the whole range once (about a nanosecond per element, no allocation beyond
//! the positions) and needs the base values of exactly the part's range.

use super::bits::{BitReader, BitWriter};
use super::gaps_rans;
use super::rc::{Bit, EXP_CLASSES, IntModel, RangeDecoder, RangeEncoder, exp_class};
use super::scan;
use super::{IndexCodec, ZstdPayload, zstd_compress, zstd_decompress};
use crate::error::DecodeError;
use crate::wire::{Reader, put_varint, varint_len};

/// Gaps per Rice block; each block carries its own parameter `k`.
const RICE_BLOCK: usize = 1024;
/// Quotients at or above this many ones take the escape path (raw bit width + bits).
const RICE_ESCAPE: u64 = 40;

/// Encodes strictly increasing `positions`, all below `range_len`, with `codec`. `base`
/// must be the base values of the whole range when the codec
/// [needs the base](IndexCodec::needs_base) (it is ignored otherwise).
///
/// # Panics
/// If the codec needs the base and `base` does not cover exactly `range_len` elements, or
/// `range_len` is 2³² or more (a caller error: parts are far smaller).
pub fn encode(
    codec: IndexCodec,
    positions: &[u64],
    range_len: u64,
    zstd_level: i32,
    base: &[u16],
) -> Vec<u8> {
    match codec {
        IndexCodec::ExpClassGapsRc | IndexCodec::ExpClassGapsRans => {
            assert!(
                base.len() as u64 == range_len && range_len <= u64::from(u32::MAX),
                "exp-class gaps need the base values of the whole range"
            );
            if codec == IndexCodec::ExpClassGapsRc {
                exp_class_gaps(positions, base)
            } else {
                exp_class_gaps_rans(positions, base)
            }
        }
        IndexCodec::Leb128Gaps => leb128_gaps(positions),
        IndexCodec::Leb128GapsZstd => {
            zstd_compress(&leb128_gaps(positions), zstd_level, ZstdPayload::General)
        }
        IndexCodec::RiceGaps => rice_gaps(positions),
        IndexCodec::BitmapZstd => zstd_compress(
            &bitmap(positions, range_len),
            zstd_level,
            ZstdPayload::General,
        ),
    }
}

/// Decodes exactly `count` positions below `range_len`. `base` must be the base values of the
/// whole range when the codec [needs the base](IndexCodec::needs_base).
pub fn decode(
    codec: IndexCodec,
    bytes: &[u8],
    count: u64,
    range_len: u64,
    base: Option<&[u16]>,
) -> Result<Vec<u64>, DecodeError> {
    let mut out = Vec::new();
    decode_into(codec, bytes, count, range_len, base, &mut out)?;
    Ok(out)
}

/// A decoded position's type: `u64` for any range, `u32` for a range of at most 2³²
/// elements (a part covers at most 2²⁶), the form a receiver stages: half the memory, and
/// fresh pages are a large share of staging's time.
pub trait Position: Copy + Into<u64> {
    /// The longest range whose positions this type holds.
    const MAX_RANGE: u64;
    /// `p`, which is below [`MAX_RANGE`](Self::MAX_RANGE).
    fn at(p: u64) -> Self;
    /// Appends `ps`, positions in a range of under 2³² elements.
    fn extend_u32(out: &mut Vec<Self>, ps: &[u32]);
    /// `out` itself when `Self` is `u32`.
    fn as_u32s(out: &mut Vec<Self>) -> Option<&mut Vec<u32>>;
}

impl Position for u32 {
    const MAX_RANGE: u64 = 1 << 32;
    #[inline(always)]
    fn at(p: u64) -> Self {
        p as u32
    }
    fn extend_u32(out: &mut Vec<Self>, ps: &[u32]) {
        out.extend_from_slice(ps);
    }
    fn as_u32s(out: &mut Vec<Self>) -> Option<&mut Vec<u32>> {
        Some(out)
    }
}

impl Position for u64 {
    const MAX_RANGE: u64 = u64::MAX;
    #[inline(always)]
    fn at(p: u64) -> Self {
        p
    }
    fn extend_u32(out: &mut Vec<Self>, ps: &[u32]) {
        out.extend(ps.iter().map(|&p| u64::from(p)));
    }
    fn as_u32s(_: &mut Vec<Self>) -> Option<&mut Vec<u32>> {
        None
    }
}

/// [`decode`] into `out` (cleared first), as `u32` or `u64` positions ([`Position`]); a range
/// longer than the type holds is refused. On an error `out` holds whatever was decoded before
/// it.
pub fn decode_into<P: Position>(
    codec: IndexCodec,
    bytes: &[u8],
    count: u64,
    range_len: u64,
    base: Option<&[u16]>,
    out: &mut Vec<P>,
) -> Result<(), DecodeError> {
    out.clear();
    if range_len > P::MAX_RANGE {
        return Err(DecodeError::malformed(
            "index payload",
            format!("a range of {range_len} elements, more than these positions hold"),
        ));
    }
    if count > range_len {
        return Err(DecodeError::malformed(
            "index payload",
            format!("{count} changes in a range of {range_len} elements"),
        ));
    }
    match codec {
        IndexCodec::Leb128Gaps => decode_leb128_gaps(bytes, count, range_len, out)?,
        IndexCodec::Leb128GapsZstd => {
            let raw = zstd_decompress(bytes, (count as usize).saturating_mul(10), "index payload")?;
            decode_leb128_gaps(&raw, count, range_len, out)?
        }
        IndexCodec::RiceGaps => decode_rice_gaps(bytes, count, range_len, out)?,
        IndexCodec::ExpClassGapsRc | IndexCodec::ExpClassGapsRans => {
            let Some(base) = base.filter(|b| b.len() as u64 == range_len) else {
                return Err(DecodeError::malformed(
                    "exp-class gaps",
                    "decoding needs the base values of the whole range",
                ));
            };
            if range_len > u64::from(u32::MAX) {
                return Err(DecodeError::malformed(
                    "exp-class gaps",
                    "range of 2^32 elements or more",
                ));
            }
            // These decode to u32 natively (their ranges are under 2³²).
            let mut narrow = Vec::new();
            let native = P::as_u32s(out).unwrap_or(&mut narrow);
            if codec == IndexCodec::ExpClassGapsRc {
                decode_exp_class_gaps(bytes, count, base, native)?
            } else {
                gaps_rans::decode(bytes, count, base, native)?
            }
            P::extend_u32(out, &narrow);
        }
        IndexCodec::BitmapZstd => {
            let want = range_len.div_ceil(8) as usize;
            let raw = zstd_decompress(bytes, want, "index bitmap")?;
            if raw.len() != want {
                return Err(DecodeError::malformed(
                    "index bitmap",
                    format!("{} bytes for {range_len} elements", raw.len()),
                ));
            }
            decode_bitmap(&raw, count, range_len, out)?
        }
    }
    Ok(())
}

fn gaps(positions: &[u64]) -> impl Iterator<Item = u64> + '_ {
    let mut prev: Option<u64> = None;
    positions.iter().map(move |&p| {
        let x = match prev {
            None => p,
            Some(q) => p - q - 1,
        };
        prev = Some(p);
        x
    })
}

fn leb128_gaps(positions: &[u64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(positions.len() * 2);
    for x in gaps(positions) {
        put_varint(&mut out, x);
    }
    out
}

/// Accumulates decoded gaps into positions, checking order and the range bound.
struct PositionBuilder<P> {
    out: Vec<P>,
    next_min: u64,
    range_len: u64,
}

impl<P: Position> PositionBuilder<P> {
    /// Builds into `out`'s buffer (taken; [`finish`](Self::finish) gives it back): an owned
    /// vector keeps its length in a register through the hot loop.
    fn new(count: u64, range_len: u64, input_bytes: usize, out: &mut Vec<P>) -> Self {
        let mut out = std::mem::take(out);
        // Never trust `count` for the allocation beyond what the input could possibly hold.
        let cap = (count as usize).min(input_bytes.saturating_mul(8).saturating_add(8));
        out.reserve(cap);
        Self {
            out,
            next_min: 0,
            range_len,
        }
    }

    fn finish(self, out: &mut Vec<P>) {
        *out = self.out;
    }

    #[inline]
    fn push_gap(&mut self, x: u64) -> Result<(), DecodeError> {
        let p = self.next_min.checked_add(x).filter(|&p| p < self.range_len);
        let Some(p) = p else {
            return Err(DecodeError::malformed(
                "index payload",
                format!("position beyond the range of {} elements", self.range_len),
            ));
        };
        // `p < range_len ≤ P::MAX_RANGE`.
        self.out.push(P::at(p));
        self.next_min = p + 1;
        Ok(())
    }

    /// [`push_gap`](Self::push_gap) for a block of gaps, in one pass with no per-gap branch
    /// or capacity check: positions are computed with wrapping arithmetic and a sticky flag,
    /// and the block is refused whole if any lies beyond the range.
    fn push_gaps(&mut self, gaps: &[u64]) -> Result<(), DecodeError> {
        let (mut next, len) = (self.next_min, self.range_len);
        let mut beyond = false;
        let before = self.out.len();
        // Sized first, then written through a slice: the state stays in registers (an
        // `extend` closure keeps it behind references, in memory).
        self.out.resize(before + gaps.len(), P::at(0));
        for (slot, &g) in self.out[before..].iter_mut().zip(gaps) {
            // `next ≤ len` until a position fails: then the flag is set and stays.
            beyond |= g >= len.wrapping_sub(next);
            let p = next.wrapping_add(g);
            next = p.wrapping_add(1);
            // Past a failed position `p` may exceed what `P` holds; the block is then cut
            // off below and never read.
            *slot = P::at(p);
        }
        if beyond {
            self.out.truncate(before);
            return Err(DecodeError::malformed(
                "index payload",
                format!("position beyond the range of {} elements", self.range_len),
            ));
        }
        self.next_min = next;
        Ok(())
    }
}

fn decode_leb128_gaps<P: Position>(
    bytes: &[u8],
    count: u64,
    range_len: u64,
    out: &mut Vec<P>,
) -> Result<(), DecodeError> {
    let mut b = PositionBuilder::new(count, range_len, bytes.len(), out);
    let mut r = Reader::new(bytes);
    for _ in 0..count {
        b.push_gap(r.varint("index gap")?)?;
    }
    r.finish("index payload")?;
    b.finish(out);
    Ok(())
}

/// Cost in bits of Rice-coding a gap `x` with parameter `k`.
#[inline(always)]
fn rice_bits(x: u64, k: u32) -> u64 {
    let q = x >> k;
    if q < RICE_ESCAPE {
        q + 1 + u64::from(k)
    } else {
        RICE_ESCAPE + 7 + u64::from(64 - x.leading_zeros())
    }
}

/// The Rice parameter for a block of gaps: of the two around `log2(mean · ln 2)` (the
/// optimum for geometric gaps), the cheaper, the lower on a tie.
///
/// Written for the vectorizer: the sum is an integer's (the same mean as a sum of `f64`s
/// while it stays below 2⁵³, where every partial sum is exact), and where no gap reaches
/// the escape under the lower parameter (all but pathological blocks) both costs come from
/// sums of shifted gaps, with no per-gap branch.
fn best_rice_k(xs: &[u64]) -> u32 {
    let n = xs.len().max(1) as u64;
    // A block's gaps sum to less than its last position: no overflow.
    let (sum, max) = xs.iter().fold((0u64, 0u64), |(s, m), &x| (s + x, m.max(x)));
    let mean = if sum < 1 << 53 {
        sum as f64 / n as f64
    } else {
        xs.iter().map(|&x| x as f64).sum::<f64>() / n as f64
    };
    let guess = if mean < 1.0 {
        0
    } else {
        (mean * std::f64::consts::LN_2).log2().floor().max(0.0) as i64
    };
    let lo = guess.clamp(0, 58) as u32;
    let hi = (guess + 1).min(58) as u32;
    let (c_lo, c_hi) = if max >> lo < RICE_ESCAPE {
        // No escape under `lo`, so none under `hi ≥ lo`: a gap costs `(x >> k) + 1 + k`.
        let (q_lo, q_hi) = xs
            .iter()
            .fold((0u64, 0u64), |(a, b), &x| (a + (x >> lo), b + (x >> hi)));
        (
            q_lo + n * (1 + u64::from(lo)),
            q_hi + n * (1 + u64::from(hi)),
        )
    } else {
        xs.iter().fold((0u64, 0u64), |(a, b), &x| {
            (a + rice_bits(x, lo), b + rice_bits(x, hi))
        })
    };
    if c_hi < c_lo { hi } else { lo }
}

/// Rice-coded gaps in blocks of [`RICE_BLOCK`], each with its own parameter (6 bits). The
/// gaps of a block are computed into a stack buffer (no vector of every gap); a run of gaps
/// whose unary quotient, terminator and low bits fit in one write goes through
/// [`BitWriter::write_rice_run`], the others one by one.
fn rice_gaps(positions: &[u64]) -> Vec<u8> {
    let mut w = BitWriter::with_capacity(positions.len() + 16);
    let mut buf = [0u64; RICE_BLOCK];
    let mut next_min = 0u64;
    for block in positions.chunks(RICE_BLOCK) {
        let xs = &mut buf[..block.len()];
        // Each gap from its own position and the one before (no chain through the loop).
        let Some((&first, _)) = block.split_first() else {
            continue;
        };
        xs[0] = first - next_min;
        for (x, pair) in xs[1..].iter_mut().zip(block.windows(2)) {
            *x = pair[1] - pair[0] - 1;
        }
        next_min = block[block.len() - 1] + 1;
        let k = best_rice_k(xs);
        w.write(u64::from(k), 6);
        let mut done = 0;
        while done < xs.len() {
            done += w.write_rice_run(k, RICE_ESCAPE as u32, &xs[done..]);
            let Some(&x) = xs.get(done) else {
                break;
            };
            let q = x >> k;
            if q < RICE_ESCAPE {
                w.write_unary(q);
                w.write_wide(x, k);
            } else {
                write_rice_escape(&mut w, x);
            }
            done += 1;
        }
    }
    w.finish()
}

/// A gap whose quotient reaches [`RICE_ESCAPE`]: that many ones with no terminator, then its
/// width (7 bits) and its raw bits.
fn write_rice_escape(w: &mut BitWriter, x: u64) {
    w.write((1u64 << RICE_ESCAPE) - 1, RICE_ESCAPE as u32);
    let width = 64 - x.leading_zeros();
    w.write(u64::from(width), 7);
    w.write_wide(x, width);
}

/// The gap of quotient `q` and low bits `low` under Rice parameter `k`, refused where it
/// does not fit in 64 bits.
#[inline(always)]
fn rice_gap(q: u64, k: u32, low: u64) -> Result<u64, DecodeError> {
    (q << k)
        .checked_add(low)
        .filter(|_| q.leading_zeros() >= k)
        .ok_or_else(|| DecodeError::malformed("rice index payload", "gap overflows"))
}

/// Rice-coded gaps, a block at a time: the block's gaps are read (through
/// [`BitReader::read_rice_run`], an escape or the input's last bytes one by one), then turned
/// into positions and checked against the range together. So where a block holds both a gap
/// beyond the range and a cut, the cut is what is reported; either way the payload is refused.
fn decode_rice_gaps<P: Position>(
    bytes: &[u8],
    count: u64,
    range_len: u64,
    out: &mut Vec<P>,
) -> Result<(), DecodeError> {
    let mut b = PositionBuilder::new(count, range_len, bytes.len(), out);
    let mut r = BitReader::new(bytes);
    let mut gaps = [0u64; RICE_BLOCK];
    let mut left = count;
    while left > 0 {
        let k = r.read(6)? as u32;
        if k > 58 {
            return Err(DecodeError::malformed(
                "rice index payload",
                "parameter above 58",
            ));
        }
        let n = left.min(RICE_BLOCK as u64) as usize;
        let block = &mut gaps[..n];
        let mut got = 0;
        while got < n {
            // Almost every gap comes from the run; an escape, or a gap in the input's last
            // bytes, is read here.
            got += r.read_rice_run(k, RICE_ESCAPE as u32, &mut block[got..]);
            if got == n {
                break;
            }
            let q = r.read_unary(RICE_ESCAPE)?;
            block[got] = if q < RICE_ESCAPE {
                rice_gap(q, k, r.read_wide(k)?)?
            } else {
                let width = r.read(7)? as u32;
                if width > 64 {
                    return Err(DecodeError::malformed(
                        "rice index payload",
                        "escape width above 64",
                    ));
                }
                r.read_wide(width)?
            };
            got += 1;
        }
        b.push_gaps(block)?;
        left -= n as u64;
    }
    if r.trailing_bytes() != 0 {
        return Err(DecodeError::TrailingBytes {
            what: "rice index payload",
            trailing: r.trailing_bytes(),
        });
    }
    b.finish(out);
    Ok(())
}

fn bitmap(positions: &[u64], range_len: u64) -> Vec<u8> {
    let mut bits = vec![0u8; range_len.div_ceil(8) as usize];
    for &p in positions {
        bits[(p / 8) as usize] |= 1 << (p % 8);
    }
    bits
}

fn decode_bitmap<P: Position>(
    raw: &[u8],
    count: u64,
    range_len: u64,
    out: &mut Vec<P>,
) -> Result<(), DecodeError> {
    let ones: u64 = raw.iter().map(|b| u64::from(b.count_ones())).sum();
    let tail_bits = range_len % 8;
    if tail_bits != 0 && raw.last().is_some_and(|&b| b >> tail_bits != 0) {
        return Err(DecodeError::malformed(
            "index bitmap",
            "bits set beyond the range",
        ));
    }
    if ones != count {
        return Err(DecodeError::malformed(
            "index bitmap",
            format!("{ones} bits set, {count} expected"),
        ));
    }
    // An owned vector keeps its length in a register through the loop.
    let mut positions = std::mem::take(out);
    positions.reserve(count as usize);
    for (i, &byte) in raw.iter().enumerate() {
        let mut b = byte;
        while b != 0 {
            let bit = b.trailing_zeros();
            positions.push(P::at(i as u64 * 8 + u64::from(bit)));
            b &= b - 1;
        }
    }
    *out = positions;
    Ok(())
}

/// Quotients at or above this take the escape of [`GapModel`].
const GAP_Q_LIMIT: u64 = 16;

/// The model of one exponent class's gaps: an adaptive Golomb-Rice code. The parameter `k`
/// follows a running mean of the class's gaps (both sides compute it from the gaps coded so
/// far); the quotient `g >> k` is coded in unary with one adaptive context per position, the
/// top bit of the remainder with an adaptive context per `k`, the other `k − 1` bits
/// directly. Quotients of [`GAP_Q_LIMIT`] or more escape to an adaptive Exp-Golomb code of
/// `g − (GAP_Q_LIMIT << k)`. About four coder steps per change instead of one per bit of
/// the gap's bit length.
#[derive(Debug, Clone)]
struct GapModel {
    /// 32 × a running mean of the gaps (an exponential average with weight 1/32).
    mean32: u64,
    quotient: [Bit; GAP_Q_LIMIT as usize],
    top: [Bit; 33],
}

impl Default for GapModel {
    fn default() -> Self {
        Self {
            mean32: 32 * 16,
            quotient: [Bit::default(); GAP_Q_LIMIT as usize],
            top: [Bit::default(); 33],
        }
    }
}

impl GapModel {
    /// The Rice parameter: `⌊log2(mean · 45/64)⌋` (45/64 ≈ ln 2, the optimum for
    /// geometric gaps), at least 0, at most 32.
    #[inline]
    fn k(&self) -> u32 {
        let t = (self.mean32 * 45) >> 11;
        if t == 0 {
            0
        } else {
            (63 - t.leading_zeros()).min(32)
        }
    }

    #[inline]
    fn adapt(&mut self, g: u64) {
        self.mean32 = self.mean32 - (self.mean32 >> 5) + g.min(1 << 40);
    }

    fn encode(&mut self, e: &mut RangeEncoder, escape: &mut IntModel, g: u64) {
        let k = self.k();
        let q = g >> k;
        for i in 0..GAP_Q_LIMIT {
            let more = i < q;
            e.bit(&mut self.quotient[i as usize], more);
            if !more {
                break;
            }
        }
        if q >= GAP_Q_LIMIT {
            escape.encode(e, g - (GAP_Q_LIMIT << k));
        } else if k >= 1 {
            e.bit(&mut self.top[k as usize], (g >> (k - 1)) & 1 != 0);
            e.direct(g, k - 1);
        }
        self.adapt(g);
    }

    fn decode(&mut self, d: &mut RangeDecoder<'_>, escape: &mut IntModel) -> u64 {
        let k = self.k();
        let mut q = 0;
        while q < GAP_Q_LIMIT && d.bit(&mut self.quotient[q as usize]) {
            q += 1;
        }
        let g = if q >= GAP_Q_LIMIT {
            (GAP_Q_LIMIT << k) + escape.decode(d)
        } else if k >= 1 {
            let top = u64::from(d.bit(&mut self.top[k as usize]));
            (q << k) | (top << (k - 1)) | d.direct(k - 1)
        } else {
            q
        };
        self.adapt(g);
        g
    }
}

/// [`IndexCodec::ExpClassGapsRc`]: every element of the range belongs to the class of its
/// base value ([`exp_class`]); within each class, the changed elements are coded as gaps
/// counted in elements *of that class*, so each class's gaps follow that class's change
/// probability. One range-coded stream holds first the gap before the first change of each
/// of the [`EXP_CLASSES`] classes, in class order, then, for each change in position order,
/// the gap to the next change of the same class. A class's last gap counts its remaining
/// elements (zero for a class absent from the range), so a decoder scanning the range
/// never meets an undecoded gap and ends with every count at zero.
fn exp_class_gaps(positions: &[u64], base: &[u16]) -> Vec<u8> {
    let mut ranks = Vec::with_capacity(positions.len());
    let totals = scan::ranks_at(base, positions, &mut ranks);
    let classes = positions.iter().map(|&p| base[p as usize]);
    exp_class_gaps_ranked(classes, &ranks, &totals)
}

/// [`IndexCodec::ExpClassGapsRc`] from what a ranked diff found: the base value at each
/// change (in position order), each change's rank in its class (how many elements of the
/// class precede it in the range) and the number of elements of each class in the range.
/// The bytes are those of [`encode`] on the same range.
pub fn encode_exp_class_gaps_ranked(
    old_at_changes: &[u16],
    ranks: &[u32],
    class_totals: &[u32; EXP_CLASSES],
) -> Vec<u8> {
    exp_class_gaps_ranked(old_at_changes.iter().copied(), ranks, class_totals)
}

/// [`IndexCodec::ExpClassGapsRans`] from what a ranked diff found (as
/// [`encode_exp_class_gaps_ranked`]). The bytes are those of [`encode`] on the same range.
pub fn encode_exp_class_gaps_rans_ranked(
    old_at_changes: &[u16],
    ranks: &[u32],
    class_totals: &[u32; EXP_CLASSES],
) -> Vec<u8> {
    let (classes, after, firsts) = class_gaps(old_at_changes.iter().copied(), ranks, class_totals);
    gaps_rans::encode(&classes, &after, &firsts)
}

fn exp_class_gaps_rans(positions: &[u64], base: &[u16]) -> Vec<u8> {
    let mut ranks = Vec::with_capacity(positions.len());
    let totals = scan::ranks_at(base, positions, &mut ranks);
    let old = positions.iter().map(|&p| base[p as usize]);
    let (classes, after, firsts) = class_gaps(old, &ranks, &totals);
    gaps_rans::encode(&classes, &after, &firsts)
}

/// The class gaps of a part from its changes' ranks: the class of each change, the gap after
/// it to its class's next change (or to the class's end), and each class's gap before its
/// first change (its total for a class without changes).
pub(super) fn class_gaps(
    old_at_changes: impl DoubleEndedIterator<Item = u16> + ExactSizeIterator,
    ranks: &[u32],
    totals: &[u32; EXP_CLASSES],
) -> (Vec<u8>, Vec<u32>, [u32; EXP_CLASSES]) {
    debug_assert_eq!(old_at_changes.len(), ranks.len());
    // Backwards, the gap after each change is the next change's rank in the same class
    // (or the class's total) minus its own rank minus one; what is left in `next` at the
    // front is each class's first gap.
    let mut next = *totals;
    let mut after = vec![0u32; ranks.len()];
    let mut classes = vec![0u8; ranks.len()];
    for ((k, o), &r) in old_at_changes.enumerate().rev().zip(ranks.iter().rev()) {
        let c = exp_class(o);
        classes[k] = c as u8;
        after[k] = next[c] - r - 1;
        next[c] = r;
    }
    (classes, after, next)
}

fn exp_class_gaps_ranked(
    old_at_changes: impl DoubleEndedIterator<Item = u16> + ExactSizeIterator + Clone,
    ranks: &[u32],
    totals: &[u32; EXP_CLASSES],
) -> Vec<u8> {
    let (_, after, next) = class_gaps(old_at_changes.clone(), ranks, totals);
    let mut models = vec![GapModel::default(); EXP_CLASSES];
    let mut escape = IntModel::default();
    let mut e = RangeEncoder::with_capacity(ranks.len() + 16);
    // First gaps: one Exp-Golomb model for all classes, which learns fast that absent
    // classes code 0 (a class's own model would pay its start-up cost once per class).
    let mut firsts = IntModel::default();
    for &g in &next {
        firsts.encode(&mut e, u64::from(g));
    }
    for (o, &g) in old_at_changes.zip(&after) {
        models[exp_class(o)].encode(&mut e, &mut escape, u64::from(g));
    }
    e.finish()
}

fn decode_exp_class_gaps(
    bytes: &[u8],
    count: u64,
    base: &[u16],
    out: &mut Vec<u32>,
) -> Result<(), DecodeError> {
    const WHAT: &str = "exp-class gaps";
    let range_len = base.len() as u64;
    let mut d = RangeDecoder::new(bytes);
    let mut models = vec![GapModel::default(); EXP_CLASSES];
    let mut escape = IntModel::default();
    // `rem[c]`: elements of class `c` still to skip before its next change.
    let mut rem = [0u32; EXP_CLASSES];
    let mut firsts = IntModel::default();
    for r in &mut rem {
        let g = firsts.decode(&mut d);
        if g > range_len || d.overran() {
            return Err(DecodeError::malformed(WHAT, "gap beyond the range"));
        }
        *r = g as u32;
    }
    // `count ≤ range_len = base.len()` bounds the output by what the caller holds; the
    // up-front capacity is also bounded by the input (a change rarely costs under 1/64 of a
    // bit), so a few forged bytes claiming 2²⁶ changes do not reserve 512 MB before decoding
    // proves them. The vector grows if a real stream needs more.
    let cap = (count as usize).min(bytes.len().saturating_mul(512).saturating_add(1024));
    out.reserve(cap);
    scan::countdown(base, &mut rem, &mut |p, c| {
        if out.len() as u64 == count {
            return Err(DecodeError::malformed(WHAT, "more changes than declared"));
        }
        // The caller checked `range_len < 2³²`.
        out.push(p as u32);
        let g = models[c].decode(&mut d, &mut escape);
        if g > range_len || d.overran() {
            return Err(DecodeError::malformed(WHAT, "gap beyond the range"));
        }
        Ok(g as u32)
    })?;
    if out.len() as u64 != count {
        return Err(DecodeError::malformed(
            WHAT,
            format!("{} changes decoded, {count} declared", out.len()),
        ));
    }
    if rem.iter().any(|&r| r != 0) {
        return Err(DecodeError::malformed(
            WHAT,
            "a class's last gap overruns the range",
        ));
    }
    d.finish(WHAT)?;
    Ok(())
}

/// Exact size in bytes [`IndexCodec::Leb128Gaps`] takes, without encoding.
pub fn leb128_gaps_len(positions: &[u64]) -> usize {
    gaps(positions).map(varint_len).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Base values with exponents spread over every class (none for huge ranges, which
    /// only the gap codecs are tested on).
    fn test_base(range_len: u64) -> Vec<u16> {
        if range_len > 1 << 24 {
            return Vec::new();
        }
        (0..range_len)
            .map(|i| (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 48) as u16)
            .collect()
    }

    fn round_trip(codec: IndexCodec, positions: &[u64], range_len: u64) {
        let base = test_base(range_len);
        let enc = encode(codec, positions, range_len, 1, &base);
        let dec =
            decode(codec, &enc, positions.len() as u64, range_len, Some(&base)).expect("decodes");
        assert_eq!(dec, positions, "{}", codec.name());
        same_as_u32(codec, &enc, positions, range_len, &base);
    }

    /// The `u32` positions a receiver stages are the `u64` ones, and a range they cannot hold
    /// is refused with an error (never truncated).
    fn same_as_u32(codec: IndexCodec, enc: &[u8], positions: &[u64], range_len: u64, base: &[u16]) {
        let mut narrow: Vec<u32> = vec![7; 3];
        let got = decode_into(
            codec,
            enc,
            positions.len() as u64,
            range_len,
            Some(base),
            &mut narrow,
        );
        if range_len <= 1 << 32 {
            got.expect("decodes as u32");
            assert!(
                narrow
                    .iter()
                    .map(|&p| u64::from(p))
                    .eq(positions.iter().copied()),
                "{}",
                codec.name()
            );
        } else {
            assert!(
                got.is_err(),
                "{}: a range of {range_len} as u32",
                codec.name()
            );
        }
    }

    fn sorted_positions(max: u64) -> impl Strategy<Value = Vec<u64>> {
        proptest::collection::btree_set(0..max, 0..300).prop_map(|s| s.into_iter().collect())
    }

    #[test]
    fn golden_leb128_gaps() {
        // p = 3, 4, 200: gaps 3, 0, 195 (195 = 0xC3 -> c3 01).
        assert_eq!(
            encode(IndexCodec::Leb128Gaps, &[3, 4, 200], 1000, 1, &[]),
            [3, 0, 0xc3, 0x01]
        );
    }

    #[test]
    fn golden_rice_gaps() {
        // Two gaps of 0 in a block: k = 0, each gap is a single 0 bit.
        // Bits (LSB first): k=0 in 6 bits, then 0, 0 -> one byte, 0x00.
        assert_eq!(encode(IndexCodec::RiceGaps, &[0, 1], 10, 1, &[]), [0x00]);
        // One gap of 5 with k = 2: '1' then '0' (q = 1), then 01 (low bits of 5).
        // 6 bits of k (010000 LSB-first) + 1 + 0 + 1 + 0 => bits 0..10.
        let enc = encode(IndexCodec::RiceGaps, &[5], 10, 1, &[]);
        let mut r = BitReader::new(&enc);
        let k = r.read(6).expect("k") as u32;
        let q = r.read_unary(64).expect("q");
        let low = r.read(k).expect("low");
        assert_eq!((q << k) + low, 5);
    }

    #[test]
    fn every_codec_handles_empty_and_full_ranges() {
        for codec in IndexCodec::ALL {
            round_trip(codec, &[], 0);
            round_trip(codec, &[], 100);
            round_trip(codec, &[0], 1);
            let all: Vec<u64> = (0..5000).collect();
            round_trip(codec, &all, 5000);
        }
    }

    #[test]
    fn gap_codecs_handle_positions_beyond_2_pow_32() {
        // A range of 2^40 elements is never materialized: only the positions are.
        let range = 1u64 << 40;
        let positions = [
            0,
            (1 << 31) - 1,
            1 << 31,
            (1 << 31) + 1,
            (1 << 32) + 7,
            (1 << 39) + 12345,
            range - 1,
        ];
        for codec in [
            IndexCodec::Leb128Gaps,
            IndexCodec::Leb128GapsZstd,
            IndexCodec::RiceGaps,
        ] {
            round_trip(codec, &positions, range);
        }
        // A full 64-bit range also works (the escape path carries 64-bit gaps).
        let positions = [u64::MAX - 2, u64::MAX - 1];
        round_trip(IndexCodec::RiceGaps, &positions, u64::MAX);
        round_trip(IndexCodec::Leb128Gaps, &positions, u64::MAX);
    }

    #[test]
    fn decoders_refuse_out_of_range_and_wrong_counts() {
        for codec in IndexCodec::ALL {
            let base = test_base(10);
            let enc = encode(codec, &[1, 5, 9], 10, 1, &base);
            // Fewer elements in the range than the positions need.
            if codec != IndexCodec::BitmapZstd {
                let b = codec.needs_base().then_some(&base[..9]);
                assert!(decode(codec, &enc, 3, 9, b).is_err(), "{}", codec.name());
            }
            // A count that does not match the payload.
            assert!(
                decode(codec, &enc, 4, 10, Some(&base)).is_err(),
                "{}",
                codec.name()
            );
            // A smaller count either fails or (when the rest hides in a partial byte of a
            // bit-packed payload) yields exactly the prefix; it never invents positions.
            if let Ok(p) = decode(codec, &enc, 2, 10, Some(&base)) {
                assert_eq!(p, [1, 5], "{}", codec.name());
            }
        }
    }

    /// Weight-like base values: exponents 110..=127, either sign, any mantissa.
    fn weight_like_base(seed: u64, len: usize) -> Vec<u16> {
        (0..len as u64)
            .map(|i| {
                let h = (i ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
                let e = 110 + (h % 18) as u16;
                ((h >> 8) as u16 & 0x8000) | (e << 7) | ((h >> 16) as u16 & 0x7F)
            })
            .collect()
    }

    #[test]
    fn golden_exp_class_gaps() {
        // Four elements of class 27 (1.0) and one of class 0 (0.0); changes at 1 and 3.
        let base = [0x3F80, 0x3F80, 0x0000, 0x3F80, 0x3F80];
        let enc = encode(IndexCodec::ExpClassGapsRc, &[1, 3], 5, 1, &base);
        assert_eq!(enc, GOLDEN_EXP_CLASS_GAPS);
        round_trip_with(IndexCodec::ExpClassGapsRc, &[1, 3], &base);
    }

    /// Pinned: any change to these bytes is a format change (see docs/format.md).
    const GOLDEN_EXP_CLASS_GAPS: [u8; 6] = [0x80, 0x1f, 0x9e, 0x84, 0xd7, 0xd9];

    #[test]
    fn golden_exp_class_gaps_rans() {
        // The same part: class 27 has gaps 1 (first), 1, 0; class 0 has no change.
        let base = [0x3F80, 0x3F80, 0x0000, 0x3F80, 0x3F80];
        let enc = encode(IndexCodec::ExpClassGapsRans, &[1, 3], 5, 1, &base);
        assert_eq!(enc, GOLDEN_EXP_CLASS_GAPS_RANS, "{enc:02x?}");
        round_trip_with(IndexCodec::ExpClassGapsRans, &[1, 3], &base);
    }

    /// Pinned: any change to these bytes is a format change (see docs/format.md).
    const GOLDEN_EXP_CLASS_GAPS_RANS: [u8; 13] = [0, 0, 0, 8, 0, 85, 0, 0, 2, 177, 237, 6, 0];

    const CLASS_CODECS: [IndexCodec; 2] =
        [IndexCodec::ExpClassGapsRc, IndexCodec::ExpClassGapsRans];

    #[test]
    fn exp_class_gaps_edge_cases() {
        for c in CLASS_CODECS {
            exp_class_gaps_edge_cases_with(c);
        }
    }

    /// The table-driven decoder reads a class's gaps through the packed slot map from
    /// `PACKED_MIN_GAPS` (256) gaps and through the byte map below (a class with `n` changes
    /// has `n + 1` gaps): parts with classes on both sides of that line, and right at it,
    /// decode in one stream.
    #[test]
    fn exp_class_gaps_rans_mixes_both_slot_maps() {
        // 1.0 (class 27) for the first 3000 elements, 0.5 (class 26) for the next 1000.
        let base: Vec<u16> = (0..4000)
            .map(|i| if i < 3000 { 0x3F80 } else { 0x3F00 })
            .collect();
        // (changes in class 27, changes in class 26; class 26 decodes first): a byte-map class
        // then a packed one; a packed one then a byte-map one; both packed (one map refilled);
        // 256 gaps (packed) beside 255 (byte map); a class far over the line beside a tiny one.
        for (many, few) in [(700u64, 40u64), (40, 600), (600, 300), (255, 254), (256, 3)] {
            let positions: Vec<u64> = (0..many)
                .map(|i| i * 3000 / many)
                .chain((0..few).map(|i| 3000 + i * 1000 / few))
                .collect();
            round_trip_with(IndexCodec::ExpClassGapsRans, &positions, &base);
        }
    }

    fn exp_class_gaps_edge_cases_with(c: IndexCodec) {
        let base = weight_like_base(1, 4096);
        // None changed, all changed, one element, first and last only.
        round_trip_with(c, &[], &base);
        round_trip_with(c, &(0..4096).collect::<Vec<u64>>(), &base);
        round_trip_with(c, &[0], &base[..1]);
        round_trip_with(c, &[], &base[..1]);
        round_trip_with(c, &[0, 4095], &base);
        // Every element in one class.
        round_trip_with(c, &[3, 4, 1000], &vec![0x3F80; 2000]);
        // The wrong base length is an error, never a panic.
        let enc = encode(c, &[0, 4095], 4096, 1, &base);
        assert!(decode(c, &enc, 2, 4096, Some(&base[..4095])).is_err());
        assert!(decode(c, &enc, 2, 4096, None).is_err());
    }

    #[test]
    fn exp_class_gaps_beat_rice_when_changes_follow_the_exponent() {
        // Small weights change often, large ones rarely: what a real RL step looks like.
        let base = weight_like_base(7, 200_000);
        let positions: Vec<u64> = base
            .iter()
            .enumerate()
            .filter(|&(i, &b)| {
                let e = (b >> 7) & 0xFF;
                let h = (i as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93) >> 40;
                h.is_multiple_of(1 << (e - 108))
            })
            .map(|(i, _)| i as u64)
            .collect();
        let rice = encode(IndexCodec::RiceGaps, &positions, 200_000, 1, &base).len();
        for c in CLASS_CODECS {
            let ctx = encode(c, &positions, 200_000, 1, &base).len();
            assert!(ctx * 10 < rice * 9, "{}: {ctx} vs rice {rice}", c.name());
            round_trip_with(c, &positions, &base);
        }
    }

    #[test]
    fn exp_class_gaps_refuse_truncated_and_flipped_payloads() {
        for c in CLASS_CODECS {
            refuse_truncated_and_flipped_payloads_with(c);
        }
    }

    #[test]
    fn rice_gaps_refuse_truncated_and_flipped_payloads() {
        // Two blocks (a parameter each), short gaps, and one escape (a gap of about 200 under a
        // parameter chosen for gaps of about 2): every cut is refused,
        // and a flipped bit either is refused or yields increasing positions in range.
        let mut positions: Vec<u64> = (0..2800u64)
            .filter(|i| (i.wrapping_mul(2_654_435_761) >> 7) % 5 < 2)
            .collect();
        assert!(positions.len() > RICE_BLOCK);
        positions.push(2999);
        refuse_damage(IndexCodec::RiceGaps, &positions, &[]);
    }

    fn refuse_truncated_and_flipped_payloads_with(c: IndexCodec) {
        let base = weight_like_base(3, 3000);
        let positions: Vec<u64> = (0..3000u64)
            .filter(|i| i.is_multiple_of(37) || i.is_multiple_of(41))
            .collect();
        refuse_damage(c, &positions, &base);
        // Three classes of about 1000 elements and every third element changed: each class
        // has over 256 gaps, so the table-driven codec decodes them through its packed map.
        let few_classes: Vec<u16> = base
            .iter()
            .map(|&b| (b & 0x807F) | (120 + (b >> 7) % 3) << 7)
            .collect();
        let dense: Vec<u64> = (0..3000u64).filter(|i| i.is_multiple_of(3)).collect();
        refuse_damage(c, &dense, &few_classes);
    }

    fn refuse_damage(c: IndexCodec, positions: &[u64], base: &[u16]) {
        let enc = encode(c, positions, 3000, 1, base);
        let n = positions.len() as u64;
        for cut in 0..enc.len() {
            assert!(
                decode(c, &enc[..cut], n, 3000, Some(base)).is_err(),
                "{}: cut at {cut}",
                c.name()
            );
        }
        let mut padded = enc.clone();
        padded.extend_from_slice(&[0, 0]);
        assert!(decode(c, &padded, n, 3000, Some(base)).is_err());
        for i in 0..enc.len() * 8 {
            let mut b = enc.clone();
            b[i / 8] ^= 1 << (i % 8);
            if let Ok(p) = decode(c, &b, n, 3000, Some(base)) {
                assert_eq!(p.len() as u64, n);
                assert!(p.windows(2).all(|w| w[0] < w[1]) && p.iter().all(|&x| x < 3000));
            }
        }
    }

    fn round_trip_with(codec: IndexCodec, positions: &[u64], base: &[u16]) {
        let range_len = base.len() as u64;
        let enc = encode(codec, positions, range_len, 1, base);
        let dec =
            decode(codec, &enc, positions.len() as u64, range_len, Some(base)).expect("decodes");
        assert_eq!(dec, positions, "{}", codec.name());
        same_as_u32(codec, &enc, positions, range_len, base);
    }

    /// The Rice encoder as first written: every gap collected, each candidate parameter
    /// costed in its own pass, the quotient and the low bits written separately. The fused
    /// encoder must write the same bytes. Written out in full (its cost and escape too, not
    /// the encoder's helpers), so that it checks them.
    fn rice_gaps_reference(positions: &[u64]) -> Vec<u8> {
        let xs: Vec<u64> = gaps(positions).collect();
        let mut w = BitWriter::with_capacity(positions.len() + 16);
        for block in xs.chunks(RICE_BLOCK) {
            let mean = block.iter().map(|&x| x as f64).sum::<f64>() / block.len() as f64;
            let guess = if mean < 1.0 {
                0
            } else {
                (mean * std::f64::consts::LN_2).log2().floor().max(0.0) as i64
            };
            let (lo, hi) = (guess.clamp(0, 58) as u32, (guess + 1).min(58) as u32);
            let cost = |k: u32| {
                block
                    .iter()
                    .map(|&x| {
                        if x >> k < RICE_ESCAPE {
                            (x >> k) + 1 + u64::from(k)
                        } else {
                            RICE_ESCAPE + 7 + u64::from(64 - x.leading_zeros())
                        }
                    })
                    .sum::<u64>()
            };
            let k = (lo..=hi).min_by_key(|&k| cost(k)).unwrap_or(0);
            w.write(u64::from(k), 6);
            for &x in block {
                let q = x >> k;
                if q < RICE_ESCAPE {
                    w.write_unary(q);
                    w.write_wide(x, k);
                } else {
                    w.write((1u64 << RICE_ESCAPE) - 1, RICE_ESCAPE as u32);
                    let width = 64 - x.leading_zeros();
                    w.write(u64::from(width), 7);
                    w.write_wide(x, width);
                }
            }
        }
        w.finish()
    }

    proptest! {
        #[test]
        fn rice_gaps_write_what_the_reference_writes(
            gaps in proptest::collection::vec(
                prop_oneof![0u64..4, 0u64..64, 0u64..5000, 0u64..(1 << 40), 0u64..(1 << 62)],
                0..3000,
            ),
        ) {
            // Positions from gaps of every scale: small (k = 0), geometric-like, quotients
            // that overflow one write, escapes.
            let mut positions = Vec::with_capacity(gaps.len());
            let mut next = 0u64;
            for g in gaps {
                let Some(p) = next.checked_add(g).filter(|&p| p < u64::MAX - 1) else { break };
                positions.push(p);
                next = p + 1;
            }
            let got = rice_gaps(&positions);
            prop_assert_eq!(&got, &rice_gaps_reference(&positions));
            let back = decode(IndexCodec::RiceGaps, &got, positions.len() as u64, u64::MAX, None);
            prop_assert_eq!(back.ok(), Some(positions));
        }
    }

    proptest! {
        #[test]
        fn exp_class_gaps_round_trip_any_mask_and_base(
            bits in proptest::collection::vec((any::<u16>(), 0u8..=255), 0..3000),
            density in 0u8..=255,
            weights in any::<bool>(),
        ) {
            // A mask of any density (0 = none, 255 = all) over any or weight-like bases.
            let base: Vec<u16> = if weights {
                weight_like_base(bits.len() as u64, bits.len())
            } else {
                bits.iter().map(|b| b.0).collect()
            };
            let positions: Vec<u64> = bits
                .iter()
                .enumerate()
                .filter(|(_, b)| density == 255 || b.1 < density)
                .map(|(i, _)| i as u64)
                .collect();
            for c in CLASS_CODECS {
                round_trip_with(c, &positions, &base);
            }
        }

        #[test]
        fn every_index_codec_round_trips(positions in sorted_positions(20_000)) {
            for codec in IndexCodec::ALL {
                round_trip(codec, &positions, 20_000);
            }
        }

        #[test]
        fn gap_codecs_round_trip_huge_sparse_positions(
            positions in proptest::collection::btree_set(0..u64::MAX - 1, 0..200)
        ) {
            let positions: Vec<u64> = positions.into_iter().collect();
            for codec in [IndexCodec::Leb128Gaps, IndexCodec::Leb128GapsZstd, IndexCodec::RiceGaps] {
                round_trip(codec, &positions, u64::MAX);
            }
        }

        #[test]
        fn leb128_length_is_exact(positions in sorted_positions(1 << 40)) {
            prop_assert_eq!(leb128_gaps_len(&positions), encode(IndexCodec::Leb128Gaps, &positions, 1 << 40, 1, &[]).len());
        }

        #[test]
        fn decoders_never_panic_on_garbage(bytes in proptest::collection::vec(any::<u8>(), 0..64), count in 0u64..100, range in 0u64..1000) {
            let base = test_base(range);
            for codec in IndexCodec::ALL {
                if let Ok(p) = decode(codec, &bytes, count, range, Some(&base)) {
                    prop_assert_eq!(p.len() as u64, count);
                    prop_assert!(p.windows(2).all(|w| w[0] < w[1]));
                    prop_assert!(p.iter().all(|&x| x < range));
                }
            }
        }
    }
}

#[cfg(test)]
mod timing {
    use super::*;

    /// `cargo test --release -p starling-proto timing -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn exp_class_gaps_speed() {
        let n = 1 << 22;
        let mut next = super::super::synthetic::XorShift::default();
        let base = super::super::synthetic::weights(&mut next, n);
        let mut next = || next.next_u64();
        for off in [112u16, 114] {
            let positions: Vec<u64> = base
                .iter()
                .enumerate()
                .filter(|&(_, &b)| {
                    let e = (b >> 7) & 0xFF;
                    next().is_multiple_of(1 << (e.clamp(117, 123) - off) as u64)
                })
                .map(|(i, _)| i as u64)
                .collect();
            fn best<T>(mut f: impl FnMut() -> T) -> (T, std::time::Duration) {
                let mut r = None;
                let mut b = std::time::Duration::MAX;
                for _ in 0..7 {
                    let t = std::time::Instant::now();
                    let x = f();
                    b = b.min(t.elapsed());
                    r = Some(x);
                }
                (r.expect("ran"), b)
            }
            let (rice, tr) = best(|| encode(IndexCodec::RiceGaps, &positions, n as u64, 1, &base));
            for codec in [IndexCodec::ExpClassGapsRc, IndexCodec::ExpClassGapsRans] {
                let (enc, te) = best(|| encode(codec, &positions, n as u64, 1, &base));
                let (dec, td) = best(|| {
                    decode(codec, &enc, positions.len() as u64, n as u64, Some(&base)).expect("ok")
                });
                assert_eq!(dec, positions);
                let per_change =
                    |t: std::time::Duration| t.as_nanos() as f64 / positions.len() as f64;
                println!(
                    "{} density {:.2}%: {} B (rice {} B); encode {:.2} ns/elem, decode {:.2} ns/elem = {:.1} ns/change, rice encode {:.2} ns/elem",
                    codec.name(),
                    100.0 * positions.len() as f64 / n as f64,
                    enc.len(),
                    rice.len(),
                    te.as_nanos() as f64 / n as f64,
                    td.as_nanos() as f64 / n as f64,
                    per_change(td),
                    tr.as_nanos() as f64 / n as f64,
                );
            }
        }
    }
}

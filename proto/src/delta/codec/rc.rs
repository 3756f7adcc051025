//! An adaptive binary range coder, and the base-value contexts the context-modelled codecs
//! share.
//!
//! The coder is LZMA's carry-propagating range coder (32-bit range, renormalized a byte at a
//! time when the range drops below 2²⁴) with two changes: probabilities are 32-bit
//! (`P(bit = 0) · 2³²`), so that contexts where a change has a probability of 10⁻³ or less
//! are coded without the floor an 11-bit probability imposes; and each context adapts at a
//! rate of `1/(n + 2)` after `n` observations (a count-based estimate, close to the
//! Krichevsky–Trofimov one) until [`RATE_LIMIT`], and at a fixed rate after that. The first
//! byte of an LZMA stream (always zero) is not written.
//!
//! **Decoder invariants.** Reading past the end of the input yields zero bytes and is
//! counted; [`RangeDecoder::finish`] refuses a stream that needed such bytes or that left
//! bytes unread, so a truncated or padded payload is an error, never a silent misdecode of
//! a different length. Every decode step does a bounded amount of work and allocates
//! nothing; callers bound the number of steps by the part's element count.
//!
//! The exact arithmetic below is part of the format (`docs/format.md`): an encoder and a
//! decoder must agree on every rounding.

use crate::error::DecodeError;

/// After this many observations a context adapts at the fixed rate `1/(RATE_LIMIT + 2)`.
pub const RATE_LIMIT: u32 = 1022;
/// Probabilities are kept within `[P_MIN, 2³² − P_MIN]`, so that neither symbol's
/// sub-range can become empty (the range is at least 2²⁴ when a bit is coded).
const P_MIN: u32 = 1 << 16;
const P_HALF: u32 = 1 << 31;
const TOP: u32 = 1 << 24;
/// Direct (equiprobable) bits are coded this many at a time; the range stays at least
/// 2²⁴ ≫ 2¹⁶ before each chunk, so its sub-ranges are never empty.
pub const DIRECT_CHUNK: u32 = 16;

/// `65536 / (n + 2)` for every `n ≤ RATE_LIMIT`: the adaptation rate as a 16-bit fraction.
/// Padded to a power of two so that an index masked to 10 bits needs no bounds check.
const RECIP: [u32; 1024] = {
    let mut t = [0u32; 1024];
    let mut n = 0;
    while n <= RATE_LIMIT as usize {
        t[n] = 65536 / (n as u32 + 2);
        n += 1;
    }
    t
};

/// One adaptive binary context: the probability of a zero bit and how often it was used.
#[derive(Debug, Clone, Copy)]
pub struct Bit {
    p0: u32,
    n: u32,
}

impl Default for Bit {
    fn default() -> Self {
        Self { p0: P_HALF, n: 0 }
    }
}

impl Bit {
    #[inline(always)]
    fn update(&mut self, bit: bool) {
        // Branch-free: the coded bits are close to unpredictable for the CPU.
        let target = i64::from(!bit) * ((1i64 << 32) - 1);
        let p = i64::from(self.p0);
        // `n ≤ RATE_LIMIT < 1024`: the mask only drops the bounds check.
        let step = ((target - p) * i64::from(RECIP[self.n as usize & 1023])) >> 16;
        self.p0 = (p + step).clamp(i64::from(P_MIN), (1i64 << 32) - i64::from(P_MIN)) as u32;
        self.n += u32::from(self.n < RATE_LIMIT);
    }
}

/// Codes bits into bytes.
#[derive(Debug)]
pub struct RangeEncoder {
    low: u64,
    range: u32,
    cache: u8,
    cache_size: u64,
    out: Vec<u8>,
    /// The first byte LZMA's encoder emits is always zero; it is dropped.
    skip_first: bool,
}

impl RangeEncoder {
    pub fn with_capacity(bytes: usize) -> Self {
        Self {
            low: 0,
            range: u32::MAX,
            cache: 0,
            cache_size: 1,
            out: Vec::with_capacity(bytes),
            skip_first: true,
        }
    }

    #[inline(always)]
    fn shift_low(&mut self) {
        if (self.low as u32) < 0xFF00_0000 || (self.low >> 32) != 0 {
            self.flush_cache();
        }
        self.cache_size += 1;
        self.low = (self.low & 0x00FF_FFFF) << 8;
    }

    /// Emits the cached byte (plus the carry) and the run of `0xFF` bytes after it.
    #[inline]
    fn flush_cache(&mut self) {
        let carry = (self.low >> 32) as u8;
        if self.skip_first {
            self.skip_first = false;
        } else {
            self.out.push(self.cache.wrapping_add(carry));
        }
        for _ in 1..self.cache_size {
            self.out.push(0xFFu8.wrapping_add(carry));
        }
        self.cache_size = 0;
        self.cache = (self.low >> 24) as u8;
    }

    #[inline(always)]
    fn code(&mut self, p0: u32, bit: bool) {
        let bound = ((u64::from(self.range) * u64::from(p0)) >> 32) as u32;
        // Branch-free select between the two sub-ranges.
        let m = 0u32.wrapping_sub(u32::from(bit));
        self.low += u64::from(bound & m);
        self.range = (bound & !m) | ((self.range - bound) & m);
        while self.range < TOP {
            self.range <<= 8;
            self.shift_low();
        }
    }

    /// Codes `bit` with the adaptive context `ctx`, then adapts it.
    #[inline(always)]
    pub fn bit(&mut self, ctx: &mut Bit, bit: bool) {
        self.code(ctx.p0, bit);
        ctx.update(bit);
    }

    /// Codes the low `count ≤ 64` bits of `value` as uniform symbols of at most
    /// [`DIRECT_CHUNK`] bits, most significant chunk first: a chunk of `n` bits `v` narrows
    /// the range to `[v · (range >> n), (v + 1) · (range >> n))`.
    pub fn direct(&mut self, value: u64, count: u32) {
        let mut left = count;
        while left > 0 {
            let n = left.min(DIRECT_CHUNK);
            left -= n;
            let v = (value >> left) as u32 & ((1 << n) - 1);
            let bound = self.range >> n;
            self.low += u64::from(v) * u64::from(bound);
            self.range = bound;
            while self.range < TOP {
                self.range <<= 8;
                self.shift_low();
            }
        }
    }

    pub fn finish(mut self) -> Vec<u8> {
        for _ in 0..5 {
            self.shift_low();
        }
        self.out
    }
}

/// Decodes bits from bytes; see the module docs for its invariants.
#[derive(Debug)]
pub struct RangeDecoder<'a> {
    buf: &'a [u8],
    pos: usize,
    range: u32,
    code: u32,
}

impl<'a> RangeDecoder<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        let mut d = Self {
            buf,
            pos: 0,
            range: u32::MAX,
            code: 0,
        };
        for _ in 0..4 {
            d.code = (d.code << 8) | u32::from(d.byte_at(d.pos));
            d.pos += 1;
        }
        d
    }

    /// The input byte at `i`, or zero past the end (counted by `pos` running past it).
    #[inline(always)]
    fn byte_at(&self, i: usize) -> u8 {
        self.buf.get(i).copied().unwrap_or(0)
    }

    /// Whether the input ran out (reads past the end yield zeros until [`finish`](Self::finish)).
    #[inline]
    pub fn overran(&self) -> bool {
        self.pos > self.buf.len()
    }

    /// Brings the range back to at least 2²⁴. After a decision or a direct chunk it is at
    /// least 2⁸ (neither sub-range is below 2⁻¹⁶ of the range), so this takes at most two
    /// bytes; it takes them without a branch, which the CPU could not predict.
    #[inline(always)]
    fn normalize(&mut self) {
        let n = u32::from(self.range < TOP) + u32::from(self.range < 1 << 16);
        let two = match self.buf.get(self.pos..self.pos + 2) {
            Some(&[a, b]) => u32::from(u16::from_be_bytes([a, b])),
            _ => (u32::from(self.byte_at(self.pos)) << 8) | u32::from(self.byte_at(self.pos + 1)),
        };
        let shift = 8 * n;
        self.range = self.range.wrapping_shl(shift);
        // Shifting by 0, 8 or 16; the input bytes come in at the bottom.
        self.code = self.code.wrapping_shl(shift) | (two >> (16 - shift));
        self.pos += n as usize;
    }

    #[inline(always)]
    fn decode(&mut self, p0: u32) -> bool {
        let bound = ((u64::from(self.range) * u64::from(p0)) >> 32) as u32;
        let bit = self.code >= bound;
        let m = 0u32.wrapping_sub(u32::from(bit));
        self.code -= bound & m;
        self.range = (bound & !m) | ((self.range - bound) & m);
        self.normalize();
        bit
    }

    /// Decodes one bit with the adaptive context `ctx`, then adapts it.
    #[inline(always)]
    pub fn bit(&mut self, ctx: &mut Bit) -> bool {
        let b = self.decode(ctx.p0);
        ctx.update(b);
        b
    }

    /// Decodes `count ≤ 64` bits coded by [`RangeEncoder::direct`]. On a corrupt stream a
    /// chunk's value is clamped to its `n` bits (the result is then garbage that the
    /// callers' checks or [`finish`](Self::finish) refuse; nothing panics).
    pub fn direct(&mut self, count: u32) -> u64 {
        let mut v = 0u64;
        let mut left = count;
        while left > 0 {
            let n = left.min(DIRECT_CHUNK);
            left -= n;
            let bound = self.range >> n;
            let c = (self.code / bound).min((1 << n) - 1);
            self.code -= c * bound;
            self.range = bound;
            self.normalize();
            v = (v << n) | u64::from(c);
        }
        v
    }

    /// Checks that the stream was consumed exactly: no bytes missing, none left over.
    pub fn finish(self, what: &'static str) -> Result<(), DecodeError> {
        if self.overran() {
            return Err(DecodeError::Truncated { what });
        }
        if self.pos != self.buf.len() {
            return Err(DecodeError::TrailingBytes {
                what,
                trailing: self.buf.len() - self.pos,
            });
        }
        Ok(())
    }
}

/// Unary bit-length buckets of a class gap: `g + 1 < 2^(MAX_BUCKET + 1)`.
const MAX_BUCKET: usize = 40;

/// An adaptive model of a non-negative integer below 2⁴¹ − 1: the bit length of `g + 1` in
/// unary (one context per position), the two bits below its leading one with adaptive
/// contexts, the rest as direct bits (an adaptive Exp-Golomb code).
#[derive(Debug, Clone)]
pub struct IntModel {
    /// `bucket[i]`: is the bit length of `g + 1` above `i + 1`?
    bucket: [Bit; MAX_BUCKET],
    /// The bit below the leading one, per bucket.
    first: [Bit; MAX_BUCKET + 1],
    /// The next bit, per bucket and the bit above it.
    second: [[Bit; 2]; MAX_BUCKET + 1],
}

impl Default for IntModel {
    fn default() -> Self {
        Self {
            bucket: [Bit::default(); MAX_BUCKET],
            first: [Bit::default(); MAX_BUCKET + 1],
            second: [[Bit::default(); 2]; MAX_BUCKET + 1],
        }
    }
}

impl IntModel {
    pub fn encode(&mut self, e: &mut RangeEncoder, g: u64) {
        debug_assert!(g < (1 << (MAX_BUCKET + 1)) - 1);
        let v = g + 1;
        let k = (63 - v.leading_zeros()) as usize;
        for i in 0..MAX_BUCKET {
            let more = i < k;
            e.bit(&mut self.bucket[i], more);
            if !more {
                break;
            }
        }
        if k >= 1 {
            let b1 = (v >> (k - 1)) & 1 != 0;
            e.bit(&mut self.first[k], b1);
            if k >= 2 {
                e.bit(
                    &mut self.second[k][usize::from(b1)],
                    (v >> (k - 2)) & 1 != 0,
                );
                e.direct(v, k as u32 - 2);
            }
        }
    }

    pub fn decode(&mut self, d: &mut RangeDecoder<'_>) -> u64 {
        let mut k = 0;
        while k < MAX_BUCKET && d.bit(&mut self.bucket[k]) {
            k += 1;
        }
        let mut v = 1u64;
        if k >= 1 {
            let b1 = d.bit(&mut self.first[k]);
            v = (v << 1) | u64::from(b1);
            if k >= 2 {
                let b2 = d.bit(&mut self.second[k][usize::from(b1)]);
                v = (v << 1) | u64::from(b2);
                v = (v << (k - 2)) | d.direct(k as u32 - 2);
            }
        }
        v - 1
    }
}

/// The number of base-exponent classes.
pub const EXP_CLASSES: usize = 32;
/// The lowest BF16 exponent field with a class of its own; smaller ones (zeros, subnormals,
/// magnitudes below 2⁻²⁷) share class 0, and exponents from `EXP_LO + 31` up (magnitudes of
/// 16 and above, infinities and NaNs) share class 31.
pub const EXP_LO: u16 = 100;

/// `CLASS_OF[bits >> 7]`: the class of every (sign, exponent) pair.
static CLASS_OF: [u8; 512] = {
    let mut t = [0u8; 512];
    let mut i = 0;
    while i < 512 {
        let e = (i & 0xFF) as u16;
        let e = if e < EXP_LO {
            EXP_LO
        } else if e > EXP_LO + EXP_CLASSES as u16 - 1 {
            EXP_LO + EXP_CLASSES as u16 - 1
        } else {
            e
        };
        t[i] = (e - EXP_LO) as u8;
        i += 1;
    }
    t
};

/// The context class of a base value: its BF16 exponent field, clamped to
/// `[EXP_LO, EXP_LO + 31]`, minus `EXP_LO`. Whether a weight changes, and by how many ULPs,
/// depends mostly on its magnitude (an update survives rounding only if it is large against
/// the ULP, which the exponent sets); the sign does not enter.
#[inline]
pub fn exp_class(bits: u16) -> usize {
    // The mask is a no-op on the table's values; it lets the compiler drop bounds checks
    // on per-class arrays.
    usize::from(CLASS_OF[usize::from(bits >> 7)]) & (EXP_CLASSES - 1)
}
#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn round_trip(bits: &[(bool, u8)], direct: &[(u64, u32)]) {
        let mut ctx = vec![Bit::default(); 256];
        let mut e = RangeEncoder::with_capacity(16);
        for &(b, c) in bits {
            e.bit(&mut ctx[c as usize], b);
        }
        for &(v, n) in direct {
            e.direct(v, n);
        }
        let bytes = e.finish();
        let mut ctx = vec![Bit::default(); 256];
        let mut d = RangeDecoder::new(&bytes);
        for &(b, c) in bits {
            assert_eq!(d.bit(&mut ctx[c as usize]), b);
        }
        for &(v, n) in direct {
            let mask = if n == 64 { u64::MAX } else { (1 << n) - 1 };
            assert_eq!(d.direct(n), v & mask);
        }
        d.finish("test").expect("consumed exactly");
    }

    #[test]
    fn skewed_streams_cost_near_their_entropy() {
        // 100 000 bits with P(1) = 1/200: entropy ≈ 0.0454 bits each, ≈ 568 bytes.
        let bits: Vec<(bool, u8)> = (0..100_000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) % 200 == 0, 0))
            .collect();
        let mut ctx = Bit::default();
        let mut e = RangeEncoder::with_capacity(16);
        for &(b, _) in &bits {
            e.bit(&mut ctx, b);
        }
        let n = e.finish().len();
        assert!(n < 640, "{n} bytes");
        round_trip(&bits, &[]);
    }

    #[test]
    fn empty_stream_is_four_bytes() {
        let bytes = RangeEncoder::with_capacity(0).finish();
        assert_eq!(bytes.len(), 4);
        RangeDecoder::new(&bytes).finish("test").expect("empty");
        assert!(RangeDecoder::new(&bytes[..3]).finish("test").is_err());
    }

    #[test]
    fn exp_class_clamps() {
        assert_eq!(exp_class(0x0000), 0);
        assert_eq!(exp_class(0x8001), 0);
        assert_eq!(exp_class(0x3F80), 127 - 100); // 1.0
        assert_eq!(exp_class(0xBF80), 127 - 100); // -1.0
        assert_eq!(exp_class(0x7F80), 31); // +inf
        assert_eq!(exp_class(0x7FC0), 31); // NaN
    }

    proptest! {
        #[test]
        fn bits_and_direct_bits_round_trip(
            bits in proptest::collection::vec((any::<bool>(), 0u8..4), 0..2000),
            direct in proptest::collection::vec((any::<u64>(), 0u32..=64), 0..20),
        ) {
            round_trip(&bits, &direct);
        }
    }
}

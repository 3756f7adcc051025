//! A static-table rANS coder: the entropy coder of the table-driven codecs
//! ([`IndexCodec::ExpClassGapsRans`](super::IndexCodec::ExpClassGapsRans),
//! [`ValueCodec::UlpStepRans`](super::ValueCodec::UlpStepRans)).
//!
//! Why: the adaptive binary range coder of [`super::rc`] spends about six dependent
//! probability updates per change (≈ 70 ns per change for gap and step on the development
//! machine, `docs/design/fast-data-plane.md` §6). Here a symbol costs one table lookup, one
//! multiply and at most one 16-bit read; the tables are fixed per part, built on both sides
//! from a few parameter bytes the payload carries.
//!
//! **The coder** (exact arithmetic, part of the format, `docs/format.md`): the state `x` is a
//! `u32` kept in `[2¹⁶, 2³²)`; frequencies sum to `M = 2^TABLE_LOG`. Coding a symbol with
//! frequency `f` and cumulative start `s` first emits the low 16 bits of `x` (shifting them out)
//! if `x ≥ f · 2²⁰`, then sets `x = ⌊x / f⌋ · M + x mod f + s`. `n ≤ 16` raw bits `v` are a
//! symbol of frequency 1 out of `2ⁿ`: emit if `x ≥ 2³²⁻ⁿ`, then `x = x · 2ⁿ + v`. The encoder
//! starts from `x = 2¹⁶` and codes the symbols in reverse; the payload is its final state
//! (u32 LE) followed by the emitted 16-bit words (LE) in the order the decoder reads them.
//!
//! **Decoder invariants.** Every step does a bounded amount of work and allocates nothing.
//! Reads past the end yield zero words and are counted; [`RansDecoder::finish`] refuses a
//! stream that needed them, left words unread, or did not end in the encoder's initial state,
//! so a truncated, padded or altered payload is an error, never a silent misdecode of another
//! length. Only symbols with a non-zero frequency can ever be decoded.

use crate::error::DecodeError;

/// `log2` of the frequency total of every table.
pub const TABLE_LOG: u32 = 12;
/// The frequency total of every table.
pub const M: u32 = 1 << TABLE_LOG;
/// The lower bound of the state; also the encoder's initial state.
const L: u32 = 1 << 16;
/// The most symbols a [`PackedSlots`] map can hold.
pub const MAX_PACKED_SYMBOLS: usize = 128;
/// Where a [`PackedSlots`] entry keeps its symbol's number (above the start's
/// [`TABLE_LOG`] bits) and frequency (above the number's 7 bits). A frequency is at most `M`,
/// [`TABLE_LOG`] + 1 bits, so the three fit in 32.
const PACKED_SYMBOL_SHIFT: u32 = TABLE_LOG;
const PACKED_FREQ_SHIFT: u32 = PACKED_SYMBOL_SHIFT + MAX_PACKED_SYMBOLS.trailing_zeros();
const _: () = assert!(MAX_PACKED_SYMBOLS.is_power_of_two());
const _: () = assert!(PACKED_FREQ_SHIFT + TABLE_LOG < 32);

/// A decoding slot map of symbol numbers ([`Table::fill_slots`]).
pub type ByteSlots = [u8; M as usize];
/// A decoding slot map of symbol numbers, starts and frequencies
/// ([`Table::fill_packed_slots`]).
pub type PackedSlots = [u32; M as usize];

/// Turns non-negative weights into frequencies that sum to exactly [`M`], every symbol at
/// least 1 (so any symbol can be coded whatever the parameters said). Integer-only, so both
/// sides compute the same table on every platform: `fᵢ = 1 + ⌊wᵢ · (M − n) / Σw⌋`, and what
/// the floors leave goes to the first symbol of largest frequency. All-zero weights give the
/// uniform-as-possible table.
///
/// # Panics
/// If there are no symbols or more than [`M`] of them (a caller error: alphabets are fixed
/// and small).
pub fn normalize(weights: &[u64], freq: &mut [u32]) {
    assert!(!weights.is_empty() && weights.len() <= M as usize && freq.len() == weights.len());
    let n = weights.len() as u128;
    let total: u128 = weights.iter().map(|&w| u128::from(w)).sum();
    let budget = u128::from(M) - n;
    let mut sum = 0u32;
    for (f, &w) in freq.iter_mut().zip(weights) {
        let share = (u128::from(w) * budget).checked_div(total).unwrap_or(0);
        *f = 1 + share as u32;
        sum += *f;
    }
    let mut top = 0;
    for (i, &f) in freq.iter().enumerate() {
        if f > freq[top] {
            top = i;
        }
    }
    freq[top] += M - sum;
}

/// `num / den` in 255ths, rounded (0 when `den` is 0): how the encoders quantize the
/// probabilities they fit into parameter bytes.
pub fn ratio255(num: u64, den: u64) -> u8 {
    (num * 255 + den / 2).checked_div(den).unwrap_or(0).min(255) as u8
}

/// One static table: each symbol's frequency and cumulative start, and the encoder's view of
/// each symbol; decoders build slot maps from it ([`Table::fill_slots`],
/// [`Table::fill_packed_slots`]).
#[derive(Debug, Clone)]
pub struct Table {
    freq: Vec<u32>,
    start: Vec<u32>,
    enc: Vec<EncSymbol>,
}

/// What the encoder needs of a symbol, with the division by its frequency done as a
/// multiplication: for `f ≥ 2`, `⌊x / f⌋ = ⌊x · ⌈2⁶⁴ / f⌉ / 2⁶⁴⌋` exactly for every `x < 2³²`
/// (the error of the reciprocal is below `x / 2⁶⁴ < 2⁻³²`, smaller than the distance `1/f`
/// from `x / f` to the next integer); for `f = 1` the quotient is `x`.
#[derive(Debug, Clone, Copy, Default)]
pub struct EncSymbol {
    /// `⌈2⁶⁴ / f⌉`, or 0 for `f = 1`.
    rcp: u64,
    /// The state at or above which a word is emitted first: `f · 2²⁰`.
    bound: u64,
    /// `M − f`.
    cmpl: u32,
    start: u32,
    one: u32,
}

impl Table {
    /// A table from frequencies that sum to [`M`] (as [`normalize`] makes them).
    pub fn new(freq: &[u32]) -> Self {
        debug_assert_eq!(freq.iter().sum::<u32>(), M);
        let mut start = Vec::with_capacity(freq.len());
        let mut enc = Vec::with_capacity(freq.len());
        let mut s = 0;
        for &f in freq {
            start.push(s);
            enc.push(EncSymbol {
                rcp: if f >= 2 {
                    ((1u128 << 64).div_ceil(u128::from(f))) as u64
                } else {
                    0
                },
                bound: u64::from(f) << (32 - TABLE_LOG),
                cmpl: M - f,
                start: s,
                one: u32::from(f == 1),
            });
            s += f;
        }
        Self {
            freq: freq.to_vec(),
            start,
            enc,
        }
    }

    /// From weights, through [`normalize`].
    pub fn from_weights(weights: &[u64]) -> Self {
        let mut freq = vec![0u32; weights.len()];
        normalize(weights, &mut freq);
        Self::new(&freq)
    }

    pub fn len(&self) -> usize {
        self.freq.len()
    }

    pub fn is_empty(&self) -> bool {
        self.freq.is_empty()
    }

    /// Frequency and start of symbol `s`.
    #[inline(always)]
    pub fn symbol(&self, s: usize) -> (u32, u32) {
        (self.freq[s], self.start[s])
    }

    /// The slot-to-symbol map for decoding, written into `slots` (`M` bytes).
    ///
    /// # Panics
    /// With more than 256 symbols (a caller error: alphabets are fixed and small).
    pub fn fill_slots(&self, slots: &mut ByteSlots) {
        assert!(self.len() <= 256);
        for (s, (&f, &st)) in self.freq.iter().zip(&self.start).enumerate() {
            slots[st as usize..(st + f) as usize].fill(s as u8);
        }
    }

    /// The packed slot map for decoding: for every slot in `[0, M)`, its symbol's start
    /// (bits 0–11), number (bits 12–18) and frequency (bits 19–31, up to `M`). A symbol
    /// decoded through it costs one load on the state's dependency chain instead of two (the
    /// symbol, then its frequency and start): about 1 ns per gap on the development machine
    /// (staging at 5% density took 0.96× the time). Filling its 16 KB costs about 140 ns more
    /// than the byte map's 4 KB, so it pays from a few hundred symbols.
    ///
    /// # Panics
    /// With more than [`MAX_PACKED_SYMBOLS`] symbols (a caller error: alphabets are fixed and
    /// small).
    pub fn fill_packed_slots(&self, slots: &mut PackedSlots) {
        assert!(self.len() <= MAX_PACKED_SYMBOLS);
        for (s, (&f, &st)) in self.freq.iter().zip(&self.start).enumerate() {
            let entry = st | (s as u32) << PACKED_SYMBOL_SHIFT | f << PACKED_FREQ_SHIFT;
            slots[st as usize..(st + f) as usize].fill(entry);
        }
    }

    /// The encoder's view of symbol `s` (to keep in flat arrays; see
    /// [`RansEncoder::put_enc`]).
    #[inline(always)]
    pub fn enc_symbol(&self, s: usize) -> EncSymbol {
        self.enc[s]
    }
}

/// Codes symbols into 16-bit words, in reverse: call the `put` methods for the last symbol
/// first.
#[derive(Debug)]
pub struct RansEncoder {
    x: u32,
    /// The emitted words are `words[..n]`; the rest is room to write into without a branch.
    words: Vec<u16>,
    n: usize,
}

impl RansEncoder {
    pub fn with_capacity(words: usize) -> Self {
        Self {
            x: L,
            words: vec![0; words.max(16)],
            n: 0,
        }
    }

    /// Emits the low word of the state if `emit`, without a branch on it (whether a symbol
    /// emits is close to a coin toss for the CPU).
    #[inline(always)]
    fn emit_if(&mut self, emit: bool) {
        if self.n + 1 >= self.words.len() {
            let len = self.words.len();
            self.words.resize(2 * len, 0);
        }
        self.words[self.n] = self.x as u16;
        let e = u32::from(emit);
        self.n += e as usize;
        self.x >>= 16 * e;
    }

    /// Codes a symbol of frequency `freq ≥ 1` starting at `start`, by the format's
    /// arithmetic with a division: the reference [`put_enc`](Self::put_enc) is tested against.
    #[cfg(test)]
    fn put(&mut self, freq: u32, start: u32) {
        debug_assert!(freq >= 1 && start + freq <= M);
        self.emit_if(u64::from(self.x) >= u64::from(freq) << (32 - TABLE_LOG));
        self.x = ((self.x / freq) << TABLE_LOG) + self.x % freq + start;
    }

    /// Codes symbol `s` of `table`: the state the format defines by a division by the
    /// frequency, computed without one.
    #[inline(always)]
    pub fn put_symbol(&mut self, table: &Table, s: usize) {
        self.put_enc(table.enc[s]);
    }

    /// Codes the symbol `e` describes (from [`Table::enc_symbol`]).
    #[inline(always)]
    pub fn put_enc(&mut self, e: EncSymbol) {
        self.emit_if(u64::from(self.x) >= e.bound);
        let x = u64::from(self.x);
        // ⌊x / f⌋; for f = 1 the reciprocal is 0 and the quotient is x itself.
        let q = ((u128::from(x) * u128::from(e.rcp)) >> 64) as u64 + x * u64::from(e.one);
        // x + start + q · (M − f) = q · M + (x − q · f) + start.
        self.x = (x + u64::from(e.start) + q * u64::from(e.cmpl)) as u32;
    }

    /// Codes the low `n ≤ 16` bits of `v` as raw bits.
    #[inline(always)]
    pub fn put_raw(&mut self, v: u32, n: u32) {
        debug_assert!(n <= 16);
        // n = 0 never emits and leaves the state as it is.
        self.emit_if(u64::from(self.x) >= 1u64 << (32 - n));
        self.x = (self.x << n) | (v & ((1 << n) - 1));
    }

    /// Codes the low `n ≤ 64` bits of `v` as raw bits, in chunks of at most 16 bits, most
    /// significant chunk first *in decoding order* (so this puts the least significant chunk
    /// first).
    pub fn put_bits(&mut self, v: u64, n: u32) {
        debug_assert!(n <= 64);
        // Chunk `i` holds bits `[16i, 16i + 16)`; the decoder reads the top chunk first, so
        // in reverse the lowest goes first.
        let mut done = 0;
        let mut left = n;
        while left > 0 {
            let take = 16.min(left);
            self.put_raw((v >> done) as u32 & ((1u32 << take) - 1), take);
            done += take;
            left -= take;
        }
    }

    /// The payload: the final state, then the words in decoding order.
    pub fn finish(self) -> Vec<u8> {
        let mut out = Vec::with_capacity(4 + 2 * self.n);
        out.extend_from_slice(&self.x.to_le_bytes());
        for w in self.words[..self.n].iter().rev() {
            out.extend_from_slice(&w.to_le_bytes());
        }
        out
    }
}

/// Decodes what a [`RansEncoder`] coded, in the encoder's reverse order; see the module docs
/// for its invariants.
#[derive(Debug)]
pub struct RansDecoder<'a> {
    x: u32,
    words: &'a [u8],
    pos: usize,
}

impl<'a> RansDecoder<'a> {
    pub fn new(bytes: &'a [u8], what: &'static str) -> Result<Self, DecodeError> {
        let Some((state, words)) = bytes.split_first_chunk::<4>() else {
            return Err(DecodeError::Truncated { what });
        };
        let x = u32::from_le_bytes(*state);
        if x < L {
            return Err(DecodeError::malformed(what, "rANS state below 2^16"));
        }
        if words.len() % 2 != 0 {
            return Err(DecodeError::malformed(what, "odd rANS word stream"));
        }
        Ok(Self { x, words, pos: 0 })
    }

    /// Brings the state back to at least 2¹⁶ with at most one word (a step leaves it at
    /// least 2⁴), without a branch: the CPU could not predict it.
    #[inline(always)]
    fn normalize(&mut self) {
        let n = u32::from(self.x < L);
        let w = match self.words.get(self.pos..self.pos + 2) {
            Some(&[a, b]) => u32::from(u16::from_le_bytes([a, b])),
            _ => 0,
        };
        let shift = 16 * n;
        self.x = (self.x << shift) | (w & (0u32.wrapping_sub(n) >> 16));
        self.pos += 2 * n as usize;
    }

    /// Decodes one symbol: `slots` maps a slot to its symbol, `table` gives the symbol's
    /// frequency and start.
    #[inline(always)]
    pub fn get(&mut self, slots: &ByteSlots, table: &Table) -> usize {
        let slot = self.x & (M - 1);
        let s = usize::from(slots[slot as usize]);
        let (f, st) = table.symbol(s);
        self.x = f * (self.x >> TABLE_LOG) + slot - st;
        self.normalize();
        s
    }

    /// Decodes one symbol of the table whose packed slot map
    /// ([`Table::fill_packed_slots`]) is `slots`.
    #[inline(always)]
    pub fn get_packed(&mut self, slots: &PackedSlots) -> usize {
        let slot = self.x & (M - 1);
        let e = slots[slot as usize];
        self.x = (e >> PACKED_FREQ_SHIFT) * (self.x >> TABLE_LOG) + slot - (e & (M - 1));
        self.normalize();
        (e >> PACKED_SYMBOL_SHIFT) as usize & (MAX_PACKED_SYMBOLS - 1)
    }

    /// Decodes one symbol of a three-symbol table given by its first two frequencies
    /// (`f0 + f1 < M`), without a slot map.
    #[inline(always)]
    pub fn get3(&mut self, f0: u32, f1: u32) -> u32 {
        let slot = self.x & (M - 1);
        let (ge0, ge1) = (u32::from(slot >= f0), u32::from(slot >= f0 + f1));
        // Start (0, f0, f0 + f1) and frequency (f0, f1, the rest) by masks: an indexed
        // array would put a store-to-load round trip on the state's dependency chain.
        let (m0, m1) = (0u32.wrapping_sub(ge0), 0u32.wrapping_sub(ge1));
        let start = (f0 & m0) + (f1 & m1);
        let f = (f0 & !m0) | (f1 & m0 & !m1) | ((M - f0 - f1) & m1);
        let s = ge0 + ge1;
        self.x = f * (self.x >> TABLE_LOG) + slot - start;
        self.normalize();
        s
    }

    /// Decodes `n ≤ 16` raw bits.
    #[inline(always)]
    pub fn get_raw(&mut self, n: u32) -> u32 {
        debug_assert!(n <= 16);
        let v = self.x & ((1u32 << n) - 1);
        self.x >>= n;
        self.normalize();
        v
    }

    /// Decodes `n ≤ 64` raw bits coded by [`RansEncoder::put_bits`].
    pub fn get_bits(&mut self, n: u32) -> u64 {
        // The encoder put 16-bit chunks from the least significant up, the top chunk holding
        // the rest; decoding reads them in reverse: the top chunk (`n mod 16` bits, or 16)
        // first.
        let n = n.min(64);
        let mut left = n;
        let mut v = 0u64;
        while left > 0 {
            let take = if left.is_multiple_of(16) {
                16
            } else {
                left % 16
            };
            v = (v << take) | u64::from(self.get_raw(take));
            left -= take;
        }
        v
    }

    /// Whether the input ran out (reads past the end yield zeros until [`finish`](Self::finish)).
    #[inline]
    pub fn overran(&self) -> bool {
        self.pos > self.words.len()
    }

    /// Checks that the stream was consumed exactly and ended where the encoder started.
    pub fn finish(self, what: &'static str) -> Result<(), DecodeError> {
        if self.overran() {
            return Err(DecodeError::Truncated { what });
        }
        if self.pos != self.words.len() {
            return Err(DecodeError::TrailingBytes {
                what,
                trailing: self.words.len() - self.pos,
            });
        }
        if self.x != L {
            return Err(DecodeError::malformed(
                what,
                "rANS stream ends in the wrong state",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Sym(usize),
        Three(u32),
        Raw(u32, u32),
        Bits(u64, u32),
    }

    fn round_trip(weights: &[u64], f0: u32, f1: u32, ops: &[Op]) -> Vec<u8> {
        let t = Table::from_weights(weights);
        let mut slots = Box::new([0u8; M as usize]);
        t.fill_slots(&mut slots);
        let mut packed = Box::new([0u32; M as usize]);
        t.fill_packed_slots(&mut packed);
        let three = Table::new(&[f0, f1, M - f0 - f1]);
        let mut e = RansEncoder::with_capacity(16);
        for op in ops.iter().rev() {
            match *op {
                Op::Sym(s) => e.put_symbol(&t, s % t.len()),
                Op::Three(s) => e.put_symbol(&three, s as usize),
                Op::Raw(v, n) => e.put_raw(v, n),
                Op::Bits(v, n) => e.put_bits(v, n),
            }
        }
        let bytes = e.finish();
        let mut d = RansDecoder::new(&bytes, "test").expect("header");
        for op in ops {
            match *op {
                Op::Sym(s) => {
                    // Each symbol through one of the two maps, as the decoders mix them.
                    let got = if s % 2 == 0 {
                        d.get(&slots, &t)
                    } else {
                        d.get_packed(&packed)
                    };
                    assert_eq!(got, s % t.len())
                }
                Op::Three(s) => assert_eq!(d.get3(f0, f1), s),
                Op::Raw(v, n) => assert_eq!(d.get_raw(n), v & ((1 << n) - 1)),
                Op::Bits(v, n) => {
                    let mask = if n == 64 { u64::MAX } else { (1 << n) - 1 };
                    assert_eq!(d.get_bits(n), v & mask)
                }
            }
        }
        d.finish("test").expect("consumed exactly");
        bytes
    }

    #[test]
    fn normalize_sums_to_m_and_keeps_every_symbol() {
        let mut f = [0u32; 5];
        normalize(&[0, 0, 1 << 40, 3, 0], &mut f);
        assert_eq!(f.iter().sum::<u32>(), M);
        assert!(f.iter().all(|&x| x >= 1));
        assert_eq!(f[2], M - 4);
        normalize(&[0; 5], &mut f);
        assert_eq!(f.iter().sum::<u32>(), M);
        normalize(&[u64::MAX; 5], &mut f);
        assert_eq!(f.iter().sum::<u32>(), M);
    }

    #[test]
    fn the_reciprocal_divides_exactly() {
        // Every frequency, states at the edges and in between: put_symbol == put.
        let mut freq = vec![1u32; 64];
        freq[0] = M - 63;
        for f in [1u32, 2, 3, 7, 255, 1000, 2047, 4095] {
            let mut fr = vec![f, M - f];
            if f == M - f {
                fr = vec![f, f];
            }
            let t = Table::new(&fr);
            for x in [
                L,
                L + 1,
                1 << 20,
                (f << 20).wrapping_sub(1),
                u32::MAX,
                0x9E37_79B9,
            ] {
                let mut a = RansEncoder::with_capacity(0);
                let mut b = RansEncoder::with_capacity(0);
                (a.x, b.x) = (x, x);
                a.put_symbol(&t, 0);
                b.put(f, 0);
                assert_eq!((a.x, a.finish()), (b.x, b.finish()), "f {f} x {x}");
            }
        }
        let t = Table::new(&freq);
        for x in (0..1000u32).map(|i| L + i.wrapping_mul(4_294_967)) {
            let mut a = RansEncoder::with_capacity(0);
            let mut b = RansEncoder::with_capacity(0);
            (a.x, b.x) = (x, x);
            a.put_symbol(&t, 5);
            b.put(1, t.symbol(5).1);
            assert_eq!(a.x, b.x);
        }
    }

    #[test]
    fn empty_stream_is_the_initial_state() {
        let bytes = RansEncoder::with_capacity(0).finish();
        assert_eq!(bytes, L.to_le_bytes());
        RansDecoder::new(&bytes, "t")
            .expect("ok")
            .finish("t")
            .expect("empty");
        assert!(RansDecoder::new(&bytes[..3], "t").is_err());
        let mut padded = bytes.clone();
        padded.extend_from_slice(&[0, 0]);
        assert!(
            RansDecoder::new(&padded, "t")
                .expect("ok")
                .finish("t")
                .is_err()
        );
    }

    #[test]
    fn skewed_symbols_cost_near_their_entropy() {
        // P(0) = 0.99 over 100 000 symbols: entropy ≈ 0.0808 bits each ≈ 1010 bytes; the
        // 12-bit table rounds 0.01 to 41/4096.
        let ops: Vec<Op> = (0..100_000u32)
            .map(|i| Op::Sym(usize::from(i.wrapping_mul(2_654_435_761) % 100 == 0)))
            .collect();
        let n = round_trip(&[99, 1], 1, 1, &ops).len();
        assert!(n < 1100, "{n} bytes");
    }

    /// The packed map decodes every slot exactly as the byte map and the table do, for tables
    /// of 1 to 128 symbols (a single symbol has frequency `M`; the last one may start at
    /// `M − 1`), from low and high states.
    #[test]
    fn packed_slots_decode_as_the_byte_map() {
        let mut byte = Box::new([0u8; M as usize]);
        let mut packed = Box::new([0u32; M as usize]);
        let mut tables = vec![Table::new(&[M]), Table::new(&[M - 1, 1])];
        for n in [2usize, 3, 33, 127, 128] {
            let weights: Vec<u64> = (0..n as u64).map(|i| (i * 7919) % 1000).collect();
            tables.push(Table::from_weights(&weights));
        }
        for t in &tables {
            t.fill_slots(&mut byte);
            t.fill_packed_slots(&mut packed);
            for slot in 0..M {
                // States from the lowest a decoder holds (2¹⁶) to near the top.
                for high in [L >> TABLE_LOG, 0xFFF, 0xF_FFFF] {
                    let x = high << TABLE_LOG | slot;
                    let mut payload = x.to_le_bytes().to_vec();
                    payload.extend_from_slice(&[0x34, 0x12]);
                    let mut a = RansDecoder::new(&payload, "t").expect("state");
                    let mut b = RansDecoder::new(&payload, "t").expect("state");
                    assert_eq!(
                        a.get(&byte, t),
                        b.get_packed(&packed),
                        "{} symbols",
                        t.len()
                    );
                    assert_eq!((a.x, a.pos), (b.x, b.pos));
                }
            }
        }
    }

    proptest! {
        #[test]
        fn symbols_and_raw_bits_round_trip(
            weights in proptest::collection::vec(0u64..1000, 1..40),
            f0 in 1u32..2000, f1 in 1u32..2000,
            ops in proptest::collection::vec(prop_oneof![
                (0usize..64).prop_map(Op::Sym),
                (0u32..3).prop_map(Op::Three),
                (any::<u32>(), 0u32..=16).prop_map(|(v, n)| Op::Raw(v, n)),
                (any::<u64>(), 0u32..=64).prop_map(|(v, n)| Op::Bits(v, n)),
            ], 0..500),
        ) {
            round_trip(&weights, f0, f1, &ops);
        }

        #[test]
        fn any_bytes_decode_without_panicking(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let t = Table::from_weights(&[5, 1, 1, 0]);
            let mut slots = Box::new([0u8; M as usize]);
            t.fill_slots(&mut slots);
            let mut packed = Box::new([0u32; M as usize]);
            t.fill_packed_slots(&mut packed);
            if let Ok(mut d) = RansDecoder::new(&bytes, "t") {
                for _ in 0..40 {
                    d.get(&slots, &t);
                    d.get_packed(&packed);
                    d.get3(100, 200);
                    d.get_bits(37);
                }
                let _ = d.finish("t");
            }
        }
    }
}

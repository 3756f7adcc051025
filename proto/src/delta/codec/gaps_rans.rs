//! [`IndexCodec::ExpClassGapsRans`](super::IndexCodec::ExpClassGapsRans): the exponent-class
//! gaps of [`ExpClassGapsRc`](super::IndexCodec::ExpClassGapsRc) (same classes, same gaps,
//! same order), coded with static per-part tables through [`super::rans`] instead of adaptive
//! contexts.
//!
//! Why: the adaptive model costs about four dependent context updates per change; here a gap
//! is one table lookup plus its raw low bits. The tables come from four parameter bytes per
//! class present in the part, fitted by the encoder to that part's gaps: a Rice parameter `k`,
//! the probability of a zero quotient, the ratio of a geometric tail for the other quotients,
//! and the probability of the remainder's top bit. Parts are 2²² elements by default, so the
//! parameters cost well under 1% of a part's positions even at 0.3% density.
//!
//! The decoder still scans the base (`scan::countdown`) to count each class down; only the
//! per-change work changes. Exact layout: `docs/format.md`.

use super::rans::{EncSymbol, M, RansDecoder, RansEncoder, Table, ratio255};
use super::rc::EXP_CLASSES;
use super::scan;
use crate::error::DecodeError;
use crate::wire::{Reader, put_varint};

const WHAT: &str = "exp-class gaps (rANS)";
/// Quotients `g >> k` below this are coded as symbols; the rest take the escape.
const Q: u64 = 16;
/// Symbols: `2q + top` for `q < Q`, then the escape.
const SYMBOLS: usize = 2 * Q as usize + 1;
const ESCAPE: usize = SYMBOLS - 1;
/// The largest Rice parameter (gaps are below 2³²).
const MAX_K: u8 = 30;
/// Bits of the escape's length field: an escaped value `v = g − (Q << k) + 1` has at most 41.
const ESCAPE_LEN_BITS: u32 = 6;
const MAX_ESCAPE_LEN: u32 = 41;
/// Fixed-point one (2³²) of the table construction.
const ONE: u128 = 1 << 32;

/// One class's parameters, as carried in the payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Params {
    /// Rice parameter: `q = g >> k`, then `k` remainder bits.
    k: u8,
    /// `P(q = 0)`, in 255ths.
    r0: u8,
    /// Ratio of the geometric tail `P(q + 1) / P(q)` for `q ≥ 1`, in 255ths.
    a: u8,
    /// `P(top remainder bit = 1)`, in 255ths (ignored when `k = 0`).
    t: u8,
}

impl Params {
    /// The class's table: `P(q, top) = P(q) · P(top)`, with `P(0) = r0`,
    /// `P(q ≥ 1) = (1 − r0)(1 − a)aᵠ⁻¹`, the escape `(1 − r0)a^(Q−1)`, in 2³² fixed point;
    /// every symbol at least one slot ([`super::rans::normalize`]).
    fn table(self) -> Table {
        let frac = |b: u8| u128::from(b) * ONE / 255;
        let (r0, a, t) = (frac(self.r0), frac(self.a), frac(self.t));
        let mut w = [0u64; SYMBOLS];
        let mut tail = ((ONE - r0) * (ONE - a)) >> 32;
        for q in 0..Q as usize {
            let pq = if q == 0 { r0 } else { tail };
            if q >= 1 {
                tail = (tail * a) >> 32;
            }
            let (p0, p1) = if self.k == 0 { (ONE, 0) } else { (ONE - t, t) };
            w[2 * q] = ((pq * p0) >> 32) as u64;
            w[2 * q + 1] = ((pq * p1) >> 32) as u64;
        }
        // `tail` is now (1 − r0)(1 − a)a^(Q−1); the escape is (1 − r0)a^(Q−1).
        let mut esc = ONE - r0;
        for _ in 1..Q {
            esc = (esc * a) >> 32;
        }
        w[ESCAPE] = esc as u64;
        Table::from_weights(&w)
    }

    /// The maximum-likelihood parameters for `gaps` (all of one class).
    #[cfg(test)]
    fn fit(gaps: &[u32]) -> Self {
        let mut f = ClassFit::default();
        gaps.iter().for_each(|&g| f.add_to_mean(g));
        f.choose_k();
        gaps.iter().for_each(|&g| f.add_to_shape(g));
        f.params()
    }
}

/// What the encoder fits a class's parameters from, in two passes over the class's gaps:
/// their mean sets `k` as in the adaptive codec (`⌊log2(mean · 45/64)⌋`, 45/64 ≈ ln 2);
/// then, with that `k`, the maximum-likelihood shape of the quotients and the top bit.
#[derive(Debug, Default, Clone, Copy)]
struct ClassFit {
    n: u64,
    sum: u64,
    k: u8,
    zero: u64,
    tail_n: u64,
    tail_sum: u64,
    top_n: u64,
    top_ones: u64,
}

impl ClassFit {
    #[inline(always)]
    fn add_to_mean(&mut self, g: u32) {
        self.n += 1;
        self.sum += u64::from(g);
    }

    fn choose_k(&mut self) {
        let t = self.sum * 45 / (64 * self.n.max(1));
        self.k = if t == 0 {
            0
        } else {
            (63 - t.leading_zeros()).min(u32::from(MAX_K)) as u8
        };
    }

    #[inline(always)]
    fn add_to_shape(&mut self, g: u32) {
        let k = u32::from(self.k);
        let q = u64::from(g >> k);
        let zero = u64::from(q == 0);
        self.zero += zero;
        self.tail_n += 1 - zero;
        self.tail_sum += q.min(Q).saturating_sub(1);
        if q < Q && k >= 1 {
            self.top_n += 1;
            self.top_ones += u64::from(g >> (k - 1) & 1);
        }
    }

    fn params(&self) -> Params {
        let ratio = ratio255;
        // A geometric tail with mean m = tail_sum / tail_n has a = m / (1 + m).
        Params {
            k: self.k,
            r0: ratio(self.zero, self.n),
            a: ratio(self.tail_sum, self.tail_sum + self.tail_n),
            t: ratio(self.top_ones, self.top_n),
        }
    }
}

/// Codes gap `g` with a class's symbols (`table`, [`SYMBOLS`] of them), in reverse (raw
/// bits first, the symbol last).
#[inline(always)]
fn put_gap(e: &mut RansEncoder, table: &[EncSymbol], k: u8, g: u32) {
    let (g, k) = (u64::from(g), u32::from(k));
    let q = g >> k;
    if q >= Q {
        let v = g - (Q << k) + 1;
        let len = 64 - v.leading_zeros();
        e.put_bits(v, len - 1);
        e.put_raw(len, ESCAPE_LEN_BITS);
        e.put_enc(table[ESCAPE]);
    } else if k >= 1 {
        if k <= 17 {
            e.put_raw(g as u32, k - 1);
        } else {
            e.put_bits(g, k - 1);
        }
        e.put_enc(table[2 * q as usize + (g >> (k - 1) & 1) as usize]);
    } else {
        e.put_enc(table[2 * q as usize]);
    }
}

/// Decodes one gap of a class with Rice parameter `k`, its symbols from `symbol`; `None` on
/// a stream no encoder writes.
#[inline(always)]
fn get_gap(
    d: &mut RansDecoder<'_>,
    k: u32,
    symbol: impl Fn(&mut RansDecoder<'_>) -> usize,
) -> Option<u64> {
    let s = symbol(d);
    if s == ESCAPE {
        let len = d.get_raw(ESCAPE_LEN_BITS);
        if len == 0 || len > MAX_ESCAPE_LEN {
            return None;
        }
        let v = (1u64 << (len - 1)) | d.get_bits(len - 1);
        return Some((Q << k) + v - 1);
    }
    let (q, top) = ((s >> 1) as u64, (s & 1) as u64);
    if k == 0 {
        return (top == 0).then_some(q);
    }
    let low = if k <= 17 {
        u64::from(d.get_raw(k - 1))
    } else {
        d.get_bits(k - 1)
    };
    Some((q << k) | (top << (k - 1)) | low)
}

/// A class with at least this many gaps is decoded through the packed slot map
/// ([`Table::fill_packed_slots`]: one load fewer per gap, 140 ns more to fill); fewer, through
/// the byte map.
const PACKED_MIN_GAPS: u64 = 256;
const _: () = assert!(SYMBOLS <= super::rans::MAX_PACKED_SYMBOLS);

/// Decodes a class's `n` gaps (`symbol` gives each gap's symbol) and appends the ranks of its
/// changes (all but the last gap's) to `ranks`; returns the class's element count.
#[inline(always)]
fn class_ranks(
    d: &mut RansDecoder<'_>,
    n: u64,
    k: u32,
    range_len: u64,
    ranks: &mut Vec<u32>,
    symbol: impl Fn(&mut RansDecoder<'_>) -> usize,
) -> Result<u64, DecodeError> {
    let beyond = || DecodeError::malformed(WHAT, "a gap beyond the range or not codable");
    // `at`: the rank the next gap counts from.
    let mut at = 0u64;
    for i in 0..n {
        let g = get_gap(d, k, &symbol)
            .filter(|&g| g <= range_len)
            .ok_or_else(beyond)?;
        at += g;
        if at > range_len {
            return Err(beyond());
        }
        if i + 1 < n {
            ranks.push(at as u32);
            at += 1;
        }
    }
    Ok(at)
}

/// Encodes a part's class gaps: `classes[i]` and `after[i]` are the class of the `i`-th change
/// and the gap to its class's next change (or to the class's end); `firsts[c]` is class `c`'s
/// gap before its first change (ignored for a class without changes).
///
/// The gaps go class by class (each class's first gap, then its later gaps in position order),
/// with each class's change count in the header, so a decoder reads them all in one tight loop
/// before its scan, instead of waiting on the scan for which table comes next.
pub(super) fn encode(classes: &[u8], after: &[u32], firsts: &[u32; EXP_CLASSES]) -> Vec<u8> {
    debug_assert_eq!(classes.len(), after.len());
    let class = |c: u8| usize::from(c) & (EXP_CLASSES - 1);
    let mut fits = [ClassFit::default(); EXP_CLASSES];
    for (&c, &g) in classes.iter().zip(after) {
        fits[class(c)].add_to_mean(g);
    }
    // Class-major order: class `c`'s gaps are `grouped[start[c]..start[c + 1]]`, its first
    // gap leading.
    let mut start = [0usize; EXP_CLASSES + 1];
    for c in 0..EXP_CLASSES {
        let n = fits[c].n as usize;
        start[c + 1] = start[c] + if n > 0 { n + 1 } else { 0 };
    }
    let mut grouped = vec![0u32; start[EXP_CLASSES]];
    let mut at = start;
    for (f, (&first, at)) in fits.iter_mut().zip(firsts.iter().zip(&mut at)) {
        if f.n > 0 {
            f.add_to_mean(first);
            f.choose_k();
            grouped[*at] = first;
            *at += 1;
        }
    }
    for (&c, &g) in classes.iter().zip(after) {
        let c = class(c);
        grouped[at[c]] = g;
        at[c] += 1;
    }
    let mut out = Vec::with_capacity(after.len() + 64);
    out.extend_from_slice(&[0; 4]);
    let mut mask = 0u32;
    let mut e = RansEncoder::with_capacity(after.len() / 2 + 16);
    let mut tables = Vec::new();
    for (c, f) in fits.iter_mut().enumerate() {
        if f.n == 0 {
            continue;
        }
        grouped[start[c]..start[c + 1]]
            .iter()
            .for_each(|&g| f.add_to_shape(g));
        mask |= 1 << c;
        let p = f.params();
        out.extend_from_slice(&[p.k, p.r0, p.a, p.t]);
        // The first gap is counted in `n` for the fit; the header states the changes.
        put_varint(&mut out, f.n - 1);
        tables.push((c, p.k, p.table()));
    }
    out[..4].copy_from_slice(&mask.to_le_bytes());
    for (c, k, table) in tables.iter().rev() {
        let symbols: Vec<EncSymbol> = (0..SYMBOLS).map(|s| table.enc_symbol(s)).collect();
        for &g in grouped[start[*c]..start[c + 1]].iter().rev() {
            put_gap(&mut e, &symbols, *k, g);
        }
    }
    out.extend_from_slice(&e.finish());
    out
}

/// Decodes exactly `count` positions of a part whose base values are `base` (the caller has
/// checked `base.len() < 2³²` and `count ≤ base.len()`).
pub(super) fn decode(
    bytes: &[u8],
    count: u64,
    base: &[u16],
    out: &mut Vec<u32>,
) -> Result<(), DecodeError> {
    let range_len = base.len() as u64;
    let mut r = Reader::new(bytes);
    let mask = r.u32_le(WHAT)?;
    let present = mask.count_ones() as usize;
    if present as u64 > count {
        return Err(DecodeError::malformed(WHAT, "more classes than changes"));
    }
    // Per present class, in class order: its parameters and change count.
    let mut classes = Vec::with_capacity(present);
    let mut total = 0u64;
    for c in 0..EXP_CLASSES {
        if mask >> c & 1 == 0 {
            continue;
        }
        let [k, r0, a, t] = r.array::<4>(WHAT)?;
        if k > MAX_K {
            return Err(DecodeError::malformed(WHAT, "Rice parameter above 30"));
        }
        let n = r.varint_at_most(WHAT, count)? + 1;
        total += n;
        if total > count + present as u64 {
            return Err(DecodeError::malformed(
                WHAT,
                "class counts above the part's changes",
            ));
        }
        classes.push((c, n, Params { k, r0, a, t }));
    }
    if total != count + present as u64 {
        return Err(DecodeError::malformed(
            WHAT,
            format!(
                "class counts sum to {}, {count} declared",
                total - present as u64
            ),
        ));
    }
    let d = RansDecoder::new(r.take(r.remaining(), WHAT)?, WHAT)?;
    // Each class's changes as ranks in the class (its first gap, then one more than the
    // previous rank plus each gap), and the class's element count its last gap implies.
    // Bounded by the part's element count, which the receiver holds; the up-front capacity
    // is also bounded by the input (a symbol costs at least 1/300 of a bit with 12-bit
    // tables), so a few forged bytes claiming 2²⁶ changes do not reserve the whole range
    // before decoding proves them. The vector grows if needed.
    let cap = (count as usize).min(bytes.len().saturating_mul(2400).saturating_add(1024));
    RANKS.with(|ranks| {
        let mut ranks = ranks.borrow_mut();
        ranks.clear();
        ranks.reserve(cap);
        let selected = select(d, &classes, &mut ranks, range_len, base, out);
        // A rare huge part must not pin its buffer in every worker for good.
        if ranks.capacity() > RANKS_KEEP {
            *ranks = Vec::new();
        }
        selected
    })
}

/// Decodes the classes' gaps into ranks (`ranks`, cleared) and selects their positions in
/// `base` into `out`.
fn select(
    mut d: RansDecoder<'_>,
    classes: &[(usize, u64, Params)],
    ranks: &mut Vec<u32>,
    range_len: u64,
    base: &[u16],
    out: &mut Vec<u32>,
) -> Result<(), DecodeError> {
    let mut start = [0usize; EXP_CLASSES + 1];
    let mut totals = [0u64; EXP_CLASSES];
    let mut listed = classes.iter().peekable();
    let mut byte_slots = Box::new([0u8; M as usize]);
    let mut packed = None;
    for c in 0..EXP_CLASSES {
        start[c] = ranks.len();
        let Some(&(_, n, p)) = listed.next_if(|l| l.0 == c) else {
            continue;
        };
        let table = p.table();
        let k = u32::from(p.k);
        totals[c] = if n >= PACKED_MIN_GAPS {
            let slots = packed.get_or_insert_with(|| Box::new([0u32; M as usize]));
            table.fill_packed_slots(slots);
            class_ranks(&mut d, n, k, range_len, ranks, |d| d.get_packed(slots))?
        } else {
            table.fill_slots(&mut byte_slots);
            class_ranks(&mut d, n, k, range_len, ranks, |d| {
                d.get(&byte_slots, &table)
            })?
        };
        if d.overran() {
            return Err(DecodeError::Truncated { what: WHAT });
        }
    }
    start[EXP_CLASSES] = ranks.len();
    d.finish(WHAT)?;
    let lists = scan::ClassRanks {
        ranks: ranks.as_slice(),
        start,
    };
    out.reserve(ranks.len());
    let sel = scan::select_ranks(base, &lists, out);
    // Every rank met, and each class exactly as long as its last gap says.
    for &(c, n, _) in classes {
        if sel.found[c] as u64 + 1 != n || u64::from(sel.totals[c]) != totals[c] {
            return Err(DecodeError::malformed(
                WHAT,
                "a class's gaps do not match the range",
            ));
        }
    }
    debug_assert_eq!(out.len(), ranks.len());
    Ok(())
}

/// Ranks kept in each thread's buffer between parts (4M: 16 MB): more than any part of the
/// default encoder's size holds.
const RANKS_KEEP: usize = 1 << 22;

thread_local! {
    /// Each thread's class ranks, reused from part to part (fresh pages cost more than the
    /// decoding that fills them).
    static RANKS: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_give_every_symbol_a_slot_and_follow_the_parameters() {
        for k in [0u8, 1, 5, 30] {
            for (r0, a, t) in [(0, 0, 0), (255, 255, 255), (128, 100, 140), (1, 254, 3)] {
                let p = Params { k, r0, a, t };
                let table = p.table();
                assert_eq!(table.len(), SYMBOLS);
                let total: u32 = (0..SYMBOLS).map(|s| table.symbol(s).0).sum();
                assert_eq!(total, M);
                assert!((0..SYMBOLS).all(|s| table.symbol(s).0 >= 1));
            }
        }
        // P(q = 0) ≈ 0.5 with a top bit at 0.4: symbol 0 gets ≈ 0.3 of the slots.
        let t = Params {
            k: 3,
            r0: 128,
            a: 128,
            t: 102,
        }
        .table();
        let f0 = t.symbol(0).0;
        assert!((1150..1300).contains(&f0), "{f0}");
    }

    #[test]
    fn fit_recovers_a_geometric_source() {
        // Gaps from a Bernoulli(1/100) mask: the mean is ≈ 99, so k = ⌊log2(69.6)⌋ = 6 and
        // a quotient is zero with probability 1 − 0.99⁶⁴ ≈ 0.47.
        let mut x = 12345u64;
        let gaps: Vec<u32> = (0..20_000)
            .map(|_| {
                let mut g = 0;
                loop {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    if x.is_multiple_of(100) {
                        break g;
                    }
                    g += 1;
                }
            })
            .collect();
        let p = Params::fit(&gaps);
        assert_eq!(p.k, 6);
        assert!((110..130).contains(&p.r0), "{p:?}");
    }
}

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

use super::rans::{M, RansDecoder, RansEncoder, Table};
use super::rc::EXP_CLASSES;
use super::scan;
use crate::error::DecodeError;

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
        let mut tail = (ONE - r0) * (ONE - a) >> 32;
        for q in 0..Q as usize {
            let pq = if q == 0 { r0 } else { tail };
            if q >= 1 {
                tail = tail * a >> 32;
            }
            let (p0, p1) = if self.k == 0 { (ONE, 0) } else { (ONE - t, t) };
            w[2 * q] = (pq * p0 >> 32) as u64;
            w[2 * q + 1] = (pq * p1 >> 32) as u64;
        }
        // `tail` is now (1 − r0)(1 − a)a^(Q−1); the escape is (1 − r0)a^(Q−1).
        let mut esc = ONE - r0;
        for _ in 1..Q {
            esc = esc * a >> 32;
        }
        w[ESCAPE] = esc as u64;
        Table::from_weights(&w)
    }

    /// The maximum-likelihood parameters for `gaps` (all of one class), with `k` from their
    /// mean as in the adaptive codec (`⌊log2(mean · 45/64)⌋`, 45/64 ≈ ln 2).
    fn fit(gaps: &[u32]) -> Self {
        let n = gaps.len() as u64;
        let sum: u64 = gaps.iter().map(|&g| u64::from(g)).sum();
        let t = sum * 45 / (64 * n.max(1));
        let k = if t == 0 {
            0
        } else {
            (63 - t.leading_zeros()).min(u32::from(MAX_K)) as u8
        };
        let (mut zero, mut tail_n, mut tail_sum, mut top_n, mut top_ones) =
            (0u64, 0u64, 0u64, 0u64, 0u64);
        for &g in gaps {
            let q = u64::from(g) >> k;
            if q == 0 {
                zero += 1;
            } else {
                tail_n += 1;
                tail_sum += q.min(Q) - 1;
            }
            if q < Q && k >= 1 {
                top_n += 1;
                top_ones += u64::from(g) >> (k - 1) & 1;
            }
        }
        let ratio = |num: u64, den: u64| {
            if den == 0 {
                0
            } else {
                ((num * 255 + den / 2) / den) as u8
            }
        };
        // Geometric tail with mean m = tail_sum / tail_n: a = m / (1 + m).
        Self {
            k,
            r0: ratio(zero, n),
            a: ratio(tail_sum, tail_sum + tail_n),
            t: ratio(top_ones, top_n),
        }
    }
}

/// Codes gap `g` with a class's table, in reverse (raw bits first, the symbol last).
#[inline(always)]
fn put_gap(e: &mut RansEncoder, table: &Table, k: u8, g: u32) {
    let (g, k) = (u64::from(g), u32::from(k));
    let q = g >> k;
    if q >= Q {
        let v = g - (Q << k) + 1;
        let len = 64 - v.leading_zeros();
        e.put_bits(v, len - 1);
        e.put_raw(len, ESCAPE_LEN_BITS);
        e.put_symbol(table, ESCAPE);
    } else if k >= 1 {
        e.put_bits(g, k - 1);
        e.put_symbol(table, 2 * q as usize + (g >> (k - 1) & 1) as usize);
    } else {
        e.put_symbol(table, 2 * q as usize);
    }
}

/// A class's decoding state: its Rice parameter, table and slot map.
struct ClassTable {
    k: u32,
    table: Table,
    slots: Box<[u8]>,
}

impl ClassTable {
    fn new(p: Params) -> Self {
        let table = p.table();
        let mut slots = vec![0u8; M as usize].into_boxed_slice();
        table.fill_slots(&mut slots);
        Self {
            k: u32::from(p.k),
            table,
            slots,
        }
    }

    /// Decodes one gap; `None` on a stream no encoder writes.
    #[inline(always)]
    fn get_gap(&self, d: &mut RansDecoder<'_>) -> Option<u64> {
        let s = d.get(&self.slots, &self.table);
        let k = self.k;
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
}

/// Encodes a part's class gaps: `classes[i]` and `after[i]` are the class of the `i`-th change
/// and the gap to its class's next change (or to the class's end); `firsts[c]` is class `c`'s
/// gap before its first change (ignored for a class without changes).
pub(super) fn encode(classes: &[u8], after: &[u32], firsts: &[u32; EXP_CLASSES]) -> Vec<u8> {
    debug_assert_eq!(classes.len(), after.len());
    let mut per_class: Vec<Vec<u32>> = vec![Vec::new(); EXP_CLASSES];
    for (&c, &g) in classes.iter().zip(after) {
        per_class[usize::from(c) & (EXP_CLASSES - 1)].push(g);
    }
    let mut mask = 0u32;
    let mut out = Vec::with_capacity(after.len() + 64);
    out.extend_from_slice(&[0; 4]);
    let mut params: Vec<Option<(u8, Table)>> = vec![None; EXP_CLASSES];
    for (c, gaps) in per_class.iter_mut().enumerate() {
        if gaps.is_empty() {
            continue;
        }
        mask |= 1 << c;
        gaps.push(firsts[c]);
        let p = Params::fit(gaps);
        out.extend_from_slice(&[p.k, p.r0, p.a, p.t]);
        params[c] = Some((p.k, p.table()));
    }
    out[..4].copy_from_slice(&mask.to_le_bytes());
    let mut e = RansEncoder::with_capacity(after.len() / 2 + 16);
    for (&c, &g) in classes.iter().zip(after).rev() {
        if let Some((k, t)) = &params[usize::from(c) & (EXP_CLASSES - 1)] {
            put_gap(&mut e, t, *k, g);
        }
    }
    for c in (0..EXP_CLASSES).rev() {
        if let Some((k, t)) = &params[c] {
            put_gap(&mut e, t, *k, firsts[c]);
        }
    }
    out.extend_from_slice(&e.finish());
    out
}

/// Decodes exactly `count` positions of a part whose base values are `base` (the caller has
/// checked `base.len() < 2³²` and `count ≤ base.len()`).
pub(super) fn decode(bytes: &[u8], count: u64, base: &[u16]) -> Result<Vec<u64>, DecodeError> {
    let range_len = base.len() as u64;
    let Some((mask, mut rest)) = bytes.split_first_chunk::<4>() else {
        return Err(DecodeError::Truncated { what: WHAT });
    };
    let mask = u32::from_le_bytes(*mask);
    if u64::from(mask.count_ones()) > count {
        return Err(DecodeError::malformed(WHAT, "more classes than changes"));
    }
    // `which[c]`: class `c`'s table, for the classes present.
    let mut which = [0u8; EXP_CLASSES];
    let mut tables = Vec::with_capacity(mask.count_ones() as usize);
    for (c, w) in which.iter_mut().enumerate() {
        if mask >> c & 1 == 0 {
            continue;
        }
        let Some((p, r)) = rest.split_first_chunk::<4>() else {
            return Err(DecodeError::Truncated { what: WHAT });
        };
        rest = r;
        let p = Params {
            k: p[0],
            r0: p[1],
            a: p[2],
            t: p[3],
        };
        if p.k > MAX_K {
            return Err(DecodeError::malformed(WHAT, "Rice parameter above 30"));
        }
        *w = tables.len() as u8;
        tables.push(ClassTable::new(p));
    }
    let mut d = RansDecoder::new(rest, WHAT)?;
    let beyond = || DecodeError::malformed(WHAT, "a gap beyond the range or not codable");
    // `rem[c]`: elements of class `c` still to skip before its next change. An absent
    // class starts at 2³² − 1, which a range of fewer than 2³² elements never counts down.
    let mut rem = [u32::MAX; EXP_CLASSES];
    for (c, r) in rem.iter_mut().enumerate() {
        if mask >> c & 1 == 1 {
            let g = tables[usize::from(which[c])]
                .get_gap(&mut d)
                .filter(|&g| g <= range_len && !d.overran())
                .ok_or_else(beyond)?;
            *r = g as u32;
        }
    }
    // As in the adaptive codec: the capacity is bounded by the input too, so a few forged
    // bytes cannot reserve the whole range before decoding proves them.
    let cap = (count as usize).min(bytes.len().saturating_mul(512).saturating_add(1024));
    let mut out = Vec::with_capacity(cap);
    scan::countdown(base, &mut rem, &mut |p, c| {
        if out.len() as u64 == count {
            return Err(DecodeError::malformed(WHAT, "more changes than declared"));
        }
        out.push(p);
        // Only a present class can reach zero (see `rem`), so its table exists.
        let g = tables[usize::from(which[c])]
            .get_gap(&mut d)
            .filter(|&g| g <= range_len && !d.overran())
            .ok_or_else(beyond)?;
        Ok(g as u32)
    })?;
    if out.len() as u64 != count {
        return Err(DecodeError::malformed(
            WHAT,
            format!("{} changes decoded, {count} declared", out.len()),
        ));
    }
    if (0..EXP_CLASSES).any(|c| mask >> c & 1 == 1 && rem[c] != 0) {
        return Err(DecodeError::malformed(
            WHAT,
            "a class's last gap overruns the range",
        ));
    }
    d.finish(WHAT)?;
    Ok(out)
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
                    if x % 100 == 0 {
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

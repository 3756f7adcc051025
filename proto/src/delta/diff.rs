//! The diff: positions whose BF16 bit patterns differ between two versions of a range.
//!
//! This is the scan that touches every byte of both checkpoints, so it is written for the
//! vectorizer: blocks of 32 elements are compared into a lane mask (branch-free,
//! SIMD-friendly) and only the set bits are visited. At RL densities
//! (~1%) most blocks are clean, and the scan runs near memory bandwidth.

/// NaNs and infinities among `bits` as BF16 (exponent all ones; a zero mantissa is an
/// infinity): `(nan, inf)`. One predictable test per element in the common case of none.
pub fn count_nonfinite(bits: &[u16]) -> (u64, u64) {
    if !bits
        .iter()
        .fold(false, |any, &b| any | (b & 0x7f80 == 0x7f80))
    {
        return (0, 0);
    }
    let special = bits.iter().filter(|&&b| b & 0x7f80 == 0x7f80);
    let inf = special.clone().filter(|&&b| b & 0x007f == 0).count() as u64;
    (special.count() as u64 - inf, inf)
}

/// The changes of one range: positions relative to the range start, new and old bits.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RangeDiff {
    pub positions: Vec<u64>,
    pub new: Vec<u16>,
    pub old: Vec<u16>,
    /// From [`diff_range_ranked_into`] only: for each change, how many elements of the range
    /// before it have a base value of the same exponent class (what the exponent-class mask
    /// codec needs; empty otherwise).
    pub ranks: Vec<u32>,
    /// From [`diff_range_ranked_into`] only: the number of elements of each exponent class
    /// in the base range.
    pub class_totals: Option<[u32; EXP_CLASSES]>,
}

impl RangeDiff {
    pub fn len(&self) -> usize {
        self.positions.len()
    }

    pub fn is_empty(&self) -> bool {
        self.positions.is_empty()
    }

    /// Empties every buffer (keeping its capacity) and lends them to a scan.
    fn cleared(&mut self) -> crate::delta::codec::scan::RankOut<'_> {
        self.positions.clear();
        self.new.clear();
        self.old.clear();
        self.ranks.clear();
        self.class_totals = None;
        crate::delta::codec::scan::RankOut {
            positions: &mut self.positions,
            old: &mut self.old,
            new: &mut self.new,
            ranks: &mut self.ranks,
        }
    }
}

const BLOCK: usize = 32;

use crate::delta::codec::rc::EXP_CLASSES;

/// Diffs two equally long ranges of BF16 bits.
///
/// # Panics
/// If the ranges differ in length (a caller bug: shapes are checked before diffing).
pub fn diff_range(old: &[u16], new: &[u16]) -> RangeDiff {
    let mut out = RangeDiff::default();
    diff_range_into(old, new, &mut out);
    out
}

/// [`diff_range`] into a reused buffer (cleared first): a hot loop that diffs part after
/// part keeps its capacity instead of faulting in fresh pages for every part.
///
/// # Panics
/// If the ranges differ in length.
pub fn diff_range_into(old: &[u16], new: &[u16], out: &mut RangeDiff) {
    assert_eq!(old.len(), new.len(), "diff_range needs equal lengths");
    if !crate::delta::codec::scan::diff_plain(old, new, &mut out.cleared()) {
        diff_portable(old, new, out);
    }
}

/// [`diff_range_into`] without AVX2 (and the reference the vector form is tested against):
/// appends to `out`'s positions, new and old bits.
fn diff_portable(old: &[u16], new: &[u16], out: &mut RangeDiff) {
    let blocks = old.len() / BLOCK;
    for (b, (o, n)) in old
        .chunks_exact(BLOCK)
        .zip(new.chunks_exact(BLOCK))
        .enumerate()
    {
        // A lane mask of differing elements, built branch-free (the compiler turns this
        // into vector compares and a movemask); then one iteration per change, so the cost
        // follows the number of changes instead of mispredicting per element.
        let mut mask = 0u32;
        for i in 0..BLOCK {
            mask |= u32::from(o[i] != n[i]) << i;
        }
        let base = b * BLOCK;
        while mask != 0 {
            let i = mask.trailing_zeros() as usize;
            mask &= mask - 1;
            out.positions.push((base + i) as u64);
            out.new.push(n[i]);
            out.old.push(o[i]);
        }
    }
    let tail = blocks * BLOCK;
    scan(&old[tail..], &new[tail..], tail as u64, out);
}

/// [`diff_range_into`] that also ranks every change within its base value's exponent class
/// ([`RangeDiff::ranks`], [`RangeDiff::class_totals`]), in the same vectorized pass over
/// both ranges (`codec::scan`).
///
/// # Panics
/// If the ranges differ in length or hold 2³² elements or more (parts are far smaller).
pub fn diff_range_ranked_into(old: &[u16], new: &[u16], out: &mut RangeDiff) {
    let totals = crate::delta::codec::scan::diff_ranked(old, new, &mut out.cleared());
    out.class_totals = Some(totals);
}

#[inline]
fn scan(old: &[u16], new: &[u16], base: u64, out: &mut RangeDiff) {
    for (i, (&o, &n)) in old.iter().zip(new).enumerate() {
        if o != n {
            out.positions.push(base + i as u64);
            out.new.push(n);
            out.old.push(o);
        }
    }
}

/// The plain two-buffer compare loop: how many elements differ. This is the baseline the
/// benchmarks put next to [`diff_range`] (same bytes, same run).
pub fn count_differences(old: &[u16], new: &[u16]) -> usize {
    old.iter().zip(new).filter(|(o, n)| o != n).count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn diff_finds_exactly_the_differing_positions(
            pairs in proptest::collection::vec((any::<u16>(), any::<u16>(), any::<bool>()), 0..300)
        ) {
            let old: Vec<u16> = pairs.iter().map(|p| p.0).collect();
            let new: Vec<u16> = pairs.iter().map(|p| if p.2 { p.1 } else { p.0 }).collect();
            let d = diff_range(&old, &new);
            let expected: Vec<u64> = (0..old.len()).filter(|&i| old[i] != new[i]).map(|i| i as u64).collect();
            prop_assert_eq!(&d.positions, &expected);
            prop_assert_eq!(d.len(), count_differences(&old, &new));
            for (k, &p) in d.positions.iter().enumerate() {
                prop_assert_eq!(d.new[k], new[p as usize]);
                prop_assert_eq!(d.old[k], old[p as usize]);
            }
        }
    }

    proptest! {
        #[test]
        fn vector_and_portable_diffs_agree(
            seed in any::<u64>(),
            len in 0usize..5000,
            every in 1u64..200,
        ) {
            let mut x = seed | 1;
            let mut next = || { x ^= x << 13; x ^= x >> 7; x ^= x << 17; x };
            let old: Vec<u16> = (0..len).map(|_| next() as u16).collect();
            let new: Vec<u16> = old
                .iter()
                .map(|&o| if next() % every == 0 { o ^ (1 + next() as u16 % 3) } else { o })
                .collect();
            let mut portable = RangeDiff::default();
            diff_portable(&old, &new, &mut portable);
            prop_assert_eq!(diff_range(&old, &new), portable);
        }
    }

    #[test]
    fn nan_payloads_and_signed_zeros_are_changes() {
        let old = [0x7FC0, 0x0000, 0x7F80, 0x0001];
        let new = [0x7FC1, 0x8000, 0xFF80, 0x0001];
        assert_eq!(diff_range(&old, &new).positions, [0, 1, 2]);
    }
}

//! Vectorized scans of a part's base values for the exponent-class mask codec
//! ([`IndexCodec::ExpClassGapsRc`](super::IndexCodec::ExpClassGapsRc)).
//!
//! That codec counts positions within each element's exponent class, so both sides look at
//! the class of every base value of a part's range: the encoder needs, for each change, how
//! many elements of the change's class precede it (its *rank* in the class, from which the
//! class-local gaps follow), and the decoder counts each class down to its next change.
//! Element by element that is a class lookup and a dependent counter update, about a
//! nanosecond per element: more than the compare loop that finds the changes.
//!
//! Here the work per unchanged element is a handful of vector instructions. 32 base values
//! are classified at once (shift, saturating subtract, minimum, pack: AVX2 through `pulp`'s
//! checked dispatch, no `unsafe`). The classes of a *window* of [`TRACKED`] consecutive
//! classes, chosen per part where most of its base values lie and moved when they drift, are
//! counted in vector registers: the encoder subtracts each window class's lane mask from a
//! byte accumulator (two instructions per class per 32 elements) and folds the accumulators
//! into exact counts only where a change needs one; the decoder takes each window class's
//! lane mask and its population count, which is all it needs until a class's count reaches
//! its next change. Elements outside the window are counted one by one; in weights they are
//! the rare very small magnitudes and exact zeros. The diff of the encoder's two ranges is
//! done in the same pass, so each byte of both checkpoints is read once.
//!
//! With AVX-512 BW the encoder's ranking scan and the decoder's sparse rank selection take
//! blocks of 64 values in one register (the [`Blocks`] forms; the dense selection stays on
//! AVX2, which ran faster): one byte comparison gives a class's lanes as a 64-bit mask, and
//! the encoder adds each window class's mask population to an exact count instead of keeping
//! accumulators.
//!
//! Every result is an exact integer: the vector paths and the scalar reference (used where
//! AVX2 is missing) agree bit for bit, which the tests check on adversarial bases.

use super::rc::{EXP_CLASSES, EXP_LO};

/// Classes counted in vector registers at once.
pub(crate) const TRACKED: usize = 12;
/// Elements per vector step.
const LANES: usize = 32;
/// Vector steps between re-choosing the window (when too many elements fell outside it).
const RECENTER_STEPS: usize = 1024;
/// Elements per block of the countdown.
const BLOCK: usize = 64;
/// Countdown blocks between re-choosing the window.
const RECENTER_BLOCKS: usize = RECENTER_STEPS / 2;
/// Elements between re-choosing the window (the same stretch in steps and in blocks).
const RECENTER_ELEMS: usize = RECENTER_STEPS * LANES;
const _: () = assert!(RECENTER_BLOCKS * BLOCK == RECENTER_ELEMS);

/// The exponent class of a base value (`docs/format.md`), by arithmetic.
#[inline]
pub(crate) fn class_of(bits: u16) -> u8 {
    let e = (bits >> 7) & 0xFF;
    (e.clamp(EXP_LO, EXP_LO + EXP_CLASSES as u16 - 1) - EXP_LO) as u8
}

/// The first class of the window of [`TRACKED`] consecutive classes that holds most of `hist`
/// (the lowest such window on a tie).
fn best_window(hist: &[u32; EXP_CLASSES]) -> usize {
    let mut best = (0u64, 0usize);
    for lo in 0..=EXP_CLASSES - TRACKED {
        let s: u64 = hist[lo..lo + TRACKED].iter().map(|&h| u64::from(h)).sum();
        if s > best.0 {
            best = (s, lo);
        }
    }
    best.1
}

/// The window for a stretch of a range, from the classes of every 8th element.
fn stretch_window(stretch: &[u16]) -> usize {
    let mut hist = [0u32; EXP_CLASSES];
    for &b in stretch.iter().step_by(8) {
        hist[usize::from(class_of(b))] += 1;
    }
    best_window(&hist)
}

/// At the end (`end`, exclusive) of a stretch of [`RECENTER_ELEMS`] elements of which
/// `outside` fell outside the window: the window for the next stretch, where this stretch's
/// values lie, when more than 1 in 32 did; else none.
#[inline(always)]
fn recentred(base: &[u16], end: usize, outside: usize) -> Option<usize> {
    (outside * 32 > RECENTER_ELEMS).then(|| stretch_window(&base[end - RECENTER_ELEMS..end]))
}

/// The window for a range, from the classes of its first elements.
fn initial_window(base: &[u16]) -> usize {
    let mut hist = [0u32; EXP_CLASSES];
    for &b in base.iter().take(4096) {
        hist[usize::from(class_of(b))] += 1;
    }
    best_window(&hist)
}

/// What a ranking scan appends to: the changes (positions relative to the range start,
/// their old and new bits when the scan diffs) and each change's rank in its class.
#[derive(Debug)]
pub(crate) struct RankOut<'a> {
    pub positions: &'a mut Vec<u64>,
    pub old: &'a mut Vec<u16>,
    pub new: &'a mut Vec<u16>,
    pub ranks: &'a mut Vec<u32>,
}

/// The plain diff of `old` → `new` (positions relative to the range start, old and new bits,
/// appended to `out`; `out.ranks` untouched) with AVX2, 64 elements per step; `false`
/// (nothing appended) where AVX2 is missing, for the caller's portable loop.
///
/// # Panics
/// If the ranges differ in length, or `out`'s positions, old and new bits do (callers'
/// bugs).
pub(crate) fn diff_plain(old: &[u16], new: &[u16], out: &mut RankOut<'_>) -> bool {
    assert_eq!(old.len(), new.len(), "diff needs equal lengths");
    #[cfg(target_arch = "x86_64")]
    if let Some(simd) = pulp::x86::V3::try_new() {
        simd.vectorize(
            #[inline(always)]
            || v3::diff_plain(simd, old, new, out),
        );
        return true;
    }
    let _ = out;
    false
}

/// The changes of `old` → `new` (appended to `out`, with their ranks) and the number of
/// elements of each class in `old`.
///
/// # Panics
/// If the ranges differ in length or hold 2³² elements or more (callers' bugs).
pub(crate) fn diff_ranked(old: &[u16], new: &[u16], out: &mut RankOut<'_>) -> [u32; EXP_CLASSES] {
    assert_eq!(old.len(), new.len(), "ranked diff needs equal lengths");
    assert!(
        u32::try_from(old.len()).is_ok(),
        "a part holds fewer than 2^32 elements"
    );
    rank(old, Changes::Diff(new), out)
}

/// The rank of each change at `positions` (strictly increasing, below `base.len()`) in its
/// class (appended to `ranks`), and the number of elements of each class in `base`.
///
/// # Panics
/// If the range holds 2³² elements or more, or positions are out of order or range.
pub(crate) fn ranks_at(
    base: &[u16],
    positions: &[u64],
    ranks: &mut Vec<u32>,
) -> [u32; EXP_CLASSES] {
    assert!(
        u32::try_from(base.len()).is_ok(),
        "a part holds fewer than 2^32 elements"
    );
    assert!(
        positions.windows(2).all(|w| w[0] < w[1])
            && positions.last().is_none_or(|&p| p < base.len() as u64),
        "positions must be increasing and within the range"
    );
    let (mut p, mut o, mut n) = (Vec::new(), Vec::new(), Vec::new());
    let mut out = RankOut {
        positions: &mut p,
        old: &mut o,
        new: &mut n,
        ranks,
    };
    rank(base, Changes::At(positions), &mut out)
}

/// Where the changes of a ranking scan come from.
#[derive(Debug, Clone, Copy)]
enum Changes<'a> {
    /// Compare with the new range (and record positions, old and new bits).
    Diff(&'a [u16]),
    /// These positions (only ranks are recorded).
    At(&'a [u64]),
}

fn rank(base: &[u16], changes: Changes<'_>, out: &mut RankOut<'_>) -> [u32; EXP_CLASSES] {
    rank_at(base, changes, out, Level::best())
}

/// [`rank`] with `level` (falling back to a narrower one this CPU has; the same result in
/// every case).
fn rank_at(
    base: &[u16],
    changes: Changes<'_>,
    out: &mut RankOut<'_>,
    level: Level,
) -> [u32; EXP_CLASSES] {
    #[cfg(target_arch = "x86_64")]
    {
        if level == Level::Avx512
            && let Some(simd) = pulp::x86::V4::try_new()
        {
            let s = v4::Blocks(simd);
            return simd.vectorize(
                #[inline(always)]
                || rank_blocks(s, base, changes, out),
            );
        }
        if level != Level::Scalar
            && let Some(simd) = pulp::x86::V3::try_new()
        {
            return simd.vectorize(
                #[inline(always)]
                || v3::rank(simd, base, changes, out),
            );
        }
    }
    rank_scalar(base, changes, out, [0; EXP_CLASSES])
}

/// The positions among `p[*at..]` within `lanes` (at most 64) elements from `start`, as a lane
/// mask; `*at` moves past them.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn lanes_at(p: &[u64], at: &mut usize, start: usize, lanes: usize) -> u64 {
    let mut m = 0u64;
    while let Some(&q) = p.get(*at) {
        let d = q.wrapping_sub(start as u64);
        if d >= lanes as u64 {
            break;
        }
        m |= 1 << d;
        *at += 1;
    }
    m
}

/// The reference ranking scan, one element at a time, continuing from counts `cnt`.
fn rank_scalar(
    base: &[u16],
    changes: Changes<'_>,
    out: &mut RankOut<'_>,
    mut cnt: [u32; EXP_CLASSES],
) -> [u32; EXP_CLASSES] {
    // Positions are relative to the range; a continuation passes the offset already scanned
    // through `cnt`'s sum.
    let offset: u64 = cnt.iter().map(|&c| u64::from(c)).sum();
    let mut at = match changes {
        Changes::At(p) => p.iter().position(|&q| q >= offset).unwrap_or(p.len()),
        Changes::Diff(_) => 0,
    };
    for (i, &o) in base.iter().enumerate().skip(offset as usize) {
        let c = usize::from(class_of(o));
        let changed = match changes {
            Changes::Diff(new) => {
                let n = new[i];
                if n != o {
                    out.positions.push(i as u64);
                    out.old.push(o);
                    out.new.push(n);
                    true
                } else {
                    false
                }
            }
            Changes::At(p) => {
                if p.get(at) == Some(&(i as u64)) {
                    at += 1;
                    true
                } else {
                    false
                }
            }
        };
        if changed {
            out.ranks.push(cnt[c]);
        }
        cnt[c] += 1;
    }
    cnt
}

/// Counts every class of `base` down from `rem`: for an element of class `c`, if `rem[c]` is
/// zero it is a change, `change(position, c)` is called and returns the class's next gap
/// (the new `rem[c]`); otherwise `rem[c]` is decremented. Changes are reported in position
/// order; an error from `change` stops the scan.
pub(crate) fn countdown<E>(
    base: &[u16],
    rem: &mut [u32; EXP_CLASSES],
    change: &mut impl FnMut(u64, usize) -> Result<u32, E>,
) -> Result<(), E> {
    #[cfg(target_arch = "x86_64")]
    if let Some(simd) = pulp::x86::V3::try_new() {
        return simd.vectorize(
            #[inline(always)]
            || v3::countdown(simd, base, rem, change),
        );
    }
    countdown_scalar(base, 0, rem, change)
}

/// The reference countdown, one element at a time; `start` is the position of `base[0]`.
#[inline(always)]
fn countdown_scalar<E>(
    base: &[u16],
    start: u64,
    rem: &mut [u32; EXP_CLASSES],
    change: &mut impl FnMut(u64, usize) -> Result<u32, E>,
) -> Result<(), E> {
    for (i, &b) in base.iter().enumerate() {
        let c = usize::from(class_of(b));
        let r = rem[c];
        if r != 0 {
            rem[c] = r - 1;
        } else {
            rem[c] = change(start + i as u64, c)?;
        }
    }
    Ok(())
}

/// Parts with more than one change per this many elements take the branch-free form of the
/// rank selection.
const DENSE_SELECT_ELEMS: usize = 64;

/// Each class's change ranks, class by class: class `c`'s are `ranks[start[c]..start[c + 1]]`,
/// strictly increasing.
#[derive(Debug)]
pub(crate) struct ClassRanks<'a> {
    pub ranks: &'a [u32],
    pub start: [usize; EXP_CLASSES + 1],
}

/// What [`select_ranks`] found besides the positions: each class's element count in the
/// range, and how many of its ranks it met (all of them, unless one is beyond the class).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Selected {
    pub totals: [u32; EXP_CLASSES],
    pub found: [usize; EXP_CLASSES],
}

/// Appends to `out`, in position order, the position of every element of `base` whose rank
/// in its class is one of `lists`' ranks for that class: the countdown's job, with every gap
/// known before the scan starts, so no decoding waits inside it.
pub(crate) fn select_ranks(base: &[u16], lists: &ClassRanks<'_>, out: &mut Vec<u32>) -> Selected {
    // Above ~1 change per 64 elements the per-class test of the sparse form is a coin toss
    // for the branch predictor: test every class without branching instead.
    let dense = lists.ranks.len().saturating_mul(DENSE_SELECT_ELEMS) > base.len();
    select_ranks_at(base, lists, out, dense, Level::best())
}

/// An instruction set the scans can run with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Level {
    Scalar,
    /// AVX2 (`pulp`'s `V3`): a block's classes in two 256-bit registers.
    Avx2,
    /// AVX-512 BW (`pulp`'s `V4`): in one 512-bit register, one class's lanes straight into
    /// a 64-bit mask. The dense rank selection stays on AVX2.
    Avx512,
}

impl Level {
    /// The widest this CPU has.
    fn best() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if pulp::x86::V4::try_new().is_some() {
                return Level::Avx512;
            }
            if pulp::x86::V3::try_new().is_some() {
                return Level::Avx2;
            }
        }
        Level::Scalar
    }
}

/// [`select_ranks`] in the form `dense` names, with `level` (falling back to a narrower one
/// this CPU has; the same result in every case).
fn select_ranks_at(
    base: &[u16],
    lists: &ClassRanks<'_>,
    out: &mut Vec<u32>,
    dense: bool,
    level: Level,
) -> Selected {
    let mut cur: [usize; EXP_CLASSES] = core::array::from_fn(|c| lists.start[c]);
    let mut cnt = [0u32; EXP_CLASSES];
    #[cfg(target_arch = "x86_64")]
    {
        let (c, n) = (&mut cur, &mut cnt);
        // The sparse form only: measured on AVX-512 (Zen 4), the dense form, which takes
        // every window class's mask and count per block, ran 4–5% slower with 512-bit
        // registers than with AVX2, where the sparse form ran 7–13% faster.
        if level == Level::Avx512
            && !dense
            && let Some(simd) = pulp::x86::V4::try_new()
        {
            let s = v4::Blocks(simd);
            simd.vectorize(
                #[inline(always)]
                || select_ranks_blocks::<_, false>(s, base, lists, c, n, out),
            );
            return selected(lists, cur, cnt);
        }
        if level != Level::Scalar
            && let Some(simd) = pulp::x86::V3::try_new()
        {
            let s = v3::Blocks(simd);
            if dense {
                simd.vectorize(
                    #[inline(always)]
                    || select_ranks_blocks::<_, true>(s, base, lists, c, n, out),
                );
            } else {
                simd.vectorize(
                    #[inline(always)]
                    || select_ranks_blocks::<_, false>(s, base, lists, c, n, out),
                );
            }
            return selected(lists, cur, cnt);
        }
    }
    select_ranks_scalar(base, 0, lists, &mut cur, &mut cnt, out);
    selected(lists, cur, cnt)
}

fn selected(
    lists: &ClassRanks<'_>,
    cur: [usize; EXP_CLASSES],
    totals: [u32; EXP_CLASSES],
) -> Selected {
    Selected {
        totals,
        found: core::array::from_fn(|c| cur[c] - lists.start[c]),
    }
}

/// The next rank class `c` waits for, or `u32::MAX` when its list is done (a rank no range
/// of fewer than 2³² elements reaches before its end).
#[inline(always)]
fn next_rank(lists: &ClassRanks<'_>, cur: &[usize; EXP_CLASSES], c: usize) -> u32 {
    if cur[c] < lists.start[c + 1] {
        lists.ranks[cur[c]]
    } else {
        u32::MAX
    }
}

/// The reference [`select_ranks`], one element at a time; `start` is the position of
/// `base[0]`.
#[inline(always)]
fn select_ranks_scalar(
    base: &[u16],
    start: u64,
    lists: &ClassRanks<'_>,
    cur: &mut [usize; EXP_CLASSES],
    cnt: &mut [u32; EXP_CLASSES],
    out: &mut Vec<u32>,
) {
    for (i, &b) in base.iter().enumerate() {
        let c = usize::from(class_of(b));
        if cnt[c] == next_rank(lists, cur, c) {
            // The caller's range is under 2³² elements.
            out.push((start + i as u64) as u32);
            cur[c] += 1;
        }
        cnt[c] += 1;
    }
}

/// Position of the `r`-th (from 0) set bit of `m`, which has more than `r` set bits.
///
/// Broadword, without a loop or a branch (a loop of `r` steps ends in a mispredicted exit
/// on every call, and `pdep` is not reachable without `unsafe`): the bytes' cumulative
/// population counts locate the byte holding the bit, and a 2 KiB table the bit within it.
#[inline(always)]
fn select64(m: u64, r: u32) -> u32 {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGHS: u64 = 0x8080_8080_8080_8080;
    let s = m - ((m >> 1) & 0x5555_5555_5555_5555);
    let s = (s & 0x3333_3333_3333_3333) + ((s >> 2) & 0x3333_3333_3333_3333);
    let s = (s + (s >> 4)) & 0x0F0F_0F0F_0F0F_0F0F;
    // Byte i: the set bits in bytes 0..=i (at most 64, so no byte carries into the next).
    let cum = s.wrapping_mul(ONES);
    // Byte i's high bit: whether r ≥ cum_i (r < 64 and cum_i ≤ 64: no borrow crosses a byte).
    let r = u64::from(r & 63);
    let below = ((r * ONES) | HIGHS).wrapping_sub(cum) & HIGHS;
    // The byte holding the bit: the number of bytes whose cumulative count is ≤ r.
    let byte = below.count_ones() & 7;
    let before = ((cum << 8) >> (8 * byte)) & 0xFF;
    let bits = (m >> (8 * byte)) & 0xFF;
    let within = (r.wrapping_sub(before)) & 7;
    8 * byte + u32::from(SELECT_IN_BYTE[bits as usize][within as usize])
}

/// `SELECT_IN_BYTE[b][r]`: the position of the `r`-th set bit of byte `b` (0 where `b` has
/// `r` or fewer set bits; never read then).
static SELECT_IN_BYTE: [[u8; 8]; 256] = select_in_byte_table();

const fn select_in_byte_table() -> [[u8; 8]; 256] {
    let mut t = [[0u8; 8]; 256];
    let mut b = 0;
    while b < 256 {
        let (mut bit, mut r) = (0, 0);
        while bit < 8 {
            if b >> bit & 1 == 1 {
                t[b][r] = bit as u8;
                r += 1;
            }
            bit += 1;
        }
        b += 1;
    }
    t
}

/// Bits of a 64-lane mask strictly above lane `p` (`p < 64`).
#[inline(always)]
fn above64(p: u32) -> u64 {
    u64::MAX.checked_shl(p + 1).unwrap_or(0)
}

/// What the rank-selecting scan needs of a vector instruction set, per block of 64 base
/// values: their classes (one byte each, in some register form `V`), the lanes of one class
/// and the lanes outside the window, as 64-bit masks.
#[cfg(target_arch = "x86_64")]
trait Blocks: Copy {
    type V: Copy;
    /// The classes of a block.
    fn classes(self, block: &[u16; BLOCK]) -> Self::V;
    /// Class `c` in every lane.
    fn splat(self, c: usize) -> Self::V;
    /// Lanes of `v` equal to `c`.
    fn eq(self, v: Self::V, c: Self::V) -> u64;
    /// Lanes of `v` outside the window `[lo, lo + k)` (`lo`, `k` splatted).
    fn outside(self, v: Self::V, lo: Self::V, k: Self::V) -> u64;
    /// The class bytes, in element order.
    fn bytes(v: Self::V) -> [u8; BLOCK];
    /// Lanes whose bits differ between `old` and `new`.
    fn differ(self, old: &[u16; BLOCK], new: &[u16; BLOCK]) -> u64;
}

/// [`rank`] over blocks of 64 elements, for instruction sets where a class's lanes come out
/// of one comparison as a 64-bit mask: each window class's count advances by that mask's
/// population, so the counts are exact at every block boundary and a change's rank is its
/// class's count plus the lanes of its class below it in the block. (The AVX2 form,
/// [`v3::rank`], counts into byte accumulators instead, which cost it fewer instructions.)
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn rank_blocks<S: Blocks>(
    simd: S,
    base: &[u16],
    changes: Changes<'_>,
    out: &mut RankOut<'_>,
) -> [u32; EXP_CLASSES] {
    let (blocks, _) = pulp::as_arrays::<BLOCK, u16>(base);
    let new_blocks = match changes {
        Changes::Diff(new) => pulp::as_arrays::<BLOCK, u16>(new).0,
        Changes::At(_) => &[],
    };
    // Exact counts of the classes outside the window; the window's live in `wcnt`.
    let mut cnt = [0u32; EXP_CLASSES];
    let mut lo = initial_window(base);
    let mut cls: [S::V; TRACKED] = core::array::from_fn(|t| simd.splat(lo + t));
    let (mut lo_v, k_v) = (simd.splat(lo), simd.splat(TRACKED));
    let mut wcnt = [0u32; TRACKED];
    let mut outside_n = 0usize;
    let mut at = 0usize;
    for (s, block) in blocks.iter().enumerate() {
        let i = s * BLOCK;
        let v = simd.classes(block);
        let changed = match changes {
            Changes::Diff(_) => simd.differ(block, &new_blocks[s]),
            Changes::At(p) => lanes_at(p, &mut at, i, BLOCK),
        };
        let off = simd.outside(v, lo_v, k_v);
        // The class bytes are stored where a block needs them, in each branch: computed once
        // for both, they cost 7–9% of the encode at 0.3–1% density.
        if changed != 0 {
            let bytes = S::bytes(v);
            let mut m = changed;
            while m != 0 {
                let j = m.trailing_zeros();
                m &= m - 1;
                let c = usize::from(bytes[j as usize]);
                let before = (simd.eq(v, simd.splat(c)) & ((1u64 << j) - 1)).count_ones();
                let t = c.wrapping_sub(lo);
                let counted = if t < TRACKED { wcnt[t] } else { cnt[c] };
                out.ranks.push(counted + before);
                if let Changes::Diff(_) = changes {
                    let j = j as usize;
                    out.positions.push((i + j) as u64);
                    out.old.push(block[j]);
                    out.new.push(new_blocks[s][j]);
                }
            }
        }
        for t in 0..TRACKED {
            wcnt[t] += simd.eq(v, cls[t]).count_ones();
        }
        if off != 0 {
            outside_n += off.count_ones() as usize;
            let bytes = S::bytes(v);
            let mut o = off;
            while o != 0 {
                let j = o.trailing_zeros();
                o &= o - 1;
                cnt[usize::from(bytes[j as usize])] += 1;
            }
        }
        if (s + 1) % RECENTER_BLOCKS == 0 {
            if let Some(next) = recentred(base, i + BLOCK, outside_n) {
                cnt[lo..lo + TRACKED].copy_from_slice(&wcnt);
                lo = next;
                wcnt.copy_from_slice(&cnt[lo..lo + TRACKED]);
                cls = core::array::from_fn(|t| simd.splat(lo + t));
                lo_v = simd.splat(lo);
            }
            outside_n = 0;
        }
    }
    cnt[lo..lo + TRACKED].copy_from_slice(&wcnt);
    if blocks.len() * BLOCK < base.len() {
        // The last, partial block, one element at a time, continuing the counts.
        return rank_scalar(base, changes, out, cnt);
    }
    cnt
}

/// [`select_ranks`] over blocks of 64 elements: per window class, one population
/// count and one comparison with its next rank decide that most blocks hold none of its
/// changes; a block that does gets a bit per change in an event mask, read out in
/// position order.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn select_ranks_blocks<S: Blocks, const DENSE: bool>(
    simd: S,
    base: &[u16],
    lists: &ClassRanks<'_>,
    cur: &mut [usize; EXP_CLASSES],
    cnt: &mut [u32; EXP_CLASSES],
    out: &mut Vec<u32>,
) {
    let (blocks, _) = pulp::as_arrays::<BLOCK, u16>(base);
    let mut lo = initial_window(base);
    let mut cls: [S::V; TRACKED] = core::array::from_fn(|t| simd.splat(lo + t));
    let (mut lo_v, k_v) = (simd.splat(lo), simd.splat(TRACKED));
    // The window classes' counts and next ranks, in local arrays the loop can keep in
    // registers.
    let mut wcnt: [u32; TRACKED] = core::array::from_fn(|t| cnt[lo + t]);
    let mut wnext: [u32; TRACKED] = core::array::from_fn(|t| next_rank(lists, cur, lo + t));
    let mut outside_n = 0usize;
    for (s, block) in blocks.iter().enumerate() {
        let i = s * BLOCK;
        let v = simd.classes(block);
        let off = simd.outside(v, lo_v, k_v);
        let mut events = 0u64;
        // The changes of window class `t` in this block: skip to the next change's
        // lane, then past it, until the class's next rank lies beyond the block.
        let mut take = |t: usize, m: u64, c0: u32, n: u32, wnext: &mut [u32; TRACKED]| {
            let c = lo + t;
            let mut m = m;
            let mut at = c0;
            while wnext[t] < c0 + n {
                let p = select64(m, wnext[t] - at);
                events |= 1 << p;
                m &= above64(p);
                at = wnext[t] + 1;
                cur[c] += 1;
                wnext[t] = next_rank(lists, cur, c);
            }
        };
        if DENSE {
            let mut masks = [0u64; TRACKED];
            let mut crossing = 0u32;
            for t in 0..TRACKED {
                let m = simd.eq(v, cls[t]);
                masks[t] = m;
                crossing |= u32::from(wnext[t] < wcnt[t] + m.count_ones()) << t;
            }
            while crossing != 0 {
                let t = crossing.trailing_zeros() as usize;
                crossing &= crossing - 1;
                take(t, masks[t], wcnt[t], masks[t].count_ones(), &mut wnext);
            }
            for t in 0..TRACKED {
                wcnt[t] += masks[t].count_ones();
            }
        } else {
            for t in 0..TRACKED {
                let m = simd.eq(v, cls[t]);
                let n = m.count_ones();
                let c0 = wcnt[t];
                // Almost never taken at RL densities: a branch, not a select.
                if wnext[t] < c0 + n {
                    take(t, m, c0, n, &mut wnext);
                }
                wcnt[t] = c0 + n;
            }
        }
        if off != 0 {
            outside_n += off.count_ones() as usize;
            let bytes = S::bytes(v);
            let mut o = off;
            while o != 0 {
                let p = o.trailing_zeros();
                o &= o - 1;
                let c = usize::from(bytes[p as usize]);
                if cnt[c] == next_rank(lists, cur, c) {
                    events |= 1 << p;
                    cur[c] += 1;
                }
                cnt[c] += 1;
            }
        }
        while events != 0 {
            out.push(i as u32 + events.trailing_zeros());
            events &= events - 1;
        }
        if (s + 1) % RECENTER_BLOCKS == 0 {
            if let Some(next) = recentred(base, i + BLOCK, outside_n) {
                cnt[lo..lo + TRACKED].copy_from_slice(&wcnt);
                lo = next;
                wcnt = core::array::from_fn(|t| cnt[lo + t]);
                wnext = core::array::from_fn(|t| next_rank(lists, cur, lo + t));
                cls = core::array::from_fn(|t| simd.splat(lo + t));
                lo_v = simd.splat(lo);
            }
            outside_n = 0;
        }
    }
    cnt[lo..lo + TRACKED].copy_from_slice(&wcnt);
    let tail = blocks.len() * BLOCK;
    select_ranks_scalar(&base[tail..], tail as u64, lists, cur, cnt, out);
}

#[cfg(target_arch = "x86_64")]
mod v3 {
    //! The AVX2 versions. Every intrinsic is called through `pulp`'s `V3` token, whose
    //! existence proves the CPU has the features, inside `V3::vectorize`, which compiles
    //! the caller for them.

    use core::arch::x86_64::__m256i;

    use pulp::x86::V3;

    use super::{
        BLOCK, Changes, EXP_CLASSES, LANES, RECENTER_BLOCKS, RECENTER_STEPS, RankOut, TRACKED,
        above64, countdown_scalar, initial_window, rank_scalar, recentred, select64,
    };

    #[inline(always)]
    fn load(w: &[u16; 16]) -> __m256i {
        pulp::cast(*w)
    }

    /// The two 16-element halves of a step.
    #[inline(always)]
    fn halves(step: &[u16]) -> (&[u16; 16], &[u16; 16]) {
        let (a, b) = pulp::as_arrays::<16, u16>(step).0.split_at(1);
        (&a[0], &b[0])
    }

    /// The classes of 32 base values (`a`: elements 0–15, `b`: 16–31), one byte each, in
    /// element order.
    #[inline(always)]
    fn classes(simd: V3, a: __m256i, b: __m256i) -> __m256i {
        let x = simd.avx2;
        let class16 = |w: __m256i| {
            // (w << 1) >> 8 drops the sign: the exponent field, 0..=255.
            let e = x._mm256_srli_epi16::<8>(x._mm256_slli_epi16::<1>(w));
            let lo = simd.avx._mm256_set1_epi16(super::EXP_LO as i16);
            let top = simd.avx._mm256_set1_epi16(EXP_CLASSES as i16 - 1);
            x._mm256_min_epu16(x._mm256_subs_epu16(e, lo), top)
        };
        // packus interleaves the 128-bit halves: (a0-7, b0-7, a8-15, b8-15) → reorder.
        let packed = x._mm256_packus_epi16(class16(a), class16(b));
        x._mm256_permute4x64_epi64::<0b11_01_10_00>(packed)
    }

    /// Lanes of 32 elements whose old and new bits differ, as a bit mask.
    #[inline(always)]
    fn differ(simd: V3, oa: __m256i, ob: __m256i, na: __m256i, nb: __m256i) -> u32 {
        let x = simd.avx2;
        let eq = x._mm256_packs_epi16(x._mm256_cmpeq_epi16(oa, na), x._mm256_cmpeq_epi16(ob, nb));
        let eq = x._mm256_permute4x64_epi64::<0b11_01_10_00>(eq);
        !(x._mm256_movemask_epi8(eq) as u32)
    }

    /// Lanes of `v` equal to `c`, as a bit mask.
    #[inline(always)]
    fn lanes_eq(simd: V3, v: __m256i, c: __m256i) -> u32 {
        simd.avx2
            ._mm256_movemask_epi8(simd.avx2._mm256_cmpeq_epi8(v, c)) as u32
    }

    /// Lanes of `v` outside the window `[lo, lo + TRACKED)`, as a bit mask.
    #[inline(always)]
    fn outside(simd: V3, v: __m256i, lo: __m256i, k: __m256i) -> u32 {
        let x = simd.avx2;
        // v − lo wraps for v < lo, so "≥ TRACKED" covers both sides.
        let rel = x._mm256_sub_epi8(v, lo);
        x._mm256_movemask_epi8(x._mm256_cmpeq_epi8(x._mm256_max_epu8(rel, k), rel)) as u32
    }

    #[inline(always)]
    fn splat8(simd: V3, b: usize) -> __m256i {
        simd.avx._mm256_set1_epi8(b as i8)
    }

    /// Sum of the four u64 lanes.
    #[inline(always)]
    fn hsum64(v: __m256i) -> u64 {
        let l: [u64; 4] = pulp::cast(v);
        l[0] + l[1] + l[2] + l[3]
    }

    /// Counts of the window's classes: byte accumulators (one per class, one lane per
    /// element position, at most 255 steps between folds) folded into u64 lane sums.
    struct Window {
        lo: usize,
        acc: [__m256i; TRACKED],
        sums: [__m256i; TRACKED],
        cls: [__m256i; TRACKED],
        lo_v: __m256i,
        k_v: __m256i,
        /// Steps accumulated since the last fold.
        pending: usize,
    }

    impl Window {
        #[inline(always)]
        fn new(simd: V3, lo: usize) -> Self {
            let zero = simd.avx._mm256_setzero_si256();
            Self {
                lo,
                acc: [zero; TRACKED],
                sums: [zero; TRACKED],
                cls: core::array::from_fn(|t| splat8(simd, lo + t)),
                lo_v: splat8(simd, lo),
                k_v: splat8(simd, TRACKED),
                pending: 0,
            }
        }

        #[inline(always)]
        fn add(&mut self, simd: V3, v: __m256i) {
            let x = simd.avx2;
            for t in 0..TRACKED {
                self.acc[t] = x._mm256_sub_epi8(self.acc[t], x._mm256_cmpeq_epi8(v, self.cls[t]));
            }
            self.pending += 1;
        }

        #[inline(always)]
        fn fold(&mut self, simd: V3) {
            let x = simd.avx2;
            let zero = simd.avx._mm256_setzero_si256();
            for t in 0..TRACKED {
                self.sums[t] =
                    x._mm256_add_epi64(self.sums[t], x._mm256_sad_epu8(self.acc[t], zero));
                self.acc[t] = zero;
            }
            self.pending = 0;
        }

        /// Moves every folded count into `cnt` (after a `fold`).
        #[inline(always)]
        fn drain(&mut self, simd: V3, cnt: &mut [u32; EXP_CLASSES]) {
            let zero = simd.avx._mm256_setzero_si256();
            for t in 0..TRACKED {
                cnt[self.lo + t] += hsum64(self.sums[t]) as u32;
                self.sums[t] = zero;
            }
        }

        /// The folded count of class `c` (zero outside the window).
        #[inline(always)]
        fn folded(&self, c: usize) -> u32 {
            match c.checked_sub(self.lo) {
                Some(t) if t < TRACKED => hsum64(self.sums[t]) as u32,
                _ => 0,
            }
        }
    }

    /// [`super::diff_plain`]: a 64-lane mask of differing elements per block, then the
    /// block's changes written straight into the output vectors. Three checked pushes per
    /// change cost more than the compare at RL densities, and so did gathering a block into
    /// small arrays and appending each with a copy (three `memmove` calls per dirty block:
    /// 8% of the fast set's encode at 5%). Instead the vectors are kept at least a block
    /// longer than what is written (grown in steps of `GROW` zeroed entries, which are
    /// in cache when written), written by index, and cut back to what was written at the
    /// end.
    #[inline(always)]
    pub(super) fn diff_plain(simd: V3, old: &[u16], new: &[u16], out: &mut RankOut<'_>) {
        const GROW: usize = 4096;
        let (steps, _) = pulp::as_arrays::<BLOCK, u16>(old);
        let (new_steps, _) = pulp::as_arrays::<BLOCK, u16>(new);
        let mut w = out.positions.len();
        assert!(
            out.old.len() == w && out.new.len() == w,
            "the diff appends to equally long vectors"
        );
        for (s, (o, n)) in steps.iter().zip(new_steps).enumerate() {
            let mut m = super::Blocks::differ(Blocks(simd), o, n);
            if m == 0 {
                continue;
            }
            if out.positions.len() < w + BLOCK {
                let len = w + BLOCK + GROW;
                out.positions.resize(len, 0);
                out.old.resize(len, 0);
                out.new.resize(len, 0);
            }
            let (pos, o_at, n_at) = (
                &mut out.positions[w..w + BLOCK],
                &mut out.old[w..w + BLOCK],
                &mut out.new[w..w + BLOCK],
            );
            let i = (s * BLOCK) as u64;
            let mut k = 0;
            while m != 0 {
                let j = m.trailing_zeros() as usize;
                m &= m - 1;
                pos[k & (BLOCK - 1)] = i + j as u64;
                o_at[k & (BLOCK - 1)] = o[j];
                n_at[k & (BLOCK - 1)] = n[j];
                k += 1;
            }
            w += k;
        }
        out.positions.truncate(w);
        out.old.truncate(w);
        out.new.truncate(w);
        let tail = steps.len() * BLOCK;
        for (i, (&o, &n)) in old[tail..].iter().zip(&new[tail..]).enumerate() {
            if o != n {
                out.positions.push((tail + i) as u64);
                out.old.push(o);
                out.new.push(n);
            }
        }
    }

    // `inline(always)` everywhere below: the intrinsics inline only into code compiled for
    // AVX2, which is the body of `V3::vectorize`'s closure and what is inlined into it.
    #[inline(always)]
    pub(super) fn rank(
        simd: V3,
        base: &[u16],
        changes: Changes<'_>,
        out: &mut RankOut<'_>,
    ) -> [u32; EXP_CLASSES] {
        let (steps, _) = pulp::as_arrays::<LANES, u16>(base);
        // Exact counts of every class up to the last drain (outside-window classes are
        // counted here directly); the window holds the rest.
        let mut cnt = [0u32; EXP_CLASSES];
        let mut w = Window::new(simd, initial_window(base));
        let mut outside_n = 0usize;
        let mut at = 0usize;
        let mut bytes = [0u8; LANES];
        for (s, step) in steps.iter().enumerate() {
            let i = s * LANES;
            let (a, b) = halves(step);
            let (oa, ob) = (load(a), load(b));
            let v = classes(simd, oa, ob);
            let changed = match changes {
                Changes::Diff(new) => {
                    let (na, nb) = halves(&new[i..i + LANES]);
                    differ(simd, oa, ob, load(na), load(nb))
                }
                // A step's 32 lanes: the mask fits in the low half.
                Changes::At(p) => super::lanes_at(p, &mut at, i, LANES) as u32,
            };
            let off = outside(simd, v, w.lo_v, w.k_v);
            if changed | off != 0 {
                bytes = pulp::cast(v);
            }
            if changed != 0 {
                // Ranks need exact counts at this step's start: fold the accumulators.
                w.fold(simd);
                let mut m = changed;
                while m != 0 {
                    let j = m.trailing_zeros();
                    m &= m - 1;
                    let c = usize::from(bytes[j as usize]);
                    let before = lanes_eq(simd, v, splat8(simd, c)) & ((1u32 << j) - 1);
                    out.ranks.push(cnt[c] + w.folded(c) + before.count_ones());
                    if let Changes::Diff(new) = changes {
                        let k = i + j as usize;
                        out.positions.push(k as u64);
                        out.old.push(base[k]);
                        out.new.push(new[k]);
                    }
                }
            }
            w.add(simd, v);
            if off != 0 {
                outside_n += off.count_ones() as usize;
                let mut m = off;
                while m != 0 {
                    let j = m.trailing_zeros();
                    m &= m - 1;
                    cnt[usize::from(bytes[j as usize])] += 1;
                }
            }
            if w.pending == 255 {
                w.fold(simd);
            }
            if (s + 1) % RECENTER_STEPS == 0 {
                // Too many elements fell outside: move the window where this stretch's values
                // lie (its folded counts go to `cnt` first).
                if let Some(lo) = recentred(base, i + LANES, outside_n)
                    && lo != w.lo
                {
                    w.fold(simd);
                    w.drain(simd, &mut cnt);
                    w = Window::new(simd, lo);
                }
                outside_n = 0;
            }
        }
        w.fold(simd);
        w.drain(simd, &mut cnt);
        let tail = steps.len() * LANES;
        if tail < base.len() {
            // The last, partial step, one element at a time, continuing the counts.
            return rank_scalar(base, changes, out, cnt);
        }
        let _ = tail;
        cnt
    }

    #[inline(always)]
    pub(super) fn countdown<E>(
        simd: V3,
        base: &[u16],
        rem: &mut [u32; EXP_CLASSES],
        change: &mut impl FnMut(u64, usize) -> Result<u32, E>,
    ) -> Result<(), E> {
        // Blocks of 64 elements: one population count and one comparison per window class
        // per block decide that most classes reach no change in it.
        let (blocks, _) = pulp::as_arrays::<BLOCK, u16>(base);
        let mut lo = initial_window(base);
        let mut cls: [__m256i; TRACKED] = core::array::from_fn(|t| splat8(simd, lo + t));
        let (mut lo_v, k_v) = (splat8(simd, lo), splat8(simd, TRACKED));
        // The window classes' counts, in a local array the loop can keep in registers.
        let mut wrem: [u32; TRACKED] = core::array::from_fn(|t| rem[lo + t]);
        let mut outside_n = 0usize;
        for (s, block) in blocks.iter().enumerate() {
            let i = s * BLOCK;
            let (h0, h1) = block.split_at(LANES);
            let (a, b) = halves(h0);
            let v0 = classes(simd, load(a), load(b));
            let (a, b) = halves(h1);
            let v1 = classes(simd, load(a), load(b));
            let off = u64::from(outside(simd, v0, lo_v, k_v))
                | u64::from(outside(simd, v1, lo_v, k_v)) << 32;
            let mut masks = [0u64; TRACKED];
            let mut crossing = 0u32;
            for t in 0..TRACKED {
                let m = u64::from(lanes_eq(simd, v0, cls[t]))
                    | u64::from(lanes_eq(simd, v1, cls[t])) << 32;
                let n = m.count_ones();
                let r = wrem[t];
                // A branch, not a select: it is almost never taken at RL densities, and
                // written branch-free the compiler turns this loop into slow vector code.
                if n > r {
                    // A crossing class keeps its count until its change is reached below.
                    masks[t] = m;
                    crossing |= 1 << t;
                } else {
                    wrem[t] = r - n;
                }
            }
            if crossing as u64 | off == 0 {
                continue;
            }
            // Events in position order: each crossing class's next change, and every element
            // outside the window (counted down one by one).
            outside_n += off.count_ones() as usize;
            let mut events = off;
            let mut c = crossing;
            while c != 0 {
                let t = c.trailing_zeros() as usize;
                c &= c - 1;
                events |= 1 << select64(masks[t], wrem[t]);
            }
            let bytes: [u8; BLOCK] = pulp::cast([v0, v1]);
            while events != 0 {
                let p = events.trailing_zeros();
                events &= events - 1;
                let class = usize::from(bytes[p as usize]);
                let at = i as u64 + u64::from(p);
                match class.checked_sub(lo) {
                    Some(t) if t < TRACKED => {
                        let g = change(at, class)?;
                        let m = masks[t] & above64(p);
                        masks[t] = m;
                        let n = m.count_ones();
                        if n > g {
                            wrem[t] = g;
                            events |= 1 << select64(m, g);
                        } else {
                            wrem[t] = g - n;
                        }
                    }
                    _ => {
                        let r = rem[class];
                        rem[class] = if r != 0 { r - 1 } else { change(at, class)? };
                    }
                }
            }
            if (s + 1) % RECENTER_BLOCKS == 0 {
                if let Some(next) = recentred(base, i + BLOCK, outside_n) {
                    rem[lo..lo + TRACKED].copy_from_slice(&wrem);
                    lo = next;
                    wrem = core::array::from_fn(|t| rem[lo + t]);
                    cls = core::array::from_fn(|t| splat8(simd, lo + t));
                    lo_v = splat8(simd, lo);
                }
                outside_n = 0;
            }
        }
        rem[lo..lo + TRACKED].copy_from_slice(&wrem);
        let tail = blocks.len() * BLOCK;
        countdown_scalar(&base[tail..], tail as u64, rem, change)
    }

    /// A block as two registers of 32 class bytes.
    #[derive(Debug, Clone, Copy)]
    pub(super) struct Blocks(pub(super) V3);

    impl super::Blocks for Blocks {
        type V = [__m256i; 2];

        #[inline(always)]
        fn classes(self, block: &[u16; BLOCK]) -> Self::V {
            let (h0, h1) = block.split_at(LANES);
            let (a, b) = halves(h0);
            let v0 = classes(self.0, load(a), load(b));
            let (a, b) = halves(h1);
            [v0, classes(self.0, load(a), load(b))]
        }

        #[inline(always)]
        fn splat(self, c: usize) -> Self::V {
            [splat8(self.0, c); 2]
        }

        #[inline(always)]
        fn eq(self, v: Self::V, c: Self::V) -> u64 {
            u64::from(lanes_eq(self.0, v[0], c[0])) | u64::from(lanes_eq(self.0, v[1], c[1])) << 32
        }

        #[inline(always)]
        fn outside(self, v: Self::V, lo: Self::V, k: Self::V) -> u64 {
            u64::from(outside(self.0, v[0], lo[0], k[0]))
                | u64::from(outside(self.0, v[1], lo[1], k[1])) << 32
        }

        #[inline(always)]
        fn bytes(v: Self::V) -> [u8; BLOCK] {
            pulp::cast(v)
        }

        #[inline(always)]
        fn differ(self, old: &[u16; BLOCK], new: &[u16; BLOCK]) -> u64 {
            let (o0, o1) = old.split_at(LANES);
            let (n0, n1) = new.split_at(LANES);
            let (oa, ob) = halves(o0);
            let (na, nb) = halves(n0);
            let lo = differ(self.0, load(oa), load(ob), load(na), load(nb));
            let (oa, ob) = halves(o1);
            let (na, nb) = halves(n1);
            let hi = differ(self.0, load(oa), load(ob), load(na), load(nb));
            u64::from(lo) | u64::from(hi) << 32
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod v4 {
    //! The AVX-512 BW forms, through `pulp`'s `V4` token like the AVX2 ones through `V3`: a
    //! block of 64 base values is classified into one register of 64 class bytes, and a
    //! byte comparison yields a class's lanes as a 64-bit mask in one instruction, where AVX2
    //! needs two comparisons, two mask moves and a shift.

    use core::arch::x86_64::__m512i;

    use pulp::x86::V4;

    use super::{BLOCK, EXP_CLASSES, EXP_LO};

    /// A block as one register of 64 class bytes.
    #[derive(Debug, Clone, Copy)]
    pub(super) struct Blocks(pub(super) V4);

    impl Blocks {
        /// The classes of 32 base values, one per 16-bit lane: the exponent field, less
        /// `EXP_LO` (saturating at 0), at most `EXP_CLASSES - 1`.
        #[inline(always)]
        fn class16(self, w: __m512i) -> __m512i {
            let x = self.0.avx512bw;
            let e = x._mm512_srli_epi16::<8>(x._mm512_slli_epi16::<1>(w));
            let lo = self.0.avx512f._mm512_set1_epi16(EXP_LO as i16);
            let top = self.0.avx512f._mm512_set1_epi16(EXP_CLASSES as i16 - 1);
            x._mm512_min_epu16(x._mm512_subs_epu16(e, lo), top)
        }
    }

    impl super::Blocks for Blocks {
        type V = __m512i;

        #[inline(always)]
        fn classes(self, block: &[u16; BLOCK]) -> __m512i {
            let (a, b) = pulp::as_arrays::<32, u16>(block).0.split_at(1);
            let a = self.class16(pulp::cast(a[0]));
            let b = self.class16(pulp::cast(b[0]));
            // packus works per 128-bit lane: (a0-7, b0-7, a8-15, b8-15, ...) as 64-bit words
            // a0 b0 a1 b1 a2 b2 a3 b3; put the a words first, in order.
            let packed = self.0.avx512bw._mm512_packus_epi16(a, b);
            let order = self.0.avx512f._mm512_set_epi64(7, 5, 3, 1, 6, 4, 2, 0);
            self.0.avx512f._mm512_permutexvar_epi64(order, packed)
        }

        #[inline(always)]
        fn splat(self, c: usize) -> __m512i {
            self.0.avx512f._mm512_set1_epi8(c as i8)
        }

        #[inline(always)]
        fn eq(self, v: __m512i, c: __m512i) -> u64 {
            self.0.avx512bw._mm512_cmpeq_epi8_mask(v, c)
        }

        #[inline(always)]
        fn outside(self, v: __m512i, lo: __m512i, k: __m512i) -> u64 {
            // v − lo wraps for v < lo, so "≥ k" covers both sides.
            let x = self.0.avx512bw;
            x._mm512_cmpge_epu8_mask(x._mm512_sub_epi8(v, lo), k)
        }

        #[inline(always)]
        fn bytes(v: __m512i) -> [u8; BLOCK] {
            pulp::cast(v)
        }

        #[inline(always)]
        fn differ(self, old: &[u16; BLOCK], new: &[u16; BLOCK]) -> u64 {
            let (o, _) = pulp::as_arrays::<32, u16>(old);
            let (n, _) = pulp::as_arrays::<32, u16>(new);
            let x = self.0.avx512bw;
            let lo = x._mm512_cmpneq_epi16_mask(pulp::cast(o[0]), pulp::cast(n[0]));
            let hi = x._mm512_cmpneq_epi16_mask(pulp::cast(o[1]), pulp::cast(n[1]));
            u64::from(lo) | u64::from(hi) << 32
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Every form of the rank selection: sparse and dense, at each instruction set (one this
    /// CPU lacks falls back to a narrower one, so the AVX2 forms are tested on an AVX-512 CPU;
    /// the dense form at `Avx512` is the AVX2 one).
    const FORMS: [(bool, Level); 6] = [
        (false, Level::Scalar),
        (true, Level::Scalar),
        (false, Level::Avx2),
        (true, Level::Avx2),
        (false, Level::Avx512),
        (true, Level::Avx512),
    ];

    fn ranks_reference(base: &[u16], positions: &[u64]) -> (Vec<u32>, [u32; EXP_CLASSES]) {
        let mut cnt = [0u32; EXP_CLASSES];
        let mut ranks = Vec::new();
        let mut next = positions.iter().peekable();
        for (i, &b) in base.iter().enumerate() {
            let c = usize::from(class_of(b));
            if next.next_if(|&&p| p == i as u64).is_some() {
                ranks.push(cnt[c]);
            }
            cnt[c] += 1;
        }
        (ranks, cnt)
    }

    /// Bases that stress the window: weight-like values, every class, runs of one class,
    /// values drifting across the classes (so the window must move), zeros and NaNs.
    fn base_of(kind: u8, seed: u64, len: usize) -> Vec<u16> {
        (0..len as u64)
            .map(|i| {
                let h = (i ^ seed.rotate_left(17)).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
                match kind % 5 {
                    0 => {
                        let e = 110 + (h % 18) as u16;
                        ((h >> 8) as u16 & 0x8000) | (e << 7) | ((h >> 16) as u16 & 0x7F)
                    }
                    1 => (h >> 3) as u16,
                    2 => [0x3F80u16, 0x0000, 0x7FC0, 0x8000, 0x0001][(i / 97 % 5) as usize],
                    3 => {
                        // Exponent drifting from 96 to 140 across the range.
                        let e = 96 + (i * 44 / len.max(1) as u64) as u16 + (h % 3) as u16;
                        (e.min(255) << 7) | (h as u16 & 0x7F)
                    }
                    _ => (h as u16) & 0x80FF,
                }
            })
            .collect()
    }

    fn check(base: &[u16], positions: &[u64]) {
        let (want, want_totals) = ranks_reference(base, positions);
        let mut ranks = Vec::new();
        let totals = ranks_at(base, positions, &mut ranks);
        assert_eq!(ranks, want);
        assert_eq!(totals, want_totals);
        // The same through the fused diff, with the changes made real.
        let mut new = base.to_vec();
        for &p in positions {
            new[p as usize] ^= 0x0001;
        }
        let (mut pos, mut old, mut nw, mut rk) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let totals = diff_ranked(
            base,
            &new,
            &mut RankOut {
                positions: &mut pos,
                old: &mut old,
                new: &mut nw,
                ranks: &mut rk,
            },
        );
        assert_eq!(pos, positions);
        assert_eq!(rk, want);
        assert_eq!(totals, want_totals);
        for (k, &p) in pos.iter().enumerate() {
            assert_eq!(old[k], base[p as usize]);
            assert_eq!(nw[k], new[p as usize]);
        }
        // The countdown finds exactly these positions from the gaps the ranks give.
        let mut rem = [0u32; EXP_CLASSES];
        let mut next_gaps: Vec<Vec<u32>> = vec![Vec::new(); EXP_CLASSES];
        let mut last = [0u32; EXP_CLASSES];
        for (&p, &r) in positions.iter().zip(&want) {
            let c = usize::from(class_of(base[p as usize]));
            next_gaps[c].push(r - last[c]);
            last[c] = r + 1;
        }
        for c in 0..EXP_CLASSES {
            next_gaps[c].push(want_totals[c] - last[c]);
            next_gaps[c].reverse();
            rem[c] = next_gaps[c].pop().expect("a first gap");
        }
        let gaps_then = next_gaps.clone();
        let rem_then = rem;
        let mut found = Vec::new();
        countdown(base, &mut rem, &mut |p, c| {
            found.push(p);
            next_gaps[c].pop().ok_or(())
        })
        .expect("consistent gaps");
        assert_eq!(found, positions);
        assert!(rem.iter().all(|&r| r == 0));
        // So does the rank selection, vector and scalar, from the ranks themselves.
        let mut by_class: Vec<Vec<u32>> = vec![Vec::new(); EXP_CLASSES];
        for (&p, &r) in positions.iter().zip(&want) {
            by_class[usize::from(class_of(base[p as usize]))].push(r);
        }
        let flat: Vec<u32> = by_class.concat();
        let mut start = [0usize; EXP_CLASSES + 1];
        for c in 0..EXP_CLASSES {
            start[c + 1] = start[c] + by_class[c].len();
        }
        let lists = ClassRanks {
            ranks: &flat,
            start,
        };
        for (dense, level) in FORMS {
            let mut found = Vec::new();
            let sel = select_ranks_at(base, &lists, &mut found, dense, level);
            assert!(
                found
                    .iter()
                    .map(|&p| u64::from(p))
                    .eq(positions.iter().copied())
            );
            assert_eq!(sel.totals, want_totals);
            assert!((0..EXP_CLASSES).all(|c| sel.found[c] == by_class[c].len()));
        }
        let (mut cur, mut cnt, mut found) = (
            start[..EXP_CLASSES].try_into().expect("32"),
            [0; EXP_CLASSES],
            Vec::new(),
        );
        select_ranks_scalar(base, 0, &lists, &mut cur, &mut cnt, &mut found);
        assert!(
            found
                .iter()
                .map(|&p| u64::from(p))
                .eq(positions.iter().copied())
        );
        assert_eq!(cnt, want_totals);
        // A rank beyond its class is never found, and the others still are.
        if let Some(c) = (0..EXP_CLASSES).find(|&c| !by_class[c].is_empty()) {
            let mut more = by_class.clone();
            more[c].push(want_totals[c]);
            let flat: Vec<u32> = more.concat();
            let mut start = [0usize; EXP_CLASSES + 1];
            for c in 0..EXP_CLASSES {
                start[c + 1] = start[c] + more[c].len();
            }
            for (dense, level) in FORMS {
                let mut found = Vec::new();
                let lists = ClassRanks {
                    ranks: &flat,
                    start,
                };
                let sel = select_ranks_at(base, &lists, &mut found, dense, level);
                assert!(
                    found
                        .iter()
                        .map(|&p| u64::from(p))
                        .eq(positions.iter().copied())
                );
                assert_eq!(sel.found[c], by_class[c].len());
            }
        }
        // The scalar paths (what runs without AVX2) on their own.
        let (mut rem, mut next_gaps) = (rem_then, gaps_then);
        let mut found = Vec::new();
        countdown_scalar(base, 0, &mut rem, &mut |p, c| {
            found.push(p);
            next_gaps[c].pop().ok_or(())
        })
        .expect("consistent gaps");
        assert_eq!(found, positions);
        let mut ranks = Vec::new();
        let (mut p, mut o, mut n) = (Vec::new(), Vec::new(), Vec::new());
        let mut out = RankOut {
            positions: &mut p,
            old: &mut o,
            new: &mut n,
            ranks: &mut ranks,
        };
        let totals = rank_scalar(base, Changes::Diff(&new), &mut out, [0; EXP_CLASSES]);
        assert_eq!((ranks, totals), (want.clone(), want_totals));
        assert_eq!(p, positions);
        // The ranking scan at every instruction set, from positions and fused with the diff.
        for level in [Level::Scalar, Level::Avx2, Level::Avx512] {
            let (mut p, mut o, mut n, mut ranks) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            let mut out = RankOut {
                positions: &mut p,
                old: &mut o,
                new: &mut n,
                ranks: &mut ranks,
            };
            let totals = rank_at(base, Changes::At(positions), &mut out, level);
            assert_eq!((&ranks, totals), (&want, want_totals), "{level:?}");
            ranks.clear();
            let mut out = RankOut {
                positions: &mut p,
                old: &mut o,
                new: &mut n,
                ranks: &mut ranks,
            };
            let totals = rank_at(base, Changes::Diff(&new), &mut out, level);
            assert_eq!((&ranks, totals), (&want, want_totals), "{level:?}");
            assert_eq!(p, positions, "{level:?}");
            for (k, &q) in p.iter().enumerate() {
                assert_eq!(
                    (o[k], n[k]),
                    (base[q as usize], new[q as usize]),
                    "{level:?}"
                );
            }
        }
    }

    #[test]
    fn select64_finds_every_set_bit() {
        // Every rank of masks with every population: edge bytes, all ones, a pseudo-random walk.
        let mut masks = vec![
            1u64,
            1 << 63,
            u64::MAX,
            0x8000_0000_0000_0001,
            0x00FF_00FF_00FF_00FF,
        ];
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..2000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            masks.push(x);
            masks.push(x & x.rotate_left(11) & x.rotate_left(29));
        }
        for m in masks {
            let set: Vec<u32> = (0..64).filter(|&b| m >> b & 1 == 1).collect();
            for (r, &want) in set.iter().enumerate() {
                assert_eq!(select64(m, r as u32), want, "{m:#018x} rank {r}");
            }
        }
    }

    #[test]
    fn class_of_equals_the_table() {
        for b in 0..=u16::MAX {
            assert_eq!(
                usize::from(class_of(b)),
                super::super::rc::exp_class(b),
                "{b:#06x}"
            );
        }
    }

    #[test]
    fn scans_agree_with_the_reference_on_long_and_drifting_ranges() {
        for kind in 0..5u8 {
            for len in [0usize, 1, 31, 32, 33, 1000, 70_000, 200_003] {
                let base = base_of(kind, len as u64, len);
                for every in [1u64, 2, 7, 97, 1000] {
                    let positions: Vec<u64> = (0..len as u64)
                        .filter(|i| (i.wrapping_mul(0xD6E8_FEB8_6659_FD93) >> 50) % every == 0)
                        .collect();
                    check(&base, &positions);
                }
            }
        }
    }

    proptest! {
        #[test]
        fn scans_agree_with_the_reference(
            bits in proptest::collection::vec((any::<u16>(), any::<u8>()), 0..2000),
            density in 0u8..=255,
            kind in 0u8..6,
        ) {
            let base: Vec<u16> = if kind == 5 {
                bits.iter().map(|b| b.0).collect()
            } else {
                base_of(kind, bits.len() as u64, bits.len())
            };
            let positions: Vec<u64> = bits
                .iter()
                .enumerate()
                .filter(|(_, b)| density == 255 || b.1 < density)
                .map(|(i, _)| i as u64)
                .collect();
            check(&base, &positions);
        }
    }
}

#[cfg(test)]
mod timing {
    use super::*;

    /// `cargo test --release -p starling-proto scan_speed -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn scan_speed() {
        let n = 1 << 22;
        let mut next = super::super::synthetic::XorShift::default();
        let base = super::super::synthetic::weights(&mut next, n);
        let mut next = || next.next_u64();
        for per_mille in [3u64, 10, 20, 50] {
            let positions: Vec<u64> = (0..n as u64)
                .filter(|_| next() % 1000 < per_mille)
                .collect();
            let mut ranks = Vec::new();
            let totals = ranks_at(&base, &positions, &mut ranks);
            let mut gaps: Vec<Vec<u32>> = vec![Vec::new(); EXP_CLASSES];
            let mut last = [0u32; EXP_CLASSES];
            for (&p, &r) in positions.iter().zip(&ranks) {
                let c = usize::from(class_of(base[p as usize]));
                gaps[c].push(r - last[c]);
                last[c] = r + 1;
            }
            for c in 0..EXP_CLASSES {
                gaps[c].push(totals[c] - last[c]);
                gaps[c].reverse();
            }
            // This thread's CPU time (the machine is shared: wall time includes waiting).
            let cpu = || -> f64 {
                // A yield makes the kernel account the running slice first.
                std::thread::yield_now();
                std::fs::read_to_string("/proc/thread-self/schedstat")
                    .ok()
                    .and_then(|s| s.split_whitespace().next()?.parse::<f64>().ok())
                    .map_or_else(
                        || {
                            std::time::SystemTime::now()
                                .duration_since(std::time::UNIX_EPOCH)
                                .map_or(0.0, |d| d.as_secs_f64())
                        },
                        |ns| ns / 1e9,
                    )
            };
            let best = |f: &mut dyn FnMut()| {
                let mut b = f64::MAX;
                for _ in 0..7 {
                    let t = cpu();
                    f();
                    b = b.min(cpu() - t);
                }
                b * 1e9 / n as f64
            };
            let run = |scalar: bool| {
                let mut g = gaps.clone();
                let mut rem = [0u32; EXP_CLASSES];
                for c in 0..EXP_CLASSES {
                    rem[c] = g[c].pop().unwrap_or(0);
                }
                let mut f = |_p: u64, c: usize| g[c].pop().ok_or(());
                if scalar {
                    countdown_scalar(&base, 0, &mut rem, &mut f)
                } else {
                    countdown(&base, &mut rem, &mut f)
                }
                .expect("consistent");
            };
            let (td, ts) = (best(&mut || run(false)), best(&mut || run(true)));
            let mut r = Vec::new();
            let tr = best(&mut || {
                r.clear();
                ranks_at(&base, &positions, &mut r);
            });
            println!(
                "density {:.1}%: countdown {td:.3} ns/elem (scalar {ts:.3}), ranks {tr:.3} ns/elem; per change: countdown {:.1} ns, ranks {:.1} ns",
                per_mille as f64 / 10.0,
                td * n as f64 / positions.len() as f64,
                tr * n as f64 / positions.len() as f64,
            );
        }
    }
}

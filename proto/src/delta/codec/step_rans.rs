//! [`ValueCodec::UlpStepRans`](super::ValueCodec::UlpStepRans): the zigzag ULP step of
//! [`UlpStepRc`](super::ValueCodec::UlpStepRc), in the same contexts (the base value's
//! exponent class and sign), coded with a static three-symbol table per context through
//! [`super::rans`]: −1 ULP, +1 ULP, or another step, which follows as raw bits.
//!
//! Why: two adaptive updates per change become one table step with no slot map (two
//! comparisons pick the symbol). A context's table costs two parameter bytes, fitted by the
//! encoder to the part. Exact layout: `docs/format.md`.

use super::rans::{EncSymbol, RansDecoder, RansEncoder, Table, ratio255};
use super::rc::{EXP_CLASSES, exp_class};
use crate::error::DecodeError;

const WHAT: &str = "ulp step values (rANS)";
const CONTEXTS: usize = 2 * EXP_CLASSES;
/// Bits of the length field of an escaped step.
const OTHER_LEN_BITS: u32 = 5;
/// Steps other than ±1 ULP: `z = 3 + s` for symbols `s < OTHER_DIRECT` (±2 … ±8 ULP) of the
/// part's shared table; its last symbol escapes to raw bits (`z = 0` or `z ≥ 3 + OTHER_DIRECT`).
const OTHER_DIRECT: usize = 15;
const OTHER_SYMBOLS: usize = OTHER_DIRECT + 1;
const ONE: u128 = 1 << 32;

#[inline(always)]
fn context(base: u16) -> usize {
    (exp_class(base) * 2 + usize::from(base >> 15)) & (CONTEXTS - 1)
}

/// [`context`] by arithmetic (the class as [`super::scan::class_of`] computes it), so that a
/// loop over many changes vectorizes.
#[inline(always)]
fn context_arith(base: u16) -> usize {
    usize::from(super::scan::class_of(base)) * 2 + usize::from(base >> 15)
}

/// Lanes of the symbol histogram: consecutive changes count into different copies, so an
/// increment never waits for the store of the one before it to the same counter.
const COUNT_LANES: usize = 4;

/// The changes per context and symbol, and the shared table's symbols of the other steps,
/// from the changes' codes (`3 · context + symbol`).
fn count_codes(
    codes: &[u8],
    new: &[u16],
    old: &[u16],
    zigzag: impl Fn(u16, u16) -> u16,
) -> ([[u64; 3]; CONTEXTS], [u64; OTHER_SYMBOLS]) {
    let mut lanes = [[0u64; 3 * CONTEXTS]; COUNT_LANES];
    let mut other_counts = [0u64; OTHER_SYMBOLS];
    let (quads, rest) = codes.as_chunks::<COUNT_LANES>();
    for (i, q) in quads.iter().enumerate() {
        for (lane, &c) in lanes.iter_mut().zip(q) {
            lane[usize::from(c)] += 1;
        }
        if q.iter().any(|&c| c % 3 == 2) {
            for (j, &c) in q.iter().enumerate() {
                if c % 3 == 2 {
                    let at = i * COUNT_LANES + j;
                    other_counts[other_symbol(zigzag(old[at], new[at]))] += 1;
                }
            }
        }
    }
    let tail = quads.len() * COUNT_LANES;
    for (j, &c) in rest.iter().enumerate() {
        lanes[0][usize::from(c)] += 1;
        if c % 3 == 2 {
            other_counts[other_symbol(zigzag(old[tail + j], new[tail + j]))] += 1;
        }
    }
    let mut counts = [[0u64; 3]; CONTEXTS];
    for (code, n) in counts.iter_mut().flatten().enumerate() {
        *n = lanes.iter().map(|l| l[code]).sum();
    }
    (counts, other_counts)
}

/// A context's table from its parameter bytes: `P(±1) = u/255`, `P(+1 | ±1) = v/255`.
fn table(u: u8, v: u8) -> Table {
    let frac = |b: u8| u128::from(b) * ONE / 255;
    let (u, v) = (frac(u), frac(v));
    Table::from_weights(&[
        ((u * (ONE - v)) >> 32) as u64,
        ((u * v) >> 32) as u64,
        (ONE - u) as u64,
    ])
}

/// The symbol of zigzag step `z`: 0 for −1 ULP (`z = 1`), 1 for +1 (`z = 2`), 2 otherwise
/// (arithmetic, not a branch: the CPU cannot predict the step).
#[inline(always)]
fn symbol(z: u16) -> usize {
    2 - usize::from(z == 2) - 2 * usize::from(z == 1)
}

/// The symbol of a step other than ±1 in the shared table.
#[inline(always)]
fn other_symbol(z: u16) -> usize {
    if z >= 3 && usize::from(z) < 3 + OTHER_DIRECT {
        usize::from(z) - 3
    } else {
        OTHER_DIRECT
    }
}

/// The shared table of other steps from its parameter bytes: symbol `s` weighs `b[s]²`.
fn other_table(b: &[u8; OTHER_SYMBOLS]) -> Table {
    let w: Vec<u64> = b.iter().map(|&x| u64::from(x) * u64::from(x)).collect();
    Table::from_weights(&w)
}

/// Parameter bytes for the shared table: `⌈255 · √(count / max)⌉`, so that a weight `b²`
/// follows the counts and rare steps keep a non-zero byte.
fn other_params(counts: &[u64; OTHER_SYMBOLS]) -> [u8; OTHER_SYMBOLS] {
    let max = counts.iter().copied().max().unwrap_or(0).max(1) as f64;
    counts.map(|c| (255.0 * (c as f64 / max).sqrt()).ceil().min(255.0) as u8)
}

/// Encodes the steps from `old` to `new` at a part's changes. Also returns, from the same
/// counts, a lower bound in bytes of any order-0 code of the byte tokens of
/// [`UlpResidualZstd`](super::ValueCodec::UlpResidualZstd): the entropy of the steps with
/// −1, +1, each shared-table step and the escaped rest as symbols, which merges tokens (and
/// merging symbols only lowers an entropy). The caller sizes the zstd candidate with it
/// without a second pass over the changes.
pub(super) fn encode(
    new: &[u16],
    old: &[u16],
    zigzag: impl Fn(u16, u16) -> u16,
) -> (Vec<u8>, usize) {
    // Each change's table symbol `3 · context + symbol`, in one pass the compiler vectorizes
    // (the class by arithmetic, not the table lookup); the encoding pass below reads it back.
    let codes: Vec<u8> = new
        .iter()
        .zip(old)
        .map(|(&n, &o)| (3 * context_arith(o) + symbol(zigzag(o, n))) as u8)
        .collect();
    let (counts, other_counts) = count_codes(&codes, new, old, &zigzag);
    let order0 = order0_bytes(&counts, &other_counts, new.len());
    let other_bytes = other_params(&other_counts);
    let others = other_table(&other_bytes);
    let ratio = ratio255;
    let mut mask = 0u64;
    let mut out = Vec::with_capacity(new.len() / 4 + 32);
    out.extend_from_slice(&[0; 8]);
    // Context `c`'s symbols are `symbols[3c..3c + 3]`.
    let mut symbols = [EncSymbol::default(); 3 * CONTEXTS];
    for (ctx, [down, up, other]) in counts.iter().enumerate() {
        let n = down + up + other;
        if n == 0 {
            continue;
        }
        mask |= 1 << ctx;
        let (u, v) = (ratio(down + up, n), ratio(*up, down + up));
        out.extend_from_slice(&[u, v]);
        let t = table(u, v);
        for s in 0..3 {
            symbols[3 * ctx + s] = t.enc_symbol(s);
        }
    }
    out[..8].copy_from_slice(&mask.to_le_bytes());
    out.extend_from_slice(&other_bytes);
    let mut e = RansEncoder::with_capacity(new.len() / 8 + 16);
    for (&code, (&n, &o)) in codes.iter().zip(new.iter().zip(old)).rev() {
        // Every context with a change is in the mask.
        let code = usize::from(code);
        if code % 3 == 2 {
            let z = zigzag(o, n);
            let o = other_symbol(z);
            if o == OTHER_DIRECT {
                let v = u64::from(if z == 0 { 0 } else { z - 2 }) + 1;
                let len = 64 - v.leading_zeros();
                e.put_raw(v as u32, len - 1);
                e.put_raw(len, OTHER_LEN_BITS);
            }
            e.put_symbol(&others, o);
        }
        e.put_enc(symbols[code]);
    }
    out.extend_from_slice(&e.finish());
    (out, order0)
}

/// The entropy in bytes of `n` steps counted as −1, +1 (per context) and the shared table's
/// symbols.
fn order0_bytes(counts: &[[u64; 3]; CONTEXTS], others: &[u64; OTHER_SYMBOLS], n: usize) -> usize {
    let down: u64 = counts.iter().map(|c| c[0]).sum();
    let up: u64 = counts.iter().map(|c| c[1]).sum();
    let total = n as f64;
    let bits: f64 = [down, up]
        .iter()
        .chain(others)
        .filter(|&&h| h > 0)
        .map(|&h| -(h as f64) * (h as f64 / total).log2())
        .sum();
    (bits / 8.0) as usize
}

/// Decodes `old.len()` steps and applies each to its base value.
pub(super) fn decode(
    bytes: &[u8],
    old: &[u16],
    apply: impl Fn(u16, u16) -> u16,
) -> Result<Vec<u16>, DecodeError> {
    let Some((mask, mut rest)) = bytes.split_first_chunk::<8>() else {
        return Err(DecodeError::Truncated { what: WHAT });
    };
    let mask = u64::from_le_bytes(*mask);
    // `freq[ctx]`: the first two frequencies of a present context's table; absent ones
    // stay `None`.
    let mut freq = [None; CONTEXTS];
    for (ctx, f) in freq.iter_mut().enumerate() {
        if mask >> ctx & 1 == 0 {
            continue;
        }
        let Some((&[u, v], r)) = rest.split_first_chunk::<2>() else {
            return Err(DecodeError::Truncated { what: WHAT });
        };
        rest = r;
        let t = table(u, v);
        *f = Some((t.symbol(0).0, t.symbol(1).0));
    }
    let Some((other_bytes, rest)) = rest.split_first_chunk::<OTHER_SYMBOLS>() else {
        return Err(DecodeError::Truncated { what: WHAT });
    };
    let others = other_table(other_bytes);
    let mut other_slots = [0u8; super::rans::M as usize];
    others.fill_slots(&mut other_slots);
    let mut d = RansDecoder::new(rest, WHAT)?;
    let mut out = Vec::with_capacity(old.len());
    for &o in old {
        let Some((f0, f1)) = freq[context(o)] else {
            return Err(DecodeError::malformed(
                WHAT,
                "a change in a context the header does not list",
            ));
        };
        let s = d.get3(f0, f1);
        // −1 and +1 ULP are a coin toss: arithmetic for them, a branch only for the rarer
        // other steps.
        let z = if s < 2 {
            s as u16 + 1
        } else {
            let o = d.get(&other_slots, &others);
            if o < OTHER_DIRECT {
                o as u16 + 3
            } else {
                escaped(&mut d)?
            }
        };
        if d.overran() {
            return Err(DecodeError::Truncated { what: WHAT });
        }
        out.push(apply(o, z));
    }
    d.finish(WHAT)?;
    Ok(out)
}

/// An escaped step: its bit length, then the bits below the leading one.
fn escaped(d: &mut RansDecoder<'_>) -> Result<u16, DecodeError> {
    let len = d.get_raw(OTHER_LEN_BITS);
    if len == 0 || len > 16 {
        return Err(DecodeError::malformed(WHAT, "step length out of range"));
    }
    let v = (1u32 << (len - 1)) | d.get_raw(len - 1);
    match v - 1 {
        0 => Ok(0),
        x if x <= u32::from(u16::MAX) - 2 => Ok(x as u16 + 2),
        _ => Err(DecodeError::malformed(WHAT, "step beyond 16 bits")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_arithmetic_context_is_the_table_context() {
        for bits in 0..=u16::MAX {
            assert_eq!(context_arith(bits), context(bits), "{bits:#06x}");
        }
    }

    #[test]
    fn split_counts_equal_a_plain_count() {
        let zigzag = super::super::value::ulp_step_zigzag;
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        // Lengths around the histogram's lanes, steps mostly ±1 with some others.
        for len in [0, 1, 3, 4, 5, 1000, 1003] {
            let old: Vec<u16> = (0..len).map(|_| next() as u16).collect();
            let new: Vec<u16> = old
                .iter()
                .map(|&o| {
                    let r = next();
                    let step = match r % 8 {
                        0 => (r >> 8) as u16,
                        1..=4 => 1,
                        _ => u16::MAX,
                    };
                    o.wrapping_add(step)
                })
                .collect();
            let codes: Vec<u8> = new
                .iter()
                .zip(&old)
                .map(|(&n, &o)| (3 * context_arith(o) + symbol(zigzag(o, n))) as u8)
                .collect();
            let (counts, others) = count_codes(&codes, &new, &old, zigzag);
            let mut want = [[0u64; 3]; CONTEXTS];
            let mut want_others = [0u64; OTHER_SYMBOLS];
            for (&n, &o) in new.iter().zip(&old) {
                let z = zigzag(o, n);
                want[context(o)][symbol(z)] += 1;
                if symbol(z) == 2 {
                    want_others[other_symbol(z)] += 1;
                }
            }
            assert_eq!(counts, want, "len {len}");
            assert_eq!(others, want_others, "len {len}");
        }
    }

    #[test]
    fn tables_keep_every_symbol_codable() {
        for (u, v) in [(0, 0), (255, 255), (255, 0), (0, 255), (200, 128)] {
            let t = table(u, v);
            assert!((0..3).all(|s| t.symbol(s).0 >= 1));
            assert_eq!(
                t.symbol(0).0 + t.symbol(1).0 + t.symbol(2).0,
                super::super::rans::M
            );
        }
    }
}

#[cfg(test)]
mod timing {
    use super::super::synthetic::{XorShift, weights};
    use super::super::value::{apply_ulp_step_zigzag, ulp_step_zigzag};
    use super::*;

    /// `cargo test --release -p starling-proto timing -- --ignored --nocapture`: the step
    /// encoder and decoder alone, per change, on weight-like base values with ±1 ULP steps
    /// mostly (a part's changes: 40 k in cache, 1 M from memory); best of 15.
    #[test]
    #[ignore]
    fn ulp_step_rans_speed() {
        let mut rng = XorShift::default();
        for n in [40_000, 1 << 20] {
            let old = weights(&mut rng, n);
            let new: Vec<u16> = old
                .iter()
                .map(|&o| {
                    let r = rng.next_u64();
                    let step = match r % 16 {
                        0 => 2,
                        1 => 3,
                        2..=8 => 1,
                        _ => u16::MAX,
                    };
                    o.wrapping_add(step)
                })
                .collect();
            let best = |f: &mut dyn FnMut()| {
                (0..15)
                    .map(|_| {
                        let t = std::time::Instant::now();
                        f();
                        t.elapsed().as_secs_f64()
                    })
                    .fold(f64::MAX, f64::min)
                    * 1e9
                    / n as f64
            };
            let (bytes, _) = encode(&new, &old, ulp_step_zigzag);
            let enc = best(&mut || {
                std::hint::black_box(encode(&new, &old, ulp_step_zigzag));
            });
            let dec = best(&mut || {
                let got = decode(&bytes, &old, apply_ulp_step_zigzag).expect("decodes");
                std::hint::black_box(got);
            });
            assert_eq!(
                decode(&bytes, &old, apply_ulp_step_zigzag).expect("decodes"),
                new
            );
            println!(
                "ulp-step+rans, {n} changes: {:.3} bytes/change; encode {enc:.2} ns/change, decode {dec:.2} ns/change",
                bytes.len() as f64 / n as f64
            );
        }
    }
}

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
    let mut counts = [[0u64; 3]; CONTEXTS];
    let mut other_counts = [0u64; OTHER_SYMBOLS];
    for (&n, &o) in new.iter().zip(old) {
        let z = zigzag(o, n);
        let s = symbol(z);
        counts[context(o)][s] += 1;
        if s == 2 {
            other_counts[other_symbol(z)] += 1;
        }
    }
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
    for (&n, &o) in new.iter().zip(old).rev() {
        // Every context with a change is in the mask.
        let ctx = context(o);
        let z = zigzag(o, n);
        let s = symbol(z);
        if s == 2 {
            let o = other_symbol(z);
            if o == OTHER_DIRECT {
                let v = u64::from(if z == 0 { 0 } else { z - 2 }) + 1;
                let len = 64 - v.leading_zeros();
                e.put_raw(v as u32, len - 1);
                e.put_raw(len, OTHER_LEN_BITS);
            }
            e.put_symbol(&others, o);
        }
        e.put_enc(symbols[3 * ctx + s]);
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

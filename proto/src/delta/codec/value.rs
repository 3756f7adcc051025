//! Value codecs: the new BF16 bits at the changed positions of a sparse part.
//!
//! Most changes move a weight by ±1 ULP. [`ValueCodec::UlpResidualZstd`] codes the step in
//! *ordered* bit space (where consecutive BF16 values are consecutive integers and ±0 are
//! neighbours, so sign crossings near zero stay small): zigzag of the wrapping 16-bit
//! difference, as one byte token per change with an escape for large steps, then zstd.
//! Decoding adds the step back to the base bits and so yields absolute new bits.
//!
//! [`ValueCodec::UlpStepRc`] codes the same zigzag step with the adaptive range coder of
//! [`super::rc`], with one set of contexts per (exponent class, sign) of the base value:
//! how far a weight moves in ULPs depends on its magnitude, and whether it moves up or down
//! on its sign (weight decay pulls towards zero). Steps other than ±1 ULP go through an
//! adaptive Exp-Golomb escape shared by all contexts.

use super::rc::{Bit, EXP_CLASSES, IntModel, RangeDecoder, RangeEncoder, exp_class};
use super::{ValueCodec, ZstdPayload, zstd_compress, zstd_decompress};
use crate::error::DecodeError;
use crate::wire::{Reader, put_varint};

const ESCAPE_TOKEN: u8 = 0xFF;

/// Maps BF16 bits to an integer whose order is the order of the values (sign-magnitude
/// to offset binary). A bijection on `u16`; NaN patterns map to the ends.
#[inline]
pub fn ordered(bits: u16) -> u16 {
    if bits & 0x8000 != 0 {
        !bits
    } else {
        bits | 0x8000
    }
}

/// Inverse of [`ordered`].
#[inline]
pub fn from_ordered(key: u16) -> u16 {
    if key & 0x8000 != 0 {
        key & 0x7FFF
    } else {
        !key
    }
}

/// The ULP step from `old` to `new`, zigzag-coded: +0 → 0, −1 → 1, +1 → 2, −2 → 3, …
#[inline]
pub fn ulp_step_zigzag(old: u16, new: u16) -> u16 {
    let d = ordered(new).wrapping_sub(ordered(old)) as i16;
    ((d << 1) ^ (d >> 15)) as u16
}

#[inline]
pub(super) fn apply_ulp_step_zigzag(old: u16, z: u16) -> u16 {
    let d = ((z >> 1) as i16) ^ -((z & 1) as i16);
    from_ordered(ordered(old).wrapping_add(d as u16))
}

/// The contexts of [`ValueCodec::UlpStepRc`] for one (exponent class, sign) of the base.
#[derive(Debug, Clone, Copy, Default)]
struct StepContext {
    /// Is the step ±1 ULP (`z ∈ {1, 2}`)?
    unit: Bit,
    /// Given ±1 ULP: is it +1 (`z = 2`)?
    up: Bit,
}

/// The models of [`ValueCodec::UlpStepRc`].
#[derive(Debug)]
struct StepModel {
    ctx: Vec<StepContext>,
    /// Other steps: `0` for `z = 0` (no change), `z − 2` for `z ≥ 3`.
    other: IntModel,
}

impl StepModel {
    fn new() -> Self {
        Self {
            ctx: vec![StepContext::default(); 2 * EXP_CLASSES],
            other: IntModel::default(),
        }
    }

    #[inline]
    fn context(base: u16) -> usize {
        exp_class(base) * 2 + usize::from(base >> 15)
    }

    fn encode(&mut self, e: &mut RangeEncoder, base: u16, z: u16) {
        let ctx = &mut self.ctx[Self::context(base)];
        let unit = z == 1 || z == 2;
        e.bit(&mut ctx.unit, unit);
        if unit {
            e.bit(&mut ctx.up, z == 2);
        } else {
            self.other
                .encode(e, if z == 0 { 0 } else { u64::from(z) - 2 });
        }
    }

    fn decode(&mut self, d: &mut RangeDecoder<'_>, base: u16) -> Result<u16, DecodeError> {
        let ctx = &mut self.ctx[Self::context(base)];
        if d.bit(&mut ctx.unit) {
            // Up or down is a coin toss for the CPU: arithmetic, not a branch.
            return Ok(1 + u16::from(d.bit(&mut ctx.up)));
        }
        match self.other.decode(d) {
            0 => Ok(0),
            x if x <= u64::from(u16::MAX) - 2 => Ok(x as u16 + 2),
            _ => Err(DecodeError::malformed(
                "ulp step values",
                "step beyond 16 bits",
            )),
        }
    }
}

/// A lower bound, in bytes, of what the byte tokens of [`ValueCodec::UlpResidualZstd`] cost
/// under any order-0 coder: the entropy of the ULP steps with every step of 15 or more
/// counted as one symbol (merging symbols only lowers an entropy).
pub fn step_order0_bytes(old: &[u16], new: &[u16]) -> usize {
    let mut hist = [0u64; 16];
    for (&o, &n) in old.iter().zip(new) {
        hist[usize::from(ulp_step_zigzag(o, n).min(15))] += 1;
    }
    let total = old.len() as f64;
    let bits: f64 = hist
        .iter()
        .filter(|&&h| h > 0)
        .map(|&h| -(h as f64) * (h as f64 / total).log2())
        .sum();
    (bits / 8.0) as usize
}

/// Encodes `new` (the values at the changed positions; `old` holds the base values there).
pub fn encode(codec: ValueCodec, new: &[u16], old: &[u16], zstd_level: i32) -> Vec<u8> {
    debug_assert_eq!(new.len(), old.len());
    match codec {
        ValueCodec::Raw => new.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ValueCodec::RawZstd => zstd_compress(&planes(new), zstd_level, ZstdPayload::General),
        ValueCodec::UlpResidualZstd => {
            // The tokens in one branch-free pass the compiler vectorizes (a step of 255 or
            // more becomes the escape token), then the escapes at the escape tokens only (a
            // per-change branch and push cost 10% of the fast set's encode).
            let tokens: Vec<u8> = new
                .iter()
                .zip(old)
                .map(|(&n, &o)| ulp_step_zigzag(o, n).min(u16::from(ESCAPE_TOKEN)) as u8)
                .collect();
            let escapes = tokens.iter().filter(|&&t| t == ESCAPE_TOKEN).count();
            let mut raw = Vec::with_capacity(tokens.len() + 2 * escapes + 10);
            put_varint(&mut raw, escapes as u64);
            raw.extend_from_slice(&tokens);
            for i in escape_indices(&tokens, escapes) {
                raw.extend_from_slice(&ulp_step_zigzag(old[i], new[i]).to_le_bytes());
            }
            zstd_compress(&raw, zstd_level, ZstdPayload::Tokens)
        }
        ValueCodec::UlpStepRc => {
            let mut m = StepModel::new();
            let mut e = RangeEncoder::with_capacity(new.len() / 4 + 16);
            for (&n, &o) in new.iter().zip(old) {
                m.encode(&mut e, o, ulp_step_zigzag(o, n));
            }
            e.finish()
        }
        ValueCodec::UlpStepRans => encode_ulp_step_rans(new, old).0,
    }
}

/// [`ValueCodec::UlpStepRans`]'s bytes and, from the same pass, a lower bound of what
/// [`ValueCodec::UlpResidualZstd`]'s tokens cost under any order-0 coder, like
/// [`step_order0_bytes`] but from a grouping of the tokens that tells ±2 … ±8 ULP apart.
pub fn encode_ulp_step_rans(new: &[u16], old: &[u16]) -> (Vec<u8>, usize) {
    super::step_rans::encode(new, old, ulp_step_zigzag)
}

/// Decodes `count` new values. `old` must be the base values at the decoded positions
/// when the codec [needs the base](ValueCodec::needs_base).
pub fn decode(
    codec: ValueCodec,
    bytes: &[u8],
    count: usize,
    old: Option<&[u16]>,
) -> Result<Vec<u16>, DecodeError> {
    match codec {
        ValueCodec::Raw => {
            if bytes.len() != count * 2 {
                return Err(DecodeError::malformed(
                    "raw values",
                    format!("{} bytes for {count} values", bytes.len()),
                ));
            }
            Ok(bytes
                .chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]))
                .collect())
        }
        ValueCodec::RawZstd => {
            let raw = zstd_decompress(bytes, count * 2, "raw values")?;
            unplanes(&raw, count, "raw values")
        }
        ValueCodec::UlpResidualZstd => {
            let mut out = Vec::new();
            decode_residuals_into(bytes, count, old, &mut out)?;
            Ok(out)
        }
        ValueCodec::UlpStepRc => {
            const WHAT: &str = "ulp step values";
            let Some(old) = old.filter(|o| o.len() == count) else {
                return Err(DecodeError::malformed(
                    WHAT,
                    format!("decoding needs the {count} base values at the positions"),
                ));
            };
            let mut m = StepModel::new();
            let mut d = RangeDecoder::new(bytes);
            let mut out = Vec::with_capacity(count);
            for &o in old {
                let z = m.decode(&mut d, o)?;
                if d.overran() {
                    return Err(DecodeError::Truncated { what: WHAT });
                }
                out.push(apply_ulp_step_zigzag(o, z));
            }
            d.finish(WHAT)?;
            Ok(out)
        }
        ValueCodec::UlpStepRans => {
            let Some(old) = old.filter(|o| o.len() == count) else {
                return Err(DecodeError::malformed(
                    "ulp step values (rANS)",
                    format!("decoding needs the {count} base values at the positions"),
                ));
            };
            super::step_rans::decode(bytes, old, apply_ulp_step_zigzag)
        }
    }
}

/// [`decode`] into `out` (cleared first, its capacity reused): a receiver decodes straight
/// into the vector its undo log keeps, with no copy.
pub fn decode_into(
    codec: ValueCodec,
    bytes: &[u8],
    count: usize,
    old: Option<&[u16]>,
    out: &mut Vec<u16>,
) -> Result<(), DecodeError> {
    if codec == ValueCodec::UlpResidualZstd {
        return decode_residuals_into(bytes, count, old, out);
    }
    let decoded = decode(codec, bytes, count, old)?;
    if out.capacity() == 0 {
        // Nothing to reuse: keep the decoder's vector rather than copy it.
        *out = decoded;
    } else {
        // A recycled vector: copying into it costs less than the fresh pages a long-lived
        // new vector takes (the decoder's is freed at once and reused).
        out.clear();
        out.extend_from_slice(&decoded);
    }
    Ok(())
}

/// [`ValueCodec::UlpResidualZstd`]'s decoder, into `out` (cleared first).
fn decode_residuals_into(
    bytes: &[u8],
    count: usize,
    old: Option<&[u16]>,
    out: &mut Vec<u16>,
) -> Result<(), DecodeError> {
    let Some(old) = old else {
        return Err(DecodeError::malformed(
            "ulp residual values",
            "decoding needs the base values",
        ));
    };
    if old.len() != count {
        return Err(DecodeError::malformed(
            "ulp residual values",
            format!("{} base values for {count} changes", old.len()),
        ));
    }
    let raw = zstd_decompress(bytes, 10 + count * 3, "ulp residual values")?;
    let mut r = Reader::new(&raw);
    let n_escapes = r.varint_at_most("escape count", count as u64)? as usize;
    let tokens = r.take(count, "residual tokens")?;
    let escapes = r.take(n_escapes * 2, "residual escapes")?;
    r.finish("ulp residual values")?;
    let escape_tokens = tokens.iter().filter(|&&t| t == ESCAPE_TOKEN).count();
    if escape_tokens != n_escapes {
        return Err(DecodeError::malformed(
            "ulp residual values",
            if escape_tokens > n_escapes {
                "more escape tokens than escapes"
            } else {
                "fewer escape tokens than escapes"
            },
        ));
    }
    // Every value in one pass the compiler vectorizes (an escape token as a step of 255),
    // then the escapes put right.
    out.clear();
    out.extend(
        tokens
            .iter()
            .zip(old)
            .map(|(&t, &o)| apply_ulp_step_zigzag(o, u16::from(t))),
    );
    for (i, z) in escape_indices(tokens, n_escapes).zip(escapes.chunks_exact(2)) {
        out[i] = apply_ulp_step_zigzag(old[i], u16::from_le_bytes([z[0], z[1]]));
    }
    Ok(())
}

/// The indices of the escape tokens among `tokens`, of which there are `count`: 64 tokens at
/// a time are skipped with one vectorized search where they hold none.
fn escape_indices(tokens: &[u8], count: usize) -> impl Iterator<Item = usize> + '_ {
    const STRIDE: usize = 64;
    // With none to find, nothing is searched.
    let searched = if count == 0 { &[][..] } else { tokens };
    searched
        .chunks(STRIDE)
        .enumerate()
        .filter(|(_, chunk)| chunk.contains(&ESCAPE_TOKEN))
        .flat_map(|(c, chunk)| {
            chunk
                .iter()
                .enumerate()
                .filter(|&(_, &t)| t == ESCAPE_TOKEN)
                .map(move |(j, _)| c * STRIDE + j)
        })
}

/// Splits 16-bit words into a high-byte plane followed by a low-byte plane: exponents
/// cluster in the high bytes, which zstd then codes far better than interleaved bytes.
pub(crate) fn planes(words: &[u16]) -> Vec<u8> {
    let mut out = vec![0u8; words.len() * 2];
    let (hi, lo) = out.split_at_mut(words.len());
    for ((h, l), w) in hi.iter_mut().zip(lo.iter_mut()).zip(words) {
        *h = (w >> 8) as u8;
        *l = *w as u8;
    }
    out
}

pub(crate) fn unplanes(
    raw: &[u8],
    count: usize,
    what: &'static str,
) -> Result<Vec<u16>, DecodeError> {
    if raw.len() != count * 2 {
        return Err(DecodeError::malformed(
            what,
            format!("{} bytes for {count} values", raw.len()),
        ));
    }
    let (hi, lo) = raw.split_at(count);
    Ok(hi
        .iter()
        .zip(lo)
        .map(|(&h, &l)| u16::from(h) << 8 | u16::from(l))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn ordered_is_monotonic_and_bijective() {
        let mut seen = vec![false; 1 << 16];
        for b in 0..=u16::MAX {
            let k = ordered(b);
            assert!(!seen[k as usize]);
            seen[k as usize] = true;
            assert_eq!(from_ordered(k), b);
        }
        // -0 and +0 are neighbours; 1.0 is one step above its predecessor.
        assert_eq!(ordered(0x0000).wrapping_sub(ordered(0x8000)), 1);
        assert_eq!(ulp_step_zigzag(0x3F80, 0x3F81), 2);
        assert_eq!(ulp_step_zigzag(0x3F81, 0x3F80), 1);
        // Negative weights: moving towards −∞ is a negative step.
        assert_eq!(ulp_step_zigzag(0xBF80, 0xBF81), 1);
        // A sign crossing next to zero is a small step, not a 0x8000 jump.
        assert_eq!(ulp_step_zigzag(0x0001, 0x8001), 5);
    }

    #[test]
    fn golden_residual_tokens() {
        // +1, −1, +1 ULP: tokens 2, 1, 2, no escapes.
        let old = [0x3F80, 0x3F80, 0xBC00];
        let new = [0x3F81, 0x3F7F, 0xBBFF];
        let enc = encode(ValueCodec::UlpResidualZstd, &new, &old, 1);
        let raw = zstd::bulk::decompress(&enc, 100).expect("zstd");
        assert_eq!(raw, [0, 2, 1, 2]);
    }

    #[test]
    fn golden_ulp_step_rc() {
        // +1, −1, +1 ULP and one 0x100-ULP jump.
        let old = [0x3F80, 0x3F80, 0xBC00, 0x3F80];
        let new = [0x3F81, 0x3F7F, 0xBBFF, 0x4080];
        let enc = encode(ValueCodec::UlpStepRc, &new, &old, 1);
        assert_eq!(enc, GOLDEN_ULP_STEP_RC);
        assert_eq!(
            decode(ValueCodec::UlpStepRc, &enc, 4, Some(&old)),
            Ok(new.to_vec())
        );
    }

    /// Pinned: any change to these bytes is a format change (see docs/format.md).
    const GOLDEN_ULP_STEP_RC: [u8; 7] = [0xd9, 0x7f, 0xbf, 0xfe, 0xdf, 0xe0, 0x00];

    #[test]
    fn golden_ulp_step_rans() {
        let old = [0x3F80, 0x3F80, 0xBC00, 0x3F80];
        let new = [0x3F81, 0x3F7F, 0xBBFF, 0x4080];
        let enc = encode(ValueCodec::UlpStepRans, &new, &old, 1);
        assert_eq!(enc, GOLDEN_ULP_STEP_RANS, "{enc:02x?}");
        assert_eq!(
            decode(ValueCodec::UlpStepRans, &enc, 4, Some(&old)),
            Ok(new.to_vec())
        );
    }

    /// Pinned: any change to these bytes is a format change (see docs/format.md).
    const GOLDEN_ULP_STEP_RANS: [u8; 34] = [
        0, 0, 0, 0, 0, 2, 64, 0, 255, 255, 170, 128, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        255, 33, 90, 3, 0, 226, 203,
    ];

    proptest! {
        #[test]
        fn every_value_codec_round_trips_any_bits(pairs in proptest::collection::vec((any::<u16>(), any::<u16>()), 0..500)) {
            let old: Vec<u16> = pairs.iter().map(|p| p.0).collect();
            let new: Vec<u16> = pairs.iter().map(|p| p.1).collect();
            for codec in ValueCodec::ALL {
                let enc = encode(codec, &new, &old, 1);
                let dec = decode(codec, &enc, new.len(), Some(&old)).expect("decodes");
                prop_assert_eq!(&dec, &new, "{}", codec.name());
            }
        }

        #[test]
        fn ulp_step_codecs_round_trip_small_steps_and_refuse_truncation(
            pairs in proptest::collection::vec((any::<u16>(), -20i16..=20), 1..400)
        ) {
            let old: Vec<u16> = pairs.iter().map(|p| p.0).collect();
            let new: Vec<u16> = pairs
                .iter()
                .map(|&(o, d)| from_ordered(ordered(o).wrapping_add(d as u16)))
                .collect();
            for codec in [ValueCodec::UlpStepRc, ValueCodec::UlpStepRans] {
                let enc = encode(codec, &new, &old, 1);
                let dec = decode(codec, &enc, new.len(), Some(&old)).expect("decodes");
                prop_assert_eq!(&dec, &new);
                for cut in 0..enc.len() {
                    // A truncated stream is refused or decodes to other values; never a panic.
                    if let Ok(v) = decode(codec, &enc[..cut], new.len(), Some(&old)) {
                        prop_assert_eq!(v.len(), new.len());
                    }
                }
                prop_assert!(decode(codec, &enc, new.len(), Some(&old[1..])).is_err());
                prop_assert!(decode(codec, &enc, new.len(), None).is_err());
            }
        }

        #[test]
        fn value_decoders_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64), count in 0usize..50) {
            let old = vec![0x3F80u16; count];
            for codec in ValueCodec::ALL {
                if let Ok(v) = decode(codec, &bytes, count, Some(&old)) {
                    prop_assert_eq!(v.len(), count);
                }
            }
        }
    }
}

//! BF16 bit patterns and the casts into them.
//!
//! Weights are handled as raw `u16` bit patterns everywhere in Starling: a delta is about
//! *bits*, and any float arithmetic on the way would risk changing NaN payloads or signed
//! zeros. The casts here reproduce `torch.Tensor.to(torch.bfloat16)` exactly: round to
//! nearest, ties to even, and every NaN becomes the canonical quiet NaN `0x7FC0`.

/// The canonical quiet NaN PyTorch produces when casting any NaN to BF16.
pub const CANONICAL_NAN: u16 = 0x7FC0;

/// Casts an `f32` to BF16 bits exactly as PyTorch does (round to nearest even; NaN → 0x7FC0).
#[inline]
pub fn f32_to_bf16(x: f32) -> u16 {
    if x.is_nan() {
        return CANONICAL_NAN;
    }
    let bits = x.to_bits();
    let rounding_bias = ((bits >> 16) & 1) + 0x7FFF;
    (bits.wrapping_add(rounding_bias) >> 16) as u16
}

/// Widens BF16 bits to the `f32` they denote (exact).
#[inline]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// Casts IEEE binary16 bits to BF16 via the exact `f32` value (as PyTorch does).
#[inline]
pub fn f16_to_bf16(h: u16) -> u16 {
    f32_to_bf16(f16_to_f32(h))
}

/// Exact conversion of IEEE binary16 bits to `f32`, including subnormals, infinities and NaN.
#[inline]
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h & 0x8000) << 16;
    let exp = u32::from((h >> 10) & 0x1f);
    let man = u32::from(h & 0x3ff);
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, m) => {
            // Subnormal: value = m * 2^-24; normalize.
            let shift = m.leading_zeros() - 21; // bring the top set bit to bit 10
            let m = (m << shift) & 0x3ff;
            let e = 127 - 15 + 1 - shift;
            sign | (e << 23) | (m << 13)
        }
        (0x1f, 0) => sign | 0x7f80_0000,
        (0x1f, m) => sign | 0x7fc0_0000 | (m << 13),
        (e, m) => sign | ((e + 127 - 15) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn rounds_to_nearest_even_like_torch() {
        // 1.0 + 2^-8 is exactly halfway between 1.0 and 1.0 + 2^-7: ties go to even (1.0).
        assert_eq!(f32_to_bf16(1.0 + 2f32.powi(-8)), 0x3F80);
        // 1.0 + 3 * 2^-8 is halfway between 1+2^-7 (odd) and 1+2^-6 (even): rounds up.
        assert_eq!(f32_to_bf16(1.0 + 3.0 * 2f32.powi(-8)), 0x3F82);
        // Just above the tie rounds up.
        assert_eq!(f32_to_bf16(f32::from_bits(0x3F80_8001)), 0x3F81);
        assert_eq!(f32_to_bf16(f32::NAN), CANONICAL_NAN);
        assert_eq!(f32_to_bf16(f32::from_bits(0xFFC0_1234)), CANONICAL_NAN);
        assert_eq!(f32_to_bf16(-0.0), 0x8000);
        assert_eq!(f32_to_bf16(f32::INFINITY), 0x7F80);
        // The largest finite f32 rounds up to infinity, as in torch.
        assert_eq!(f32_to_bf16(f32::MAX), 0x7F80);
        // Subnormals keep their top bits.
        assert_eq!(f32_to_bf16(f32::from_bits(0x0001_0000)), 0x0001);
    }

    #[test]
    fn f16_conversion_matches_reference_values() {
        assert_eq!(f16_to_f32(0x3C00), 1.0);
        assert_eq!(f16_to_f32(0xC000), -2.0);
        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
        assert_eq!(f16_to_f32(0x03FF), 1023.0 * 2f32.powi(-24));
        assert_eq!(f16_to_f32(0x7C00), f32::INFINITY);
        assert!(f16_to_f32(0x7E00).is_nan());
        assert_eq!(f16_to_f32(0x8000).to_bits(), 0x8000_0000);
        assert_eq!(f16_to_bf16(0x3C00), 0x3F80);
    }

    proptest! {
        #[test]
        fn bf16_widening_round_trips(b in any::<u16>()) {
            let x = bf16_to_f32(b);
            if x.is_nan() {
                prop_assert_eq!(f32_to_bf16(x), CANONICAL_NAN);
            } else {
                prop_assert_eq!(f32_to_bf16(x), b);
            }
        }

        #[test]
        fn cast_picks_a_nearest_neighbour(bits in any::<u32>()) {
            let x = f32::from_bits(bits);
            prop_assume!(x.is_finite());
            let b = f32_to_bf16(x);
            let y = bf16_to_f32(b);
            if y.is_finite() {
                // No other BF16 value is strictly closer.
                let up = bf16_to_f32(b.wrapping_add(1));
                let down = bf16_to_f32(b.wrapping_sub(1));
                let d = (f64::from(x) - f64::from(y)).abs();
                for n in [up, down] {
                    if n.is_finite() {
                        prop_assert!(d <= (f64::from(x) - f64::from(n)).abs());
                    }
                }
            }
        }
    }
}

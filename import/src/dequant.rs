//! Dequantisation of GGUF tensor data to `f32`, exactly as gguf-py (`gguf.quants`) does it,
//! which is what transformers runs when it loads a GGUF file.
//!
//! Each formula is evaluated in `f32` with one rounding per operation and no fused
//! multiply-add, as numpy evaluates gguf-py's expressions:
//!
//! - `Q8_0` (blocks of 32: an f16 scale `d`, 32 `i8`): `x · d`;
//! - `Q4_0` (an f16 `d`, 16 bytes of nibbles): `d · (q − 8)`;
//! - `Q4_1` (f16 `d` and `m`, 16 bytes of nibbles): `d · q + m`;
//!
//! where nibble `j < 16` is the low half of byte `j` and nibble `j + 16` its high half. F32,
//! F16 and BF16 are widened exactly. Pure functions over byte slices.

use crate::gguf::GgmlType;

/// Why a tensor's bytes cannot be dequantised.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DequantError {
    #[error("element type {0} is not supported (F32, F16, BF16, Q8_0, Q4_0 and Q4_1 are)")]
    Unsupported(String),
    #[error("{elements} elements of {kind} need {expected} bytes, the file has {found}")]
    Length {
        kind: String,
        elements: u64,
        expected: u64,
        found: u64,
    },
}

fn f16(b: [u8; 2]) -> f32 {
    starling_proto::delta::bf16::f16_to_f32(u16::from_le_bytes(b))
}

/// The `numel` values stored in `data` as `kind`, in `f32`.
pub fn dequantize(kind: GgmlType, data: &[u8], numel: u64) -> Result<Vec<f32>, DequantError> {
    let Some((per_block, block_bytes)) = kind.block() else {
        return Err(DequantError::Unsupported(kind.name()));
    };
    let expected = if numel.is_multiple_of(per_block) {
        numel / per_block * block_bytes
    } else {
        u64::MAX
    };
    if data.len() as u64 != expected {
        return Err(DequantError::Length {
            kind: kind.name(),
            elements: numel,
            expected,
            found: data.len() as u64,
        });
    }
    let mut out = Vec::with_capacity(numel as usize);
    match kind {
        GgmlType::F32 => out.extend(
            data.as_chunks::<4>()
                .0
                .iter()
                .map(|b| f32::from_le_bytes(*b)),
        ),
        GgmlType::F16 => out.extend(data.as_chunks::<2>().0.iter().map(|b| f16(*b))),
        GgmlType::BF16 => out.extend(
            data.as_chunks::<2>()
                .0
                .iter()
                .map(|b| starling_proto::delta::bf16::bf16_to_f32(u16::from_le_bytes(*b))),
        ),
        GgmlType::Q8_0 => {
            for block in data.chunks_exact(34) {
                let d = f16([block[0], block[1]]);
                out.extend(block[2..].iter().map(|&q| f32::from(q as i8) * d));
            }
        }
        GgmlType::Q4_0 => {
            for block in data.chunks_exact(18) {
                let d = f16([block[0], block[1]]);
                let qs = &block[2..];
                out.extend(qs.iter().map(|&q| d * f32::from((q & 0x0F) as i8 - 8)));
                out.extend(qs.iter().map(|&q| d * f32::from((q >> 4) as i8 - 8)));
            }
        }
        GgmlType::Q4_1 => {
            for block in data.chunks_exact(20) {
                let d = f16([block[0], block[1]]);
                let m = f16([block[2], block[3]]);
                let qs = &block[4..];
                out.extend(qs.iter().map(|&q| d * f32::from(q & 0x0F) + m));
                out.extend(qs.iter().map(|&q| d * f32::from(q >> 4) + m));
            }
        }
        other => return Err(DequantError::Unsupported(other.name())),
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(x: f32) -> [u8; 2] {
        // Exact halves only (the test's scales are powers of two and small integers).
        let bits = match x {
            0.5 => 0x3800u16,
            0.25 => 0x3400,
            -1.0 => 0xBC00,
            2.0 => 0x4000,
            _ => panic!("no half for {x}"),
        };
        bits.to_le_bytes()
    }

    #[test]
    fn q4_1_puts_low_nibbles_first_and_adds_the_minimum() {
        let mut block = Vec::new();
        block.extend(h(0.5));
        block.extend(h(-1.0));
        block.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let v = dequantize(GgmlType::Q4_1, &block, 32).expect("dequantize");
        for j in 0..16 {
            assert_eq!(v[j], 0.5 * j as f32 - 1.0, "low nibble {j}");
            assert_eq!(v[j + 16], 0.5 * (15 - j) as f32 - 1.0, "high nibble {j}");
        }
    }

    #[test]
    fn q8_0_and_q4_0_scale_signed_values() {
        let mut q8 = h(0.25).to_vec();
        q8.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let v = dequantize(GgmlType::Q8_0, &q8, 32).expect("q8");
        assert_eq!(v[0], -4.0);
        assert_eq!(v[31], 3.75);
        let mut q4 = h(2.0).to_vec();
        q4.extend([0x80u8; 16]);
        let v = dequantize(GgmlType::Q4_0, &q4, 32).expect("q4");
        assert_eq!((v[0], v[16]), (-16.0, 0.0));
    }

    #[test]
    fn wrong_lengths_and_unknown_types_are_refused_by_name() {
        assert!(matches!(
            dequantize(GgmlType::Q4_1, &[0; 19], 32),
            Err(DequantError::Length { .. })
        ));
        assert!(matches!(
            dequantize(GgmlType::Q4_1, &[0; 20], 31),
            Err(DequantError::Length { .. })
        ));
        let e = dequantize(GgmlType(14), &[], 0).expect_err("Q6_K");
        assert!(e.to_string().contains("Q6_K"), "{e}");
    }
}

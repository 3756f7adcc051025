//! Dense codecs: a whole range travels as planes when sparse coding would be larger
//! (a first step, a LoRA merge, a re-quantized block).

use super::value::{planes, unplanes};
use super::{DenseCodec, ZstdPayload, zstd_compress, zstd_decompress};
use crate::error::DecodeError;

/// Encodes the new bits of a whole range (`old` is the base range, same length).
pub fn encode(codec: DenseCodec, new: &[u16], old: &[u16], zstd_level: i32) -> Vec<u8> {
    debug_assert_eq!(new.len(), old.len());
    match codec {
        DenseCodec::XorPlanesZstd => {
            let xor: Vec<u16> = new.iter().zip(old).map(|(n, o)| n ^ o).collect();
            zstd_compress(&planes(&xor), zstd_level, ZstdPayload::General)
        }
        DenseCodec::PlanesZstd => zstd_compress(&planes(new), zstd_level, ZstdPayload::General),
    }
}

/// Decodes the new bits of a range of `len` elements.
pub fn decode(
    codec: DenseCodec,
    bytes: &[u8],
    len: usize,
    old: Option<&[u16]>,
) -> Result<Vec<u16>, DecodeError> {
    let raw = zstd_decompress(bytes, len * 2, "dense payload")?;
    let words = unplanes(&raw, len, "dense payload")?;
    match codec {
        DenseCodec::PlanesZstd => Ok(words),
        DenseCodec::XorPlanesZstd => {
            let old = old.filter(|o| o.len() == len).ok_or_else(|| {
                DecodeError::malformed(
                    "dense payload",
                    "decoding needs the base values of the range",
                )
            })?;
            Ok(words.iter().zip(old).map(|(x, o)| x ^ o).collect())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn dense_codecs_round_trip(pairs in proptest::collection::vec((any::<u16>(), any::<u16>()), 0..500)) {
            let old: Vec<u16> = pairs.iter().map(|p| p.0).collect();
            let new: Vec<u16> = pairs.iter().map(|p| p.1).collect();
            for codec in DenseCodec::ALL {
                let enc = encode(codec, &new, &old, 1);
                prop_assert_eq!(decode(codec, &enc, new.len(), Some(&old)).expect("decodes"), new.clone());
            }
        }
    }
}

//! The per-part codecs of a delta checkpoint and their ids on the wire.
//!
//! A *part* is the delta of one contiguous element range of one tensor. It is coded either
//! **sparse** (positions by an [`IndexCodec`], new values by a [`ValueCodec`]) or **dense**
//! (a [`DenseCodec`] over the whole range). The encoder tries the candidates and keeps the
//! smallest, per part, by measured size (see [`crate::delta::encode`]).
//!
//! Codecs that [need the base](IndexCodec::needs_base) condition on the base values of the
//! part's range, which every receiver holds when it stages a segment:
//! [`IndexCodec::ExpClassGapsRc`] and [`ValueCodec::UlpStepRc`] model the change mask and the
//! ULP step with contexts from each base value's BF16 exponent (the adaptive range coder
//! and the classes are in [`rc`]). Ids are only ever added: the `V1` lists name the codecs
//! of the first release, which every reader knows.

pub mod bits;
pub mod dense;
mod gaps_rans;
pub mod index;
pub mod rans;
pub mod rc;
pub(crate) mod scan;
mod step_rans;
pub mod value;

/// Synthetic BF16 weights for the codecs' timing tests: a sum of four uniforms (close to a
/// Gaussian) scaled like a trained layer's weights, from a fixed xorshift stream.
#[cfg(test)]
mod synthetic {
    pub(super) struct XorShift(u64);

    impl Default for XorShift {
        fn default() -> Self {
            Self(88172645463325252)
        }
    }

    impl XorShift {
        pub(super) fn next_u64(&mut self) -> u64 {
            let s = &mut self.0;
            *s ^= *s << 13;
            *s ^= *s >> 7;
            *s ^= *s << 17;
            *s
        }
    }

    pub(super) fn weights(rng: &mut XorShift, n: usize) -> Vec<u16> {
        (0..n)
            .map(|_| {
                let g: f32 = (0..4)
                    .map(|_| (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
                    .sum();
                crate::delta::bf16::f32_to_bf16(g * 0.03)
            })
            .collect()
    }
}

use crate::error::DecodeError;

/// How the sorted change positions of a sparse part are coded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum IndexCodec {
    /// Gaps as LEB128 varints (the SparrowRL scheme), no entropy coder.
    Leb128Gaps = 1,
    /// Gaps as LEB128 varints, then zstd.
    Leb128GapsZstd = 2,
    /// Gaps Golomb-Rice coded with a parameter fitted per block of gaps: within a few
    /// hundredths of a bit of the entropy of geometric gaps, with an escape for outliers.
    RiceGaps = 3,
    /// One bit per element of the range, then zstd: for dense ranges.
    BitmapZstd = 4,
    /// Gaps counted within the class of each element's base BF16 exponent, coded with an
    /// adaptive binary range coder (contexts per class): the change mask conditioned on
    /// the base exponent. Needs the base values of the range to decode.
    ExpClassGapsRc = 5,
    /// The gaps of [`IndexCodec::ExpClassGapsRc`] coded with static per-part tables (four
    /// parameter bytes per class present) through a rANS coder: a table lookup per change
    /// instead of adaptive context updates. Needs the base values of the range to decode.
    ExpClassGapsRans = 6,
}

/// How the new BF16 values of a sparse part are coded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ValueCodec {
    /// Raw little-endian BF16 bits, then zstd.
    RawZstd = 1,
    /// Zigzag of the wrapping 16-bit difference against the base bits (mostly ±1 ULP),
    /// as byte tokens with an escape, then zstd. Needs the base values to decode.
    UlpResidualZstd = 2,
    /// Raw little-endian BF16 bits, no entropy coder (the SparrowRL scheme).
    Raw = 3,
    /// The ULP step of [`ValueCodec::UlpResidualZstd`] coded with an adaptive binary range
    /// coder, with contexts from the base value's exponent class and sign; an escape codes
    /// large steps raw. Needs the base values to decode.
    UlpStepRc = 4,
    /// The step of [`ValueCodec::UlpStepRc`] with static per-part tables (two parameter bytes
    /// per (exponent class, sign) present) through a rANS coder. Needs the base values.
    UlpStepRans = 5,
}

/// How a dense part is coded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DenseCodec {
    /// XOR of base and new bits split into high-byte and low-byte planes, then zstd.
    /// Needs the base values to decode.
    XorPlanesZstd = 1,
    /// The new bits as high-byte and low-byte planes, then zstd (no base needed).
    PlanesZstd = 2,
}

impl IndexCodec {
    pub const ALL: [IndexCodec; 6] = [
        Self::Leb128Gaps,
        Self::Leb128GapsZstd,
        Self::RiceGaps,
        Self::BitmapZstd,
        Self::ExpClassGapsRc,
        Self::ExpClassGapsRans,
    ];
    /// The codecs of the first release (all a version-1 reader of 2026-11 knows).
    pub const V1: [IndexCodec; 4] = [
        Self::Leb128Gaps,
        Self::Leb128GapsZstd,
        Self::RiceGaps,
        Self::BitmapZstd,
    ];

    pub fn from_id(id: u8) -> Result<Self, DecodeError> {
        Self::ALL
            .into_iter()
            .find(|c| *c as u8 == id)
            .ok_or(DecodeError::UnknownCodec {
                what: "index codec",
                id,
            })
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Leb128Gaps => "leb128-gaps",
            Self::Leb128GapsZstd => "leb128-gaps+zstd",
            Self::RiceGaps => "rice-gaps",
            Self::BitmapZstd => "bitmap+zstd",
            Self::ExpClassGapsRc => "exp-class-gaps+rc",
            Self::ExpClassGapsRans => "exp-class-gaps+rans",
        }
    }

    /// Whether decoding needs the base values of the range.
    pub fn needs_base(self) -> bool {
        matches!(self, Self::ExpClassGapsRc | Self::ExpClassGapsRans)
    }
}

impl ValueCodec {
    pub const ALL: [ValueCodec; 5] = [
        Self::RawZstd,
        Self::UlpResidualZstd,
        Self::Raw,
        Self::UlpStepRc,
        Self::UlpStepRans,
    ];
    /// The codecs of the first release.
    pub const V1: [ValueCodec; 3] = [Self::RawZstd, Self::UlpResidualZstd, Self::Raw];

    pub fn from_id(id: u8) -> Result<Self, DecodeError> {
        Self::ALL
            .into_iter()
            .find(|c| *c as u8 == id)
            .ok_or(DecodeError::UnknownCodec {
                what: "value codec",
                id,
            })
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::RawZstd => "raw+zstd",
            Self::UlpResidualZstd => "ulp-residual+zstd",
            Self::Raw => "raw",
            Self::UlpStepRc => "ulp-step+rc",
            Self::UlpStepRans => "ulp-step+rans",
        }
    }

    /// Whether decoding needs the base values of the range.
    pub fn needs_base(self) -> bool {
        matches!(
            self,
            Self::UlpResidualZstd | Self::UlpStepRc | Self::UlpStepRans
        )
    }
}

impl DenseCodec {
    pub const ALL: [DenseCodec; 2] = [Self::XorPlanesZstd, Self::PlanesZstd];

    pub fn from_id(id: u8) -> Result<Self, DecodeError> {
        Self::ALL
            .into_iter()
            .find(|c| *c as u8 == id)
            .ok_or(DecodeError::UnknownCodec {
                what: "dense codec",
                id,
            })
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::XorPlanesZstd => "dense-xor-planes+zstd",
            Self::PlanesZstd => "dense-planes+zstd",
        }
    }

    pub fn needs_base(self) -> bool {
        matches!(self, Self::XorPlanesZstd)
    }
}

thread_local! {
    /// One compression context per thread and level: creating a context costs tens of
    /// microseconds, more than coding a typical part.
    static COMPRESSOR: std::cell::RefCell<Option<(i32, zstd::bulk::Compressor<'static>)>> =
        const { std::cell::RefCell::new(None) };
    static DECOMPRESSOR: std::cell::RefCell<Option<zstd::bulk::Decompressor<'static>>> =
        const { std::cell::RefCell::new(None) };
}

/// zstd-compresses `data` at `level` (level 1 is the measured sweet spot for these payloads).
pub(crate) fn zstd_compress(data: &[u8], level: i32) -> Vec<u8> {
    let fresh =
        || zstd::bulk::compress(data, level).unwrap_or_else(|_| vec![0xff; data.len() + 64]);
    COMPRESSOR.with(|c| {
        let mut c = c.borrow_mut();
        if c.as_ref().is_none_or(|(l, _)| *l != level) {
            *c = zstd::bulk::Compressor::new(level).ok().map(|z| (level, z));
        }
        match c.as_mut() {
            // Compressing memory into memory cannot fail for a valid level; if the library
            // ever reports an error, fall back to a one-shot call (and to an oversized
            // marker that simply loses the size comparison).
            Some((_, z)) => z.compress(data).unwrap_or_else(|_| fresh()),
            None => fresh(),
        }
    })
}

/// zstd-decompresses `data`, refusing output larger than `max_out` bytes.
pub(crate) fn zstd_decompress(
    data: &[u8],
    max_out: usize,
    what: &'static str,
) -> Result<Vec<u8>, DecodeError> {
    // The frame header states the content size; check it against the bound before
    // allocating anything, and reserve exactly that much: a forged header or part count can
    // make us reserve no more than the frame itself says it holds. Starling's encoder always
    // writes the size, so a frame without one is refused rather than sized by the bound.
    let stated = match zstd::zstd_safe::get_frame_content_size(data) {
        Ok(Some(n)) if n > max_out as u64 => {
            return Err(DecodeError::TooLarge {
                what,
                value: n,
                limit: max_out as u64,
            });
        }
        Ok(Some(n)) => n as usize,
        Ok(None) => {
            return Err(DecodeError::Zstd {
                what,
                detail: "the zstd frame does not state its content size".into(),
            });
        }
        Err(_) => {
            return Err(DecodeError::Zstd {
                what,
                detail: "not a zstd frame".into(),
            });
        }
    };
    let err = |e: std::io::Error| DecodeError::Zstd {
        what,
        detail: e.to_string(),
    };
    DECOMPRESSOR.with(|d| {
        let mut d = d.borrow_mut();
        if d.is_none() {
            *d = zstd::bulk::Decompressor::new().ok();
        }
        match d.as_mut() {
            Some(z) => z.decompress(data, stated).map_err(err),
            None => zstd::bulk::decompress(data, stated).map_err(err),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_decompresses_into_exactly_its_stated_size_within_the_bound() {
        let data = vec![7u8; 1000];
        let z = zstd_compress(&data, 1);
        assert_eq!(zstd_decompress(&z, 1000, "t").expect("fits"), data);
        assert_eq!(zstd_decompress(&z, 1 << 30, "t").expect("fits").len(), 1000);
        assert!(matches!(
            zstd_decompress(&z, 999, "t"),
            Err(DecodeError::TooLarge { value: 1000, .. })
        ));
    }

    #[test]
    fn a_frame_that_does_not_state_its_size_is_refused() {
        // A streaming encoder does not know the size up front, so its frame omits it.
        let z = zstd::stream::encode_all(&[1u8; 64][..], 1).expect("encode");
        let e = zstd_decompress(&z, 1 << 20, "t").expect_err("refused");
        assert!(e.to_string().contains("content size"), "{e}");
        assert!(zstd_decompress(b"not zstd", 1 << 20, "t").is_err());
    }
}

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

/// What a zstd payload holds, which decides how hard zstd looks for repeats in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ZstdPayload {
    /// Bytes with real repeats (bit planes, LEB128 gaps, bitmaps): the level's parameters.
    General,
    /// Tokens of a small alphabet whose repeats are short and accidental (the ULP residuals
    /// of [`ValueCodec::UlpResidualZstd`]). zstd is told to code them as Huffman literals
    /// and hardly look for matches: the level's parameters with the smallest hash table (2⁶
    /// entries), the longest minimum match (7 bytes), a skip ahead of 64 where it finds none
    /// (as zstd's `--fast=64`), and literal compression kept on (zstd turns it off with a
    /// skip unless told). With level 1's own parameters zstd spent a fifth of the fast set's
    /// encode finding short matches that cost more bits than the literals they replaced.
    /// The skip applies to the fast strategy only; at levels that pick another strategy
    /// (`CodecChoice::zstd_level` is 1 in every Starling encoder) the other settings still
    /// hold. Any zstd decoder reads the result.
    Tokens,
}

impl ZstdPayload {
    fn tune(self, z: &mut zstd::bulk::Compressor<'static>) -> std::io::Result<()> {
        use zstd::zstd_safe::{CParameter, ParamSwitch};
        match self {
            Self::General => Ok(()),
            Self::Tokens => {
                z.set_parameter(CParameter::HashLog(6))?;
                z.set_parameter(CParameter::MinMatch(7))?;
                z.set_parameter(CParameter::TargetLength(TOKENS_SKIP))?;
                z.set_parameter(CParameter::LiteralCompressionMode(ParamSwitch::Enable))
            }
        }
    }
}

/// The fast strategy's skip ahead for [`ZstdPayload::Tokens`] (zstd's `targetLength`, the
/// acceleration of its negative levels): of 2, 8 and 64, measured on the fast set's payloads
/// with the zstd CLI, 64 gave the smallest (`docs/benchmarks.md`).
const TOKENS_SKIP: u32 = 64;

/// A thread's compression contexts, one per level and payload kind in use.
type Compressors = Vec<((i32, ZstdPayload), zstd::bulk::Compressor<'static>)>;

thread_local! {
    /// Each thread's compression contexts: creating one costs tens of microseconds, more than
    /// coding a typical part, and the encoder alternates payload kinds within a part.
    static COMPRESSORS: std::cell::RefCell<Compressors> =
        const { std::cell::RefCell::new(Vec::new()) };
    static DECOMPRESSOR: std::cell::RefCell<Option<zstd::bulk::Decompressor<'static>>> =
        const { std::cell::RefCell::new(None) };
}

/// zstd-compresses `data` at `level` (level 1 is the measured sweet spot for these payloads),
/// with the parameters [`ZstdPayload`] gives what it holds.
pub(crate) fn zstd_compress(data: &[u8], level: i32, payload: ZstdPayload) -> Vec<u8> {
    let fresh =
        || zstd::bulk::compress(data, level).unwrap_or_else(|_| vec![0xff; data.len() + 64]);
    let key = (level, payload);
    COMPRESSORS.with(|c| {
        let mut c = c.borrow_mut();
        if !c.iter().any(|(k, _)| *k == key) {
            let made = zstd::bulk::Compressor::new(level)
                .and_then(|mut z| payload.tune(&mut z).map(|()| z));
            match made {
                Ok(z) => c.push((key, z)),
                Err(_) => return fresh(),
            }
        }
        match c.iter_mut().find(|(k, _)| *k == key) {
            // Compressing memory into memory cannot fail for a valid level; if the library
            // ever reports an error, fall back to a one-shot call at the level's own
            // parameters (and to an oversized marker that simply loses the size comparison).
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
        let z = zstd_compress(&data, 1, ZstdPayload::General);
        assert_eq!(zstd_decompress(&z, 1000, "t").expect("fits"), data);
        assert_eq!(zstd_decompress(&z, 1 << 30, "t").expect("fits").len(), 1000);
        assert!(matches!(
            zstd_decompress(&z, 999, "t"),
            Err(DecodeError::TooLarge { value: 1000, .. })
        ));
    }

    /// ULP-residual-like tokens: mostly 1–4 (one or two ULP either way), a tail up to 40.
    fn residual_tokens(n: usize) -> Vec<u8> {
        let mut rng = synthetic::XorShift::default();
        (0..n)
            .map(|_| {
                let r = rng.next_u64();
                let small = 1 + (r & 3) as u8;
                if r >> 60 == 0 {
                    (r >> 32) as u8 % 40
                } else {
                    small
                }
            })
            .collect()
    }

    #[test]
    fn token_payloads_are_coded_as_literals_smaller_than_at_the_levels_parameters() {
        let tokens = residual_tokens(200_000);
        let general = zstd_compress(&tokens, 1, ZstdPayload::General);
        let literal = zstd_compress(&tokens, 1, ZstdPayload::Tokens);
        // Level 1's own parameters spend bits on short accidental matches.
        assert!(
            literal.len() * 100 < general.len() * 97,
            "tokens {} bytes, general {} bytes",
            literal.len(),
            general.len()
        );
        assert_eq!(
            zstd_decompress(&literal, tokens.len(), "t").expect("decodes"),
            tokens
        );
        // Any zstd decoder reads it: it is an ordinary frame.
        assert_eq!(
            zstd::bulk::decompress(&literal, tokens.len()).expect("plain"),
            tokens
        );
    }

    #[test]
    fn each_payload_kind_gives_the_same_bytes_whatever_was_compressed_before() {
        // The delta id hashes the encoder's bytes: a context reused across kinds and calls
        // must code a payload as a fresh one does, and general payloads exactly as level 1.
        let (a, b) = (residual_tokens(50_000), residual_tokens(30_000));
        let first = zstd_compress(&a, 1, ZstdPayload::Tokens);
        let other = zstd_compress(&b, 1, ZstdPayload::General);
        assert_eq!(other, zstd::bulk::compress(&b, 1).expect("level 1"));
        assert_ne!(other, zstd_compress(&b, 1, ZstdPayload::Tokens));
        assert_eq!(zstd_compress(&a, 1, ZstdPayload::Tokens), first);
        assert_eq!(zstd_compress(&b, 1, ZstdPayload::General), other);
        let fresh = std::thread::spawn(move || zstd_compress(&a, 1, ZstdPayload::Tokens))
            .join()
            .expect("thread");
        assert_eq!(fresh, first);
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

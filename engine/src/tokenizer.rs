//! A byte-level tokenizer for tests, demos and toy tasks: no training, no vocabulary file.
//!
//! Ids 0, 1, 2 are pad, bos, eos; ids 3..=258 are the bytes 0..=255. Any model with a
//! vocabulary of at least 259 can use it (ids above 258 are never produced, and skipped
//! when decoding). Encoding is exact; decoding is lossy only where the bytes are not
//! UTF-8.

/// Why a tokenizer cannot serve a model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenizerError {
    #[error("vocabulary of {vocab} is too small for the byte tokenizer (needs {needed})")]
    VocabTooSmall { vocab: usize, needed: usize },
}

/// The byte tokenizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteTokenizer;

impl ByteTokenizer {
    pub const PAD: u32 = 0;
    pub const BOS: u32 = 1;
    pub const EOS: u32 = 2;
    /// The id generation should stop at.
    pub const STOP: u32 = Self::EOS;
    /// Id of byte 0.
    pub const BYTE_OFFSET: u32 = 3;
    /// Smallest vocabulary that holds every id.
    pub const VOCAB: usize = 259;

    /// A tokenizer for a model with `vocab` ids.
    pub fn new(vocab: usize) -> Result<Self, TokenizerError> {
        if vocab < Self::VOCAB {
            return Err(TokenizerError::VocabTooSmall {
                vocab,
                needed: Self::VOCAB,
            });
        }
        Ok(Self)
    }

    /// The bytes of `text` as ids (no bos).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        text.bytes()
            .map(|b| u32::from(b) + Self::BYTE_OFFSET)
            .collect()
    }

    /// bos followed by [`ByteTokenizer::encode`].
    pub fn encode_with_bos(&self, text: &str) -> Vec<u32> {
        let mut v = vec![Self::BOS];
        v.extend(self.encode(text));
        v
    }

    /// The text of `ids`: stops at eos, skips pad, bos and ids beyond the bytes.
    pub fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids
            .iter()
            .take_while(|&&t| t != Self::EOS)
            .filter_map(|&t| u8::try_from(t.checked_sub(Self::BYTE_OFFSET)?).ok())
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_handles_specials() {
        let t = ByteTokenizer::new(259).expect("vocab");
        let ids = t.encode("héllo\n");
        assert_eq!(ids.len(), "héllo\n".len());
        assert_eq!(ids[0], u32::from(b'h') + 3);
        assert_eq!(t.decode(&ids), "héllo\n");
        let mut with = t.encode_with_bos("ab");
        assert_eq!(with[0], ByteTokenizer::BOS);
        with.extend([
            ByteTokenizer::PAD,
            300,
            ByteTokenizer::EOS,
            3 + u32::from(b'z'),
        ]);
        assert_eq!(t.decode(&with), "ab", "skips specials, stops at eos");
        assert_eq!(t.decode(&[3 + 0xFF]), "\u{FFFD}", "lossy on invalid UTF-8");
        assert_eq!(
            ByteTokenizer::new(258),
            Err(TokenizerError::VocabTooSmall {
                vocab: 258,
                needed: 259
            })
        );
    }
}

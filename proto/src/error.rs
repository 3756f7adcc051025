//! Errors for everything that reads untrusted bytes.

use thiserror::Error;

/// Why a delta checkpoint, frame, segment or codec payload could not be read.
///
/// Every variant names what was being read, so a user sees *where* input went wrong.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("truncated input while reading {what}")]
    Truncated { what: &'static str },
    #[error("{what} is {value}, above the limit of {limit}")]
    TooLarge {
        what: &'static str,
        value: u64,
        limit: u64,
    },
    #[error("not a Starling delta checkpoint (bad magic bytes)")]
    BadMagic,
    #[error("unsupported delta checkpoint format version {found} (this build reads {supported})")]
    UnsupportedVersion { found: u16, supported: u16 },
    #[error("unknown {what} id {id}")]
    UnknownCodec { what: &'static str, id: u8 },
    #[error("corrupted {what}: BLAKE3 mismatch")]
    HashMismatch { what: &'static str },
    #[error("malformed {what}: {detail}")]
    Malformed { what: &'static str, detail: String },
    #[error("{what} has {trailing} unexpected trailing bytes")]
    TrailingBytes { what: &'static str, trailing: usize },
    #[error("zstd payload of {what} is invalid: {detail}")]
    Zstd { what: &'static str, detail: String },
}

impl DecodeError {
    /// A structural error in `what`, described by `detail`.
    pub fn malformed(what: &'static str, detail: impl Into<String>) -> Self {
        Self::Malformed {
            what,
            detail: detail.into(),
        }
    }
}

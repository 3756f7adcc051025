//! The one spelling of hex in Starling: keys, hashes and digests in messages, files and JSON,
//! encoded lower-case and strictly decoded (exactly `2N` digits, either case, nothing else) by
//! the `hex` crate. (Re-exported by [`crate::delta::manifest`], where callers find it.)

use thiserror::Error;

/// Lower-case hex of bytes (for keys, hashes and digests in messages, files and JSON).
pub fn hex(b: &[u8]) -> String {
    ::hex::encode(b)
}

/// Why text is not the hex of the bytes asked for.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum HexError {
    #[error("expected {expected} hex digits, found {found} characters")]
    Length { expected: usize, found: usize },
    #[error("{c:?} at byte {index} is not a hex digit")]
    Digit { c: char, index: usize },
}

/// `N` bytes from exactly `2N` hex digits, either case, nothing else (callers trim what they
/// read from a file).
pub fn parse_hex<const N: usize>(text: &str) -> Result<[u8; N], HexError> {
    let mut out = [0u8; N];
    ::hex::decode_to_slice(text, &mut out).map_err(|e| match e {
        ::hex::FromHexError::InvalidHexCharacter { c, index } => HexError::Digit { c, index },
        ::hex::FromHexError::OddLength | ::hex::FromHexError::InvalidStringLength => {
            HexError::Length {
                expected: 2 * N,
                found: text.chars().count(),
            }
        }
    })?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trips_and_refuses_anything_else() {
        assert_eq!(hex(&[0x00, 0x9f, 0xa0, 0xff]), "009fa0ff");
        assert_eq!(hex(&[]), "");
        assert_eq!(parse_hex::<4>("009fa0ff"), Ok([0x00, 0x9f, 0xa0, 0xff]));
        assert_eq!(parse_hex::<2>("ABcd"), Ok([0xab, 0xcd]));
        let key = [7u8; 32];
        assert_eq!(parse_hex::<32>(&hex(&key)), Ok(key));
        let short = HexError::Length {
            expected: 8,
            found: 6,
        };
        assert_eq!(parse_hex::<4>("009fa0"), Err(short));
        assert!(matches!(
            parse_hex::<4>("009fa0ff0"),
            Err(HexError::Length { found: 9, .. })
        ));
        // What `from_str_radix` would have let through: a sign, spaces, non-ASCII.
        assert_eq!(
            parse_hex::<2>("+f00"),
            Err(HexError::Digit { c: '+', index: 0 })
        );
        assert!(matches!(
            parse_hex::<2>("0f 0"),
            Err(HexError::Digit { c: ' ', .. })
        ));
        // Four characters of six bytes: refused, never sliced inside a character.
        assert!(parse_hex::<3>("ééé").is_err());
    }
}

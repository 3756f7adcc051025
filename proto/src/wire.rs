//! Byte-level reading and writing: LEB128 varints, fixed-width little-endian integers and
//! length-prefixed fields, with every length bounded before it is trusted.

use crate::error::DecodeError;

/// Appends an unsigned LEB128 varint.
#[inline]
pub fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Number of bytes [`put_varint`] writes for `v`.
#[inline]
pub fn varint_len(v: u64) -> usize {
    let bits = 64 - (v | 1).leading_zeros() as usize;
    bits.div_ceil(7)
}

/// Appends a length-prefixed byte string.
pub fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// A cursor over untrusted bytes. Every read checks bounds and names what it was reading.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    pub fn position(&self) -> usize {
        self.pos
    }

    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    pub fn is_empty(&self) -> bool {
        self.remaining() == 0
    }

    pub fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], DecodeError> {
        if self.remaining() < n {
            return Err(DecodeError::Truncated { what });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    pub fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], DecodeError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }

    pub fn u8(&mut self, what: &'static str) -> Result<u8, DecodeError> {
        Ok(self.take(1, what)?[0])
    }

    pub fn u16_le(&mut self, what: &'static str) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }

    pub fn u32_le(&mut self, what: &'static str) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    pub fn u64_le(&mut self, what: &'static str) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// Reads an unsigned LEB128 varint of at most 10 bytes that fits in 64 bits.
    #[inline]
    pub fn varint(&mut self, what: &'static str) -> Result<u64, DecodeError> {
        let mut v: u64 = 0;
        for i in 0..10 {
            let Some(&b) = self.buf.get(self.pos) else {
                return Err(DecodeError::Truncated { what });
            };
            self.pos += 1;
            let chunk = u64::from(b & 0x7f);
            if i == 9 && b > 1 {
                return Err(DecodeError::malformed(what, "varint overflows 64 bits"));
            }
            v |= chunk << (7 * i);
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(DecodeError::malformed(what, "varint longer than 10 bytes"))
    }

    /// Reads a varint and checks it against `limit`.
    pub fn varint_at_most(&mut self, what: &'static str, limit: u64) -> Result<u64, DecodeError> {
        let v = self.varint(what)?;
        if v > limit {
            return Err(DecodeError::TooLarge {
                what,
                value: v,
                limit,
            });
        }
        Ok(v)
    }

    /// Reads a length-prefixed byte string of at most `limit` bytes.
    pub fn bytes(&mut self, what: &'static str, limit: usize) -> Result<&'a [u8], DecodeError> {
        let n = self.varint_at_most(what, limit as u64)? as usize;
        self.take(n, what)
    }

    /// Reads a length-prefixed UTF-8 string of at most `limit` bytes.
    pub fn str(&mut self, what: &'static str, limit: usize) -> Result<&'a str, DecodeError> {
        let b = self.bytes(what, limit)?;
        std::str::from_utf8(b).map_err(|_| DecodeError::malformed(what, "not UTF-8"))
    }

    /// Fails unless every byte was consumed.
    pub fn finish(&self, what: &'static str) -> Result<(), DecodeError> {
        if self.remaining() != 0 {
            return Err(DecodeError::TrailingBytes {
                what,
                trailing: self.remaining(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn varint_golden_bytes() {
        let mut out = Vec::new();
        put_varint(&mut out, 0);
        put_varint(&mut out, 127);
        put_varint(&mut out, 128);
        put_varint(&mut out, 300);
        assert_eq!(out, [0x00, 0x7f, 0x80, 0x01, 0xac, 0x02]);
        let mut out = Vec::new();
        put_varint(&mut out, u64::MAX);
        assert_eq!(out.len(), 10);
        assert_eq!(*out.last().expect("ten bytes"), 0x01);
    }

    #[test]
    fn varint_rejects_overflow_and_truncation() {
        let mut r = Reader::new(&[0xff; 10]);
        assert!(matches!(r.varint("x"), Err(DecodeError::Malformed { .. })));
        let mut r = Reader::new(&[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02]);
        assert!(matches!(r.varint("x"), Err(DecodeError::Malformed { .. })));
        let mut r = Reader::new(&[0x80, 0x80]);
        assert_eq!(r.varint("x"), Err(DecodeError::Truncated { what: "x" }));
    }

    #[test]
    fn bounded_lengths_are_refused_before_reading() {
        let mut buf = Vec::new();
        put_varint(&mut buf, 1 << 40);
        let mut r = Reader::new(&buf);
        assert!(matches!(
            r.bytes("name", 1024),
            Err(DecodeError::TooLarge { .. })
        ));
    }

    proptest! {
        #[test]
        fn varint_round_trips(v in any::<u64>()) {
            let mut out = Vec::new();
            put_varint(&mut out, v);
            prop_assert_eq!(out.len(), varint_len(v));
            let mut r = Reader::new(&out);
            prop_assert_eq!(r.varint("v").expect("decodes"), v);
            prop_assert!(r.is_empty());
        }
    }
}

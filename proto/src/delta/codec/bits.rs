//! A little-endian bit writer and reader (LSB first), the substrate of the Rice coder.

use crate::error::DecodeError;

/// Accumulates bits LSB-first into bytes.
#[derive(Debug, Default)]
pub struct BitWriter {
    out: Vec<u8>,
    acc: u64,
    n: u32,
}

impl BitWriter {
    pub fn with_capacity(bytes: usize) -> Self {
        Self {
            out: Vec::with_capacity(bytes),
            acc: 0,
            n: 0,
        }
    }

    /// Writes the low `count` bits of `value` (`count` ≤ 57).
    #[inline]
    pub fn write(&mut self, value: u64, count: u32) {
        debug_assert!(count <= 57);
        let value = if count == 0 {
            0
        } else {
            value & (u64::MAX >> (64 - count))
        };
        // At most 7 bits are pending, so the 64-bit accumulator holds them and `count`.
        self.acc |= value << self.n;
        self.n += count;
        // Every whole byte out at once, without a loop whose length the CPU cannot predict:
        // all eight bytes are appended and the unfinished ones cut off again.
        let whole = self.n / 8;
        let len = self.out.len();
        self.out.extend_from_slice(&self.acc.to_le_bytes());
        self.out.truncate(len + whole as usize);
        self.acc = self.acc.checked_shr(8 * whole).unwrap_or(0);
        self.n -= 8 * whole;
    }

    /// Writes up to 64 bits in two steps.
    #[inline]
    pub fn write_wide(&mut self, value: u64, count: u32) {
        if count > 32 {
            self.write(value, 32);
            self.write(value >> 32, count - 32);
        } else {
            self.write(value, count);
        }
    }

    /// Writes `count` one-bits followed by a zero-bit.
    #[inline]
    pub fn write_unary(&mut self, mut count: u64) {
        while count >= 32 {
            self.write(u64::from(u32::MAX), 32);
            count -= 32;
        }
        // `count` ones then a zero: (2^count - 1) in count+1 bits.
        self.write((1u64 << count) - 1, count as u32 + 1);
    }

    pub fn finish(mut self) -> Vec<u8> {
        if self.n > 0 {
            self.out.push(self.acc as u8);
        }
        self.out
    }
}

/// Reads bits LSB-first; reading past the end is an error, not zeros.
#[derive(Debug, Clone)]
pub struct BitReader<'a> {
    buf: &'a [u8],
    pos: usize,
    acc: u64,
    n: u32,
}

impl<'a> BitReader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Self {
            buf,
            pos: 0,
            acc: 0,
            n: 0,
        }
    }

    #[inline]
    fn refill(&mut self) {
        if self.pos + 8 <= self.buf.len() && self.n <= 56 {
            let mut w = [0u8; 8];
            w.copy_from_slice(&self.buf[self.pos..self.pos + 8]);
            let word = u64::from_le_bytes(w);
            let take = (64 - self.n) / 8; // whole bytes that fit (≥ 1 since n ≤ 56)
            self.acc |= (word & (u64::MAX >> (64 - 8 * take))) << self.n;
            self.pos += take as usize;
            self.n += 8 * take;
        } else {
            while self.n <= 56 && self.pos < self.buf.len() {
                self.acc |= u64::from(self.buf[self.pos]) << self.n;
                self.pos += 1;
                self.n += 8;
            }
        }
    }

    /// Reads `count` ≤ 57 bits.
    #[inline]
    pub fn read(&mut self, count: u32) -> Result<u64, DecodeError> {
        if self.n < count {
            self.refill();
            if self.n < count {
                return Err(DecodeError::Truncated { what: "bit stream" });
            }
        }
        let v = if count == 0 {
            0
        } else {
            self.acc & (u64::MAX >> (64 - count))
        };
        self.acc = if count == 64 { 0 } else { self.acc >> count };
        self.n -= count;
        Ok(v)
    }

    #[inline]
    pub fn read_wide(&mut self, count: u32) -> Result<u64, DecodeError> {
        if count > 32 {
            let lo = self.read(32)?;
            let hi = self.read(count - 32)?;
            Ok(lo | (hi << 32))
        } else {
            self.read(count)
        }
    }

    /// A Rice code read in one step where it is buffered: fewer than `limit` one-bits, a
    /// zero-bit, then `k ≤ 58` low bits; returns the count of ones and the low bits. `None`,
    /// with nothing consumed, where the code is not all buffered (after one refill) or has
    /// `limit` ones or more: the caller then reads it with [`read_unary`](Self::read_unary)
    /// and [`read_wide`](Self::read_wide), which consume exactly the same bits.
    #[inline(always)]
    pub fn read_rice_buffered(&mut self, k: u32, limit: u32) -> Option<(u64, u64)> {
        if self.n < 57 {
            self.refill();
        }
        // Bits above `n` are zero, so this stops at `n` when all buffered bits are ones.
        let ones = (!self.acc).trailing_zeros();
        let used = ones + 1 + k;
        if ones >= limit || used > self.n {
            return None;
        }
        let low = self.acc.checked_shr(ones + 1).unwrap_or(0) & (u64::MAX >> (63 - k.min(63)) >> 1);
        self.acc = self.acc.checked_shr(used).unwrap_or(0);
        self.n -= used;
        Some((u64::from(ones), low))
    }

    /// Counts one-bits up to the next zero-bit (consumed), giving up after `limit` ones
    /// (then returns `limit` with no zero consumed).
    #[inline]
    pub fn read_unary(&mut self, limit: u64) -> Result<u64, DecodeError> {
        let mut count = 0u64;
        loop {
            if self.n == 0 {
                self.refill();
                if self.n == 0 {
                    return Err(DecodeError::Truncated { what: "bit stream" });
                }
            }
            let ones = (!self.acc).trailing_zeros().min(self.n);
            let room = limit - count;
            if u64::from(ones) >= room {
                // Hit the limit: consume exactly `room` ones.
                self.acc = self.acc.checked_shr(room as u32).unwrap_or(0);
                self.n -= room as u32;
                return Ok(limit);
            }
            count += u64::from(ones);
            if ones < self.n {
                // Found the terminating zero.
                self.acc = self.acc.checked_shr(ones + 1).unwrap_or(0);
                self.n -= ones + 1;
                return Ok(count);
            }
            self.acc = 0;
            self.n = 0;
        }
    }

    /// Bytes not yet consumed, counting partially consumed bytes as consumed.
    pub fn trailing_bytes(&self) -> usize {
        (self.buf.len() - self.pos) + (self.n / 8) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn bits_round_trip(items in proptest::collection::vec((any::<u64>(), 0u32..=64, 0u64..200), 0..200)) {
            let mut w = BitWriter::default();
            for &(v, c, u) in &items {
                w.write_wide(v, c);
                w.write_unary(u);
            }
            let buf = w.finish();
            let mut r = BitReader::new(&buf);
            for &(v, c, u) in &items {
                let mask = if c == 64 { u64::MAX } else { (1u64 << c) - 1 };
                prop_assert_eq!(r.read_wide(c).expect("value"), v & mask);
                prop_assert_eq!(r.read_unary(1000).expect("unary"), u);
            }
            prop_assert_eq!(r.trailing_bytes(), 0);
        }
    }

    /// The bits a reader has left, one by one.
    fn rest(mut r: BitReader<'_>) -> Vec<u64> {
        std::iter::from_fn(|| r.read(1).ok()).collect()
    }

    proptest! {
        #[test]
        fn buffered_rice_reads_what_the_general_reads_read(
            bytes in proptest::collection::vec(any::<u8>(), 0..64),
            k in 0u32..=58,
            limit in 1u32..=64,
            skip in 0u32..16,
        ) {
            // From a random offset, read after read until the one-step read declines: where it
            // answers, it returns and consumes exactly what read_unary + read_wide do.
            let mut r = BitReader::new(&bytes);
            if r.read(skip).is_err() {
                return Ok(());
            }
            loop {
                let mut general = r.clone();
                let expected = general
                    .read_unary(u64::from(limit))
                    .and_then(|q| Ok((q, general.read_wide(k)?)));
                match r.read_rice_buffered(k, limit) {
                    Some(got) => {
                        prop_assert_eq!(Ok(got), expected);
                        // The same bits are left (buffered or not).
                        prop_assert_eq!(rest(r.clone()), rest(general));
                    }
                    None => {
                        // Nothing consumed (a refill only moves bytes into the buffer).
                        let mut again = r.clone();
                        let retry = again
                            .read_unary(u64::from(limit))
                            .and_then(|q| Ok((q, again.read_wide(k)?)));
                        prop_assert_eq!(retry, expected);
                        break;
                    }
                }
            }
        }
    }

    #[test]
    fn unary_limit_stops_without_consuming_the_terminator() {
        let mut w = BitWriter::default();
        w.write_unary(70);
        w.write(0b101, 3);
        let buf = w.finish();
        let mut r = BitReader::new(&buf);
        assert_eq!(r.read_unary(48).expect("limit"), 48);
        assert_eq!(r.read_unary(100).expect("rest"), 22);
        assert_eq!(r.read(3).expect("tail"), 0b101);
    }

    #[test]
    fn reading_past_the_end_is_an_error() {
        let mut r = BitReader::new(&[0xff]);
        assert!(r.read(9).is_err());
        let mut r = BitReader::new(&[0xff]);
        assert!(r.read_unary(100).is_err());
    }
}

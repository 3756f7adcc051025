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

    /// Writes Rice codes of `xs` under parameter `k ≤ 58` (for each gap `x`: `x >> k`
    /// one-bits, a zero-bit, the low `k` bits of `x`) for as long as a code's quotient is
    /// below `limit` and the whole code fits in one [`write`](Self::write) (57 bits); returns
    /// how many it wrote. The same bits as `write_unary` and `write_wide` would write, with
    /// the writer's state in locals through the loop.
    ///
    /// # Panics
    /// If `k > 58`.
    #[inline]
    pub fn write_rice_run(&mut self, k: u32, limit: u32, xs: &[u64]) -> usize {
        assert!(k <= 58, "a Rice parameter is at most 58");
        let mut out = std::mem::take(&mut self.out);
        let (mut acc, mut n) = (self.acc, self.n);
        let low_mask = u64::MAX.checked_shr(64 - k).unwrap_or(0);
        // A code written here takes at most 57 bits.
        out.reserve(xs.len() * 57 / 8 + 8);
        let mut done = 0;
        for &x in xs {
            let q = x >> k;
            // `q < 57` keeps `q + 1 + k` from overflowing and the shifts below 64.
            if q >= u64::from(limit.min(57)) || q as u32 + 1 + k > 57 {
                break;
            }
            let bits = q as u32 + 1 + k;
            // LSB first: q ones, the zero terminator, then the low k bits.
            acc |= (((1u64 << q) - 1) | (x & low_mask) << (q + 1)) << n;
            n += bits;
            let whole = n / 8;
            let len = out.len();
            out.extend_from_slice(&acc.to_le_bytes());
            out.truncate(len + whole as usize);
            acc = acc.checked_shr(8 * whole).unwrap_or(0);
            n -= 8 * whole;
            done += 1;
        }
        self.out = out;
        (self.acc, self.n) = (acc, n);
        done
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

    /// Reads Rice codes into `gaps` (each `q << k | low`: fewer than `limit` ≤ 40 one-bits, a
    /// zero-bit, then `k ≤ 58` low bits) for as long as each is whole in the bits buffered;
    /// returns how many it read. It stops, with nothing of that code consumed, at the first
    /// code that is not: an escape (`limit` ones or more), one longer than the buffer, or one
    /// past the input's last bytes. The caller reads that one with
    /// [`read_unary`](Self::read_unary) and [`read_wide`](Self::read_wide), which consume
    /// exactly the same bits.
    ///
    /// The hot loop of the Rice decoder. Its state lives in locals (the struct's fields, kept
    /// in memory, put a store and a load into every code's dependency chain). After each code
    /// the buffer is refilled without a branch on the count: a whole word is ORed in
    /// unmasked above the `n ≤ 63` bits held, `(63 − n) / 8` whole bytes are counted as read,
    /// and the count becomes `n | 56` (the same number). The bits the word brings above the
    /// count are the stream's next bits, so a later refill ORs the same bits into the same
    /// places. They are cleared before the state is stored back, keeping the reader's
    /// invariant that nothing but zeros lies above the count.
    ///
    /// # Panics
    /// If `k > 58` or `limit > 40`.
    #[inline]
    pub fn read_rice_run(&mut self, k: u32, limit: u32, gaps: &mut [u64]) -> usize {
        assert!(
            k <= 58 && limit <= 40,
            "a Rice parameter is at most 58 and a run's quotient limit at most 40"
        );
        let (buf, mut pos, mut acc, mut n) = (self.buf, self.pos, self.acc, self.n);
        #[inline(always)]
        fn refill(buf: &[u8], pos: &mut usize, acc: &mut u64, n: &mut u32) {
            // Near the end of the input there is no whole word: the codes left are read
            // from what is buffered, until one is not whole.
            if let Some(word) = buf.get(*pos..*pos + 8) {
                let mut w = [0u8; 8];
                w.copy_from_slice(word);
                *acc |= u64::from_le_bytes(w) << *n;
                *pos += ((63 - *n) / 8) as usize;
                *n |= 56;
            }
        }
        if n < 64 {
            refill(buf, &mut pos, &mut acc, &mut n);
        }
        let low_mask = (1u64 << k) - 1;
        let mut got = 0;
        for gap in gaps.iter_mut() {
            let ones = (!acc).trailing_zeros();
            let used = ones + 1 + k;
            if ones >= limit || used > n {
                break;
            }
            // `ones + 1 ≤ 40` and `k ≤ 58`: both shifts stay below 64, and `ones << k` with
            // `ones < 40 < 2⁶` cannot overflow.
            let rest = acc >> (ones + 1);
            *gap = (u64::from(ones) << k) | (rest & low_mask);
            acc = rest >> k;
            n -= used;
            got += 1;
            // `used ≥ 1`, so `n ≤ 63` here.
            refill(buf, &mut pos, &mut acc, &mut n);
        }
        self.pos = pos;
        self.acc = acc & u64::MAX.checked_shr(64 - n).unwrap_or(0);
        self.n = n;
        got
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
        fn rice_runs_read_what_the_general_reads_read(
            bytes in proptest::collection::vec(any::<u8>(), 0..96),
            k in 0u32..=58,
            limit in 1u32..=40,
            skip in 0u32..16,
            room in 1usize..12,
        ) {
            // From a random offset, run after run (each into a buffer of `room` codes) until a
            // run stops short: every code it read is what read_unary + read_wide read, it
            // leaves exactly the bits they leave, and where it stopped they read the same.
            let mut r = BitReader::new(&bytes);
            if r.read(skip).is_err() {
                return Ok(());
            }
            let mut general = r.clone();
            loop {
                let mut gaps = vec![0u64; room];
                let got = r.read_rice_run(k, limit, &mut gaps);
                for &g in &gaps[..got] {
                    let q = general.read_unary(u64::from(limit)).expect("a run's code");
                    prop_assert!(q < u64::from(limit));
                    let low = general.read_wide(k).expect("a run's low bits");
                    prop_assert_eq!(g, (q << k) | low);
                }
                prop_assert_eq!(rest(r.clone()), rest(general.clone()));
                if got < room {
                    break;
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

//! A tiny, dependency-free, seeded pseudo-random generator (SplitMix64).
//!
//! Invariant: the sequence depends only on the seed, on every platform and in
//! every version of this crate, so a profile's `seed` reproduces the same loss
//! and jitter decisions forever. It is not cryptographic and need not be. The one home of
//! SplitMix64 for Starling's own seeded schedules (the fault soak's, the receiving core's
//! simulation).

/// SplitMix64 (Steele, Lea, Flood 2014): 64 bits of state, full period 2^64.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` with 53 bits of precision.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `0..=max` (Lemire's multiply-high; the bias is below 2^-64 × max).
    pub fn next_up_to(&mut self, max: u64) -> u64 {
        if max == u64::MAX {
            return self.next_u64();
        }
        ((u128::from(self.next_u64()) * (u128::from(max) + 1)) >> 64) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_reference_sequence() {
        // First outputs of the reference SplitMix64 for seed 0.
        let mut r = SplitMix64::new(0);
        assert_eq!(r.next_u64(), 0xe220_a839_7b1d_cdaf);
        assert_eq!(r.next_u64(), 0x6e78_9e6a_a1b9_65f4);
        assert_eq!(r.next_u64(), 0x06c4_5d18_8009_454f);
    }

    #[test]
    fn floats_and_ranges_stay_in_bounds() {
        let mut r = SplitMix64::new(7);
        let mut seen_max = false;
        for _ in 0..10_000 {
            let f = r.next_f64();
            assert!((0.0..1.0).contains(&f));
            let v = r.next_up_to(3);
            assert!(v <= 3);
            seen_max |= v == 3;
        }
        assert!(seen_max, "the top of an inclusive range must be reachable");
        assert_eq!(r.next_up_to(0), 0);
    }
}

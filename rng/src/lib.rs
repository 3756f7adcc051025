//! `starling-rng`: SplitMix64, the one seeded pseudo-random generator of Starling's
//! deterministic streams, and its finalizer [`mix64`] for stateless hashing of keys.
//!
//! Its users: the built-in engine's random models (`random_bf16`) and sampling draws, the
//! checkpoint workload generator, the trainer's task, the actor's per-group seeds, the link
//! emulator's loss and jitter (re-exported as `starling_netem::rng`), the fault soak's and
//! the receiving core's simulated schedules. It lives in a crate of its own, with no
//! dependencies, because those users share no lower crate: the engine must not pull in the
//! network emulator or the codec for forty lines of arithmetic.
//!
//! **Invariant: the streams never change.** Every output depends only on the seed, on every
//! platform and in every version: seeded tests, golden values, the fault soak's replayable
//! seeds and the weights of a seeded random model all depend on it. The tests below pin the
//! reference outputs. It is not cryptographic and need not be.

/// The golden-ratio increment of SplitMix64's state (2^64 / φ, odd); also the multiplier
/// users spread a small key (an index, a group) over 64 bits with before [`mix64`].
pub const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's output function (Stafford's "Mix13" variant of the MurmurHash3 finalizer): a
/// bijection of `u64` in which every input bit affects every output bit. Stateless hashing of
/// keys chains it (`mix64(mix64(seed ^ a) ^ b)`).
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// SplitMix64 (Steele, Lea, Flood 2014): 64 bits of state, full period 2^64.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// The stream keyed by `seed` (any value, zero included).
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The next 64 bits: the state advanced by [`GAMMA`], through [`mix64`].
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GAMMA);
        mix64(self.state)
    }

    /// Uniform in `[0, 1)` with 53 bits of precision.
    #[inline]
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
        // First outputs of the reference SplitMix64 (Vigna's splitmix64.c) for seed 0.
        let mut r = SplitMix64::new(0);
        assert_eq!(r.next_u64(), 0xe220_a839_7b1d_cdaf);
        assert_eq!(r.next_u64(), 0x6e78_9e6a_a1b9_65f4);
        assert_eq!(r.next_u64(), 0x06c4_5d18_8009_454f);
        // The finalizer alone: the first output is mix64 of the first state.
        assert_eq!(mix64(GAMMA), 0xe220_a839_7b1d_cdaf);
        assert_eq!(mix64(0), 0);
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

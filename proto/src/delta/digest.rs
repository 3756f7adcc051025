//! The whole-state digest: a 128-bit additive hash over every `(tensor, index, bits)`.
//!
//! `D(W) = Σ h(tensor, i, W[tensor][i]) mod 2¹²⁸`. Because the sum is over elements, a delta
//! moves it by `Σ h(t, i, new) − h(t, i, old)` over the changed elements only: a receiver
//! proves it reached exactly the trainer's weights in O(changes), without rehashing the
//! model. Full per-tensor BLAKE3 (anchors, audits) complements it.
//!
//! Threat model: the digest detects drift, bugs and corruption (a wrong element changes it
//! with probability ≈ 1 − 2⁻⁶⁴ per lane). It is not a cryptographic commitment:
//! authenticity comes from the signed manifest and the per-segment BLAKE3. The element
//! hash is keyed by a per-model key derived from the model id, so digests of different
//! models never coincide by construction.

use std::fmt;

/// A 128-bit state digest.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct StateDigest(pub u128);

impl StateDigest {
    pub fn to_bytes(self) -> [u8; 16] {
        self.0.to_le_bytes()
    }

    pub fn from_bytes(b: [u8; 16]) -> Self {
        Self(u128::from_le_bytes(b))
    }

    /// Adds the contribution of one element.
    #[inline]
    pub fn add(&mut self, h: u128) {
        self.0 = self.0.wrapping_add(h);
    }

    /// Replaces one element's contribution (`old` → `new`).
    #[inline]
    pub fn replace(&mut self, old: u128, new: u128) {
        self.0 = self.0.wrapping_add(new).wrapping_sub(old);
    }

    /// Adds another digest (used to merge per-tensor or per-segment partial sums).
    pub fn merge(&mut self, other: StateDigest) {
        self.0 = self.0.wrapping_add(other.0);
    }
}

impl fmt::Debug for StateDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StateDigest({self})")
    }
}

impl fmt::Display for StateDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&crate::hex_text::hex(&self.to_bytes()))
    }
}

/// The key of the element hash, derived from the model id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DigestKey {
    seeds: [u64; 4],
    key: [u8; 32],
}

impl DigestKey {
    pub fn for_model(model_id: &str) -> Self {
        let key = blake3::derive_key("starling state digest v1", model_id.as_bytes());
        let mut seeds = [0u64; 4];
        for (i, s) in seeds.iter_mut().enumerate() {
            let mut w = [0u8; 8];
            w.copy_from_slice(&key[i * 8..i * 8 + 8]);
            // Odd multipliers never collapse the mixing product to zero on their own.
            *s = u64::from_le_bytes(w) | 1;
        }
        Self { seeds, key }
    }

    /// The per-tensor key: 64 bits of a keyed BLAKE3 of the tensor name.
    pub fn tensor(&self, name: &str) -> TensorKey {
        let h = blake3::keyed_hash(&self.key, name.as_bytes());
        let b = h.as_bytes();
        let mut w = [0u8; 8];
        w.copy_from_slice(&b[..8]);
        let mut v = [0u8; 8];
        v.copy_from_slice(&b[8..16]);
        TensorKey {
            a: u64::from_le_bytes(w),
            b: u64::from_le_bytes(v),
            seeds: self.seeds,
        }
    }
}

/// Everything needed to hash the elements of one tensor.
#[derive(Clone, Copy, Debug)]
pub struct TensorKey {
    a: u64,
    b: u64,
    seeds: [u64; 4],
}

#[inline]
fn fold_mul(x: u64, y: u64) -> u64 {
    let r = u128::from(x) * u128::from(y);
    (r as u64) ^ ((r >> 64) as u64)
}

impl TensorKey {
    /// The 128-bit hash of element `index` holding `bits`.
    #[inline]
    pub fn element(&self, index: u64, bits: u16) -> u128 {
        // (x, y) is an injective encoding of (index, bits) for this tensor.
        let x = index ^ self.a;
        let y = (u64::from(bits) ^ self.b).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let lo = fold_mul(x ^ self.seeds[0], y ^ self.seeds[1]);
        let hi = fold_mul(lo ^ self.seeds[2], x.rotate_left(29) ^ y ^ self.seeds[3]);
        u128::from(lo) | (u128::from(hi) << 64)
    }

    /// Digest contribution of a whole range starting at element `start`.
    pub fn range(&self, start: u64, bits: &[u16]) -> StateDigest {
        let mut d = StateDigest::default();
        for (i, &b) in bits.iter().enumerate() {
            d.add(self.element(start + i as u64, b));
        }
        d
    }

    /// The digest change of replacing `old` by `new` at `positions` (relative to `start`).
    #[inline]
    pub fn delta<P: Copy + Into<u64>>(
        &self,
        start: u64,
        positions: &[P],
        old: &[u16],
        new: &[u16],
    ) -> StateDigest {
        let mut d = StateDigest::default();
        for ((&p, &o), &n) in positions.iter().zip(old).zip(new) {
            let at = start + p.into();
            d.replace(self.element(at, o), self.element(at, n));
        }
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn digest_distinguishes_index_bits_tensor_and_model() {
        let k = DigestKey::for_model("m");
        let t = k.tensor("a");
        let u = k.tensor("b");
        assert_ne!(t.element(0, 1), t.element(1, 1));
        assert_ne!(t.element(0, 1), t.element(0, 2));
        assert_ne!(t.element(0, 1), u.element(0, 1));
        let k2 = DigestKey::for_model("other");
        assert_ne!(t.element(7, 7), k2.tensor("a").element(7, 7));
        // Swapping two values between positions changes the digest (not a multiset hash).
        assert_ne!(t.range(0, &[1, 2]), t.range(0, &[2, 1]));
    }

    proptest! {
        #[test]
        fn incremental_update_equals_full_rehash(
            base in proptest::collection::vec(any::<u16>(), 1..300),
            edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u16>()), 0..50),
        ) {
            let t = DigestKey::for_model("m").tensor("w");
            let mut new = base.clone();
            for (i, v) in &edits {
                new[i.index(base.len())] = *v;
            }
            let positions: Vec<u64> = (0..base.len()).filter(|&i| base[i] != new[i]).map(|i| i as u64).collect();
            let old_v: Vec<u16> = positions.iter().map(|&p| base[p as usize]).collect();
            let new_v: Vec<u16> = positions.iter().map(|&p| new[p as usize]).collect();
            let mut d = t.range(0, &base);
            d.merge(t.delta(0, &positions, &old_v, &new_v));
            prop_assert_eq!(d, t.range(0, &new));
        }
    }
}

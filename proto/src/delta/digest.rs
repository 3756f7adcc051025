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
        let n = positions.len().min(old.len()).min(new.len());
        let (positions, old, new) = (&positions[..n], &old[..n], &new[..n]);
        // Eight changes at a time with AVX-512 where the CPU has it (the hub's encode and
        // every receiver's staging hash each change: 10–20% of both at RL densities, scalar),
        // the rest one by one.
        #[cfg(target_arch = "x86_64")]
        if n >= v4::LANES
            && let Some(simd) = pulp::x86::V4::try_new()
        {
            let done = n / v4::LANES * v4::LANES;
            let mut d = v4::delta(
                simd,
                self,
                start,
                &positions[..done],
                &old[..done],
                &new[..done],
            );
            d.merge(self.delta_scalar(start, &positions[done..], &old[done..], &new[done..]));
            return d;
        }
        self.delta_scalar(start, positions, old, new)
    }

    /// [`delta`](Self::delta), one change at a time (and the reference the vector form is
    /// tested against).
    fn delta_scalar<P: Copy + Into<u64>>(
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

#[cfg(target_arch = "x86_64")]
mod v4 {
    //! [`TensorKey::delta`] with AVX-512 through `pulp`'s `V4` token, eight changes per
    //! step. AVX-512 has no 64×64→128-bit multiply, so each [`fold_mul`](super::fold_mul)
    //! is put together from four 32×32→64-bit ones; each lane keeps its own 128-bit sum as
    //! two 64-bit halves with the carry and borrow taken from unsigned compares. The lanes'
    //! sums are added at the end: the same value as the scalar sum, since both add the same
    //! terms modulo 2¹²⁸.

    use core::arch::x86_64::__m512i;

    use pulp::x86::V4;

    use super::{StateDigest, TensorKey};

    /// Changes per step.
    pub(super) const LANES: usize = 8;

    #[derive(Clone, Copy)]
    struct Lanes(V4);

    impl Lanes {
        #[inline(always)]
        fn splat(self, v: u64) -> __m512i {
            self.0.avx512f._mm512_set1_epi64(v as i64)
        }

        #[inline(always)]
        fn xor(self, a: __m512i, b: __m512i) -> __m512i {
            self.0.avx512f._mm512_xor_si512(a, b)
        }

        #[inline(always)]
        fn add(self, a: __m512i, b: __m512i) -> __m512i {
            self.0.avx512f._mm512_add_epi64(a, b)
        }

        /// `fold_mul` per lane: the low and high halves of the 128-bit product, xored.
        #[inline(always)]
        fn fold_mul(self, p: __m512i, q: __m512i) -> __m512i {
            let f = self.0.avx512f;
            let low32 = self.splat(0xffff_ffff);
            let (ph, qh) = (f._mm512_srli_epi64::<32>(p), f._mm512_srli_epi64::<32>(q));
            // `_mm512_mul_epu32` multiplies the low 32 bits of each lane.
            let ll = f._mm512_mul_epu32(p, q);
            let lh = f._mm512_mul_epu32(p, qh);
            let hl = f._mm512_mul_epu32(ph, q);
            let hh = f._mm512_mul_epu32(ph, qh);
            // The middle column: below 3·2³², so no carry is lost.
            let mid = self.add(
                self.add(f._mm512_srli_epi64::<32>(ll), f._mm512_and_si512(lh, low32)),
                f._mm512_and_si512(hl, low32),
            );
            let lo = f._mm512_or_si512(
                f._mm512_and_si512(ll, low32),
                f._mm512_slli_epi64::<32>(mid),
            );
            let hi = self.add(
                self.add(hh, f._mm512_srli_epi64::<32>(lh)),
                self.add(
                    f._mm512_srli_epi64::<32>(hl),
                    f._mm512_srli_epi64::<32>(mid),
                ),
            );
            self.xor(lo, hi)
        }
    }

    /// A tensor key's words, in every lane.
    struct Keys {
        a: __m512i,
        b: __m512i,
        seeds: [__m512i; 4],
        golden: __m512i,
    }

    impl Lanes {
        /// Eight bit patterns, one per 64-bit lane.
        #[inline(always)]
        fn widen(self, v: &[u16]) -> __m512i {
            let mut w = [0u16; LANES];
            w.copy_from_slice(v);
            self.0.avx512f._mm512_cvtepu16_epi64(pulp::cast(w))
        }

        /// [`TensorKey::element`] per lane, as its low and high halves, for index lanes
        /// `x` (already `index ^ a`).
        #[inline(always)]
        fn element(self, k: &Keys, x: __m512i, bits: __m512i) -> (__m512i, __m512i) {
            let [s0, s1, s2, s3] = k.seeds;
            let y = self
                .0
                .avx512dq
                ._mm512_mullo_epi64(self.xor(bits, k.b), k.golden);
            let lo = self.fold_mul(self.xor(x, s0), self.xor(y, s1));
            let r = self.xor(self.xor(self.0.avx512f._mm512_rol_epi64::<29>(x), y), s3);
            let hi = self.fold_mul(self.xor(lo, s2), r);
            (lo, hi)
        }
    }

    /// The element hashes' 128-bit sum per lane, as low and high halves.
    #[derive(Clone, Copy)]
    struct Sum {
        lo: __m512i,
        hi: __m512i,
    }

    /// The digest change of changes whose count is a multiple of [`LANES`].
    pub(super) fn delta<P: Copy + Into<u64>>(
        simd: V4,
        key: &TensorKey,
        start: u64,
        positions: &[P],
        old: &[u16],
        new: &[u16],
    ) -> StateDigest {
        simd.vectorize(
            #[inline(always)]
            || delta_lanes(Lanes(simd), key, start, positions, old, new),
        )
    }

    #[inline(always)]
    fn delta_lanes<P: Copy + Into<u64>>(
        s: Lanes,
        key: &TensorKey,
        start: u64,
        positions: &[P],
        old: &[u16],
        new: &[u16],
    ) -> StateDigest {
        let f = s.0.avx512f;
        let one = s.splat(1);
        let k = Keys {
            a: s.splat(key.a),
            b: s.splat(key.b),
            seeds: key.seeds.map(|v| s.splat(v)),
            golden: s.splat(0x9E37_79B9_7F4A_7C15),
        };
        let zero = f._mm512_setzero_si512();
        let mut sum = Sum { lo: zero, hi: zero };
        let chunks = positions
            .chunks_exact(LANES)
            .zip(old.chunks_exact(LANES))
            .zip(new.chunks_exact(LANES));
        for ((p, o), n) in chunks {
            let mut at = [0u64; LANES];
            for (a, &p) in at.iter_mut().zip(p) {
                *a = start + p.into();
            }
            let x = s.xor(pulp::cast(at), k.a);
            let (new_lo, new_hi) = s.element(&k, x, s.widen(n));
            let (old_lo, old_hi) = s.element(&k, x, s.widen(o));
            // + new: carry where the low half wrapped below what was added.
            let lo = s.add(sum.lo, new_lo);
            let carry = f._mm512_cmplt_epu64_mask(lo, new_lo);
            let hi = s.add(sum.hi, new_hi);
            let hi = f._mm512_mask_add_epi64(hi, carry, hi, one);
            // − old: borrow where the low half is below what is taken away.
            let borrow = f._mm512_cmplt_epu64_mask(lo, old_lo);
            sum.lo = f._mm512_sub_epi64(lo, old_lo);
            let hi = f._mm512_sub_epi64(hi, old_hi);
            sum.hi = f._mm512_mask_sub_epi64(hi, borrow, hi, one);
        }
        let (lo, hi): ([u64; LANES], [u64; LANES]) = (pulp::cast(sum.lo), pulp::cast(sum.hi));
        let mut d = StateDigest::default();
        for (&lo, &hi) in lo.iter().zip(&hi) {
            d.add(u128::from(lo) | (u128::from(hi) << 64));
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
        fn vector_and_scalar_digest_changes_agree(
            model in "[a-z]{1,8}",
            start in any::<u64>(),
            changes in proptest::collection::vec((any::<u32>(), any::<u16>(), any::<u16>()), 0..100),
        ) {
            // Any positions, bits and offsets (wrapping aside: `start + p` stays in range):
            // the 128-bit carries and borrows of every lane must come out as the scalar sum's.
            let t = DigestKey::for_model(&model).tensor("w");
            let start = start >> 1;
            let positions: Vec<u32> = changes.iter().map(|c| c.0).collect();
            let old: Vec<u16> = changes.iter().map(|c| c.1).collect();
            let new: Vec<u16> = changes.iter().map(|c| c.2).collect();
            let wide: Vec<u64> = positions.iter().map(|&p| u64::from(p)).collect();
            let expected = t.delta_scalar(start, &positions, &old, &new);
            prop_assert_eq!(t.delta(start, &positions, &old, &new), expected);
            prop_assert_eq!(t.delta(start, &wide, &old, &new), expected);
            // The vector form itself, on whole steps of lanes (where the CPU has AVX-512; the
            // calls above then go through it too, and elsewhere compare scalar with scalar).
            #[cfg(target_arch = "x86_64")]
            if let Some(simd) = pulp::x86::V4::try_new() {
                let whole = positions.len() / v4::LANES * v4::LANES;
                let (p, o, n) = (&positions[..whole], &old[..whole], &new[..whole]);
                prop_assert_eq!(
                    v4::delta(simd, &t, start, p, o, n),
                    t.delta_scalar(start, p, o, n)
                );
            }
        }
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

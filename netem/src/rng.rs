//! SplitMix64, the seeded generator of the link model's loss and jitter decisions: a
//! re-export of `starling-rng`, the one home of Starling's seeded streams (so a profile's
//! `seed` reproduces the same decisions forever; the reference outputs are pinned there).

pub use starling_rng::SplitMix64;

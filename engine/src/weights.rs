//! Named BF16 tensors in memory, and random ones for tests and benchmarks.
//!
//! [`random_bf16`] draws every tensor of a config from a fixed SplitMix64 stream (a pure
//! function of the seed and the tensor's name), so benchmarks and tests across crates get
//! the same model without a checkpoint on disk.

use std::collections::BTreeMap;

use starling_rng::{SplitMix64, mix64};

use crate::config::ModelConfig;
use crate::model::{LoadError, Model};

/// One tensor: its shape and its BF16 bits, row-major.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bf16Tensor {
    pub shape: Vec<usize>,
    pub bits: Vec<u16>,
}

/// Tensors by checkpoint name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Bf16Tensors(pub BTreeMap<String, Bf16Tensor>);

impl Bf16Tensors {
    /// Looks a tensor up in the form [`Model::from_bf16`] takes.
    pub fn lookup(&self, name: &str) -> Option<(&[usize], &[u16])> {
        self.0
            .get(name)
            .map(|t| (t.shape.as_slice(), t.bits.as_slice()))
    }
}

impl Model {
    /// Builds a model from in-memory tensors.
    pub fn from_tensors(config: ModelConfig, tensors: &Bf16Tensors) -> Result<Self, LoadError> {
        Self::from_bf16(config, |n| tensors.lookup(n))
    }
}

/// Random weights for `config`: norms uniform in 1 ± 0.2, the embedding with unit spread,
/// projections with standard deviation `1/√fan_in` (the LM head twice that, so sampling
/// distributions are neither flat nor one-hot), rounded to BF16 (nearest even).
pub fn random_bf16(config: &ModelConfig, seed: u64) -> Bf16Tensors {
    let mut out = BTreeMap::new();
    for (name, shape) in config.tensor_shapes() {
        let key = name
            .bytes()
            .fold(mix64(seed ^ 0xA076_1D64_78BD_642F), |h, b| {
                mix64(h ^ u64::from(b))
            });
        let mut rng = SplitMix64::new(key);
        let n: usize = shape.iter().product();
        let fan_in = *shape.last().unwrap_or(&1) as f32;
        let (center, half_width) = if shape.len() == 1 {
            (1.0, 0.2)
        } else if name.contains("embed_tokens") {
            (0.0, 3f32.sqrt())
        } else if name.starts_with("lm_head") {
            (0.0, 2.0 * (3.0 / fan_in).sqrt())
        } else {
            (0.0, (3.0 / fan_in).sqrt())
        };
        let bits = (0..n)
            .map(|_| {
                let u = (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
                let x = center + half_width * (2.0 * u - 1.0);
                half::bf16::from_f32(x).to_bits()
            })
            .collect();
        out.insert(name, Bf16Tensor { shape, bits });
    }
    Bf16Tensors(out)
}

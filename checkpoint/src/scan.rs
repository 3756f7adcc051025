//! Whole-checkpoint checks a publisher runs before anything of a checkpoint leaves it: which
//! tensors hold NaN or ±Inf (as BF16, after the cast an F32 or F16 source gets), and whether a
//! checkpoint differs from another at all.
//!
//! Both read in place from the checkpoints' mappings where they can, chunk by chunk, in
//! parallel over tensors, and release each chunk's pages once read: memory stays at a few
//! chunks per thread whatever the model size. The non-finite scan reads every element (one
//! pass over the checkpoint, ~the cost of a BLAKE3 over it); the comparison stops at the first
//! difference, which for a real training step is in the first chunk.

use rayon::prelude::*;
use starling_proto::delta::diff::count_nonfinite;

use crate::safetensors::{Checkpoint, CheckpointError, TensorInfo};

/// Elements per read.
const CHUNK: usize = 1 << 20;

/// A tensor holding non-finite values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NonFinite {
    pub name: String,
    /// Elements that are NaN (any payload, either sign).
    pub nan: u64,
    /// Elements that are +Inf or −Inf.
    pub inf: u64,
}

/// Runs `f` over `t`'s elements as BF16 bits, chunk by chunk; stops at the first `true`.
fn chunks(
    c: &Checkpoint,
    t: &TensorInfo,
    f: &mut dyn FnMut(u64, &[u16]) -> bool,
) -> Result<bool, CheckpointError> {
    let numel = t.numel();
    let mut buf = Vec::new();
    let mut start = 0u64;
    while start < numel {
        let n = (numel - start).min(CHUNK as u64) as usize;
        let stop = match c.bf16_range(t, start, n) {
            Some(bits) => f(start, bits),
            None => {
                buf.resize(n, 0);
                c.read_bf16(t, start, &mut buf)?;
                f(start, &buf)
            }
        };
        c.release(t, start, n);
        if stop {
            return Ok(true);
        }
        start += n as u64;
    }
    Ok(false)
}

/// Every tensor of `c` that holds a NaN or an infinity as BF16, with the counts, by name.
pub fn nonfinite(c: &Checkpoint) -> Result<Vec<NonFinite>, CheckpointError> {
    let found: Vec<Option<NonFinite>> = c
        .tensors()
        .par_iter()
        .map(|t| {
            let (mut nan, mut inf) = (0u64, 0u64);
            chunks(c, t, &mut |_, bits| {
                let (n, i) = count_nonfinite(bits);
                (nan, inf) = (nan + n, inf + i);
                false
            })?;
            Ok((nan + inf > 0).then(|| NonFinite {
                name: t.name.clone(),
                nan,
                inf,
            }))
        })
        .collect::<Result<_, CheckpointError>>()?;
    Ok(found.into_iter().flatten().collect())
}

/// The name of a tensor in which `new` differs from `old` (as BF16 bits), or `None` when they
/// are bit for bit the same. Both must have the same layout
/// ([`Checkpoint::check_same_layout`]).
pub fn first_change(old: &Checkpoint, new: &Checkpoint) -> Result<Option<String>, CheckpointError> {
    old.check_same_layout(new)?;
    let mut other = Vec::new();
    for (a, b) in old.tensors().iter().zip(new.tensors()) {
        let differs = chunks(new, b, &mut |start, bits| {
            other.resize(bits.len(), 0);
            let theirs = match old.bf16_range(a, start, bits.len()) {
                Some(x) => x,
                None => {
                    if old.read_bf16(a, start, &mut other).is_err() {
                        // Unreadable base: call it a change; the diff will say what is wrong.
                        return true;
                    }
                    &other
                }
            };
            let d = theirs != bits;
            old.release(a, start, bits.len());
            d
        })?;
        if differs {
            return Ok(Some(a.name.clone()));
        }
    }
    Ok(None)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::writer::SafetensorsWriter;

    fn write(path: &std::path::Path, tensors: &[(&str, Vec<u16>)]) {
        let layout: Vec<(String, Vec<u64>)> = tensors
            .iter()
            .map(|(n, v)| ((*n).to_owned(), vec![v.len() as u64]))
            .collect();
        let mut w = SafetensorsWriter::create(path, &layout, None).unwrap();
        let mut sorted: Vec<_> = tensors.to_vec();
        sorted.sort_by(|a, b| a.0.cmp(b.0));
        for (_, v) in &sorted {
            w.write(v).unwrap();
        }
        w.finish().unwrap();
    }

    #[test]
    fn nan_and_inf_are_counted_per_tensor_and_everything_else_is_finite() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("c.safetensors");
        // NaN payloads of both signs, ±Inf, and the finite extremes around them.
        let bad = vec![
            0x7fc0, 0xffc1, 0x7f81, 0x7f80, 0xff80, 0x7f7f, 0xff7f, 0x0001, 0x8000,
        ];
        let big = vec![0x3f80; CHUNK + 3];
        let mut big_bad = big.clone();
        big_bad[CHUNK + 1] = 0x7f80;
        write(&p, &[("a", bad), ("b", big), ("c", big_bad)]);
        let c = Checkpoint::open(&p).unwrap();
        assert_eq!(
            nonfinite(&c).unwrap(),
            vec![
                NonFinite {
                    name: "a".into(),
                    nan: 3,
                    inf: 2
                },
                NonFinite {
                    name: "c".into(),
                    nan: 0,
                    inf: 1
                },
            ]
        );
    }

    #[test]
    fn the_first_changed_tensor_is_named_and_identical_checkpoints_have_none() {
        let d = tempfile::tempdir().unwrap();
        let (p1, p2, p3) = (
            d.path().join("1.safetensors"),
            d.path().join("2.safetensors"),
            d.path().join("3.safetensors"),
        );
        let base = vec![0x3f80u16; CHUNK + 5];
        let mut changed = base.clone();
        changed[CHUNK + 4] ^= 1;
        write(&p1, &[("a", vec![1, 2]), ("b", base.clone())]);
        write(&p2, &[("a", vec![1, 2]), ("b", base)]);
        write(&p3, &[("a", vec![1, 2]), ("b", changed)]);
        let (c1, c2, c3) = (
            Checkpoint::open(&p1).unwrap(),
            Checkpoint::open(&p2).unwrap(),
            Checkpoint::open(&p3).unwrap(),
        );
        assert_eq!(first_change(&c1, &c2).unwrap(), None);
        assert_eq!(first_change(&c1, &c3).unwrap().as_deref(), Some("b"));
    }
}

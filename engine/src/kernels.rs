//! The numeric kernels: dot products, matrix products, sums, RMSNorm, SiLU, rotary
//! embedding and causal attention for one query.
//!
//! **Determinism invariant.** Every reduction here has exactly one order of operations,
//! which depends only on its length:
//!
//! - a matrix product output `out[t][r] = Σ_i x[t][i] · w[r][i]` is summed in blocks of
//!   [`KBLOCK`] terms: each block in one f32 from 0, `i` ascending, then the block sums added in
//!   block order into one f32 from 0;
//! - a [`dot`] product or [`sum`] of `n` terms (norms, attention scores, softmax) keeps
//!   [`LANES`] independent accumulators over the first `n − n % LANES` terms (lane `j` adds
//!   terms `j, j + LANES, …` in order), folds them with a fixed tree (lanes `j` and
//!   `j + 4`, then pairs, then the last two), then adds the remaining terms one by one.
//!
//! [`matmul`] computes a block of outputs at once for speed (a few token rows against a few
//! [`PANEL`]s of weight rows, the block's accumulators held in registers), but every output
//! lane sees the same operations in the same order whichever block shape, batch, or thread
//! computes it. Work is split across threads only by independent outputs (weight panels,
//! tokens), never inside a reduction. Hence an output value does not depend on the batch it
//! is computed in, on how many tokens are processed together, or on the thread count. Rust
//! never contracts `a * b + c` into a fused multiply-add on its own, so two call sites
//! cannot round differently.
//!
//! Speed without `unsafe` or intrinsics: weights are packed once, at load, into panels of
//! [`PANEL`] rows stored column by column ([`Packed`]), so the inner loop is a broadcast of
//! one input value times eight contiguous weights added into eight independent accumulators
//! — no horizontal reduction — which LLVM maps one to one onto vector registers.

use crate::config::RopeScaling;

/// Independent accumulators per reduction.
pub const LANES: usize = 8;

/// Terms per block of a matrix product's sum: each output sums blocks of `KBLOCK` products in
/// order, then adds the block sums in order. Same cost as one running sum, but its rounding
/// error grows with `KBLOCK + k / KBLOCK` rather than `k` terms: on SmolLM2 (k up to 1,536)
/// a plain running sum left the logits twice as far from the exact ones as transformers'
/// float32.
pub const KBLOCK: usize = 32;

/// Weight rows per packed panel (the width of the matmul's accumulator vectors).
pub const PANEL: usize = 8;

/// Below this many multiply-adds a [`matmul`] runs on the calling thread: spawning costs more.
const PARALLEL_MIN_MACS: usize = 1 << 18;

/// Folds the lane accumulators with a fixed tree: (0+4, 1+5, 2+6, 3+7), then pairs, then one.
#[inline(always)]
fn fold(a: [f32; LANES]) -> f32 {
    let b = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    let c = [b[0] + b[2], b[1] + b[3]];
    c[0] + c[1]
}

/// The dot product of `a` and `b` (equal lengths) in the canonical order.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let (bc, bt) = b.as_chunks::<LANES>();
    let ac = &a[..b.len()].as_chunks::<LANES>().0[..bc.len()];
    let mut acc = [0f32; LANES];
    for (av, bv) in ac.iter().zip(bc) {
        for j in 0..LANES {
            acc[j] += av[j] * bv[j];
        }
    }
    let mut s = fold(acc);
    let base = b.len() - bt.len();
    for (i, &y) in bt.iter().enumerate() {
        s += a[base + i] * y;
    }
    s
}

/// The sum of `xs` in the canonical order (the same lanes and tree as [`dot`]).
pub fn sum(xs: &[f32]) -> f32 {
    let (c, t) = xs.as_chunks::<LANES>();
    let mut acc = [0f32; LANES];
    for v in c {
        for j in 0..LANES {
            acc[j] += v[j];
        }
    }
    let mut s = fold(acc);
    for &x in t {
        s += x;
    }
    s
}

/// A BF16 weight matrix `[m, k]` (row-major `[out, in]` as stored in checkpoints) packed
/// for [`matmul`]: panel `p` holds rows `8p..8p + 8` column by column (`panels[p·k + i][j] =
/// w[8p + j][i]`), the last panel padded with zero rows. Kept in BF16 (half the memory
/// traffic of f32; decoding is bandwidth-bound) and widened exactly in the inner loop.
#[derive(Debug, Clone)]
pub struct Packed {
    panels: Vec<[u16; PANEL]>,
    rows: usize,
    cols: usize,
}

impl Packed {
    /// Packs the BF16 bits `w` (`rows × cols`, row-major).
    pub fn new(w: &[u16], rows: usize, cols: usize) -> Self {
        debug_assert_eq!(w.len(), rows * cols);
        let np = rows.div_ceil(PANEL);
        let mut panels = vec![[0u16; PANEL]; np * cols];
        for (r, row) in w.chunks_exact(cols.max(1)).enumerate().take(rows) {
            let (p, j) = (r / PANEL, r % PANEL);
            for (i, &v) in row.iter().enumerate() {
                panels[p * cols + i][j] = v;
            }
        }
        Self { panels, rows, cols }
    }

    /// Output rows (`m`).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input columns (`k`).
    pub fn cols(&self) -> usize {
        self.cols
    }

    fn panel(&self, p: usize) -> &[[u16; PANEL]] {
        &self.panels[p * self.cols..(p + 1) * self.cols]
    }

    fn num_panels(&self) -> usize {
        self.rows.div_ceil(PANEL)
    }
}

/// `T` token rows against `P` panels: `acc[t][p][j] = Σ_i x[t][i] · panel_p[i][j]`, each
/// lane summed blockwise (see [`KBLOCK`]).
#[inline(always)]
fn micro<const T: usize, const P: usize>(
    x: [&[f32]; T],
    panels: [&[[u16; PANEL]]; P],
) -> [[[f32; PANEL]; P]; T] {
    let k = panels[0].len();
    let mut total = [[[0f32; PANEL]; P]; T];
    let mut start = 0;
    while start < k {
        let end = (start + KBLOCK).min(k);
        let acc = micro_run(x.map(|r| &r[start..end]), panels.map(|p| &p[start..end]));
        for t in 0..T {
            for p in 0..P {
                for j in 0..PANEL {
                    total[t][p][j] += acc[t][p][j];
                }
            }
        }
        start = end;
    }
    total
}

/// One block of [`micro`]: each lane accumulated in one f32 from 0, `i = 0, 1, …` in order.
/// The slices are cut to one length first, so the loop runs without bounds checks.
#[inline(always)]
fn micro_run<const T: usize, const P: usize>(
    x: [&[f32]; T],
    panels: [&[[u16; PANEL]]; P],
) -> [[[f32; PANEL]; P]; T] {
    let k = panels[0].len();
    let x = x.map(|r| &r[..k]);
    let panels = panels.map(|p| &p[..k]);
    let mut acc = [[[0f32; PANEL]; P]; T];
    for i in 0..k {
        for t in 0..T {
            let xi = x[t][i];
            for p in 0..P {
                let w = &panels[p][i];
                for j in 0..PANEL {
                    acc[t][p][j] += xi * f32::from_bits(u32::from(w[j]) << 16);
                }
            }
        }
    }
    acc
}

/// `out[t][r] = Σ_i x[t][i] · w[r][i]` for the `n` token rows of `x` (`n × k`); `out` is
/// `n × m`. Bit-identical for every `n`, grouping and thread count (see the module doc).
pub fn matmul(x: &[f32], n: usize, w: &Packed, out: &mut [f32], threads: usize) {
    let (m, k) = (w.rows, w.cols);
    debug_assert_eq!(x.len(), n * k);
    debug_assert_eq!(out.len(), n * m);
    let np = w.num_panels();
    let threads = threads.clamp(1, np.max(1));
    if threads == 1 || n * m * k < PARALLEL_MIN_MACS {
        matmul_panels(x, n, w, 0, np, out);
        return;
    }
    // Each thread takes a contiguous range of panels into a private `n × columns` block,
    // copied into place afterwards: the outputs are independent, so the split is invisible.
    let per = np.div_ceil(threads);
    let blocks: Vec<(usize, usize, Vec<f32>)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|i| (i * per, ((i + 1) * per).min(np)))
            .filter(|(p0, p1)| p0 < p1)
            .map(|(p0, p1)| {
                s.spawn(move || {
                    let (c0, c1) = (p0 * PANEL, (p1 * PANEL).min(m));
                    let mut buf = vec![0f32; n * (c1 - c0)];
                    matmul_panels(x, n, w, p0, p1, &mut buf);
                    (c0, c1, buf)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| match h.join() {
                Ok(b) => b,
                Err(p) => std::panic::resume_unwind(p),
            })
            .collect()
    });
    for (c0, c1, buf) in blocks {
        let width = c1 - c0;
        for t in 0..n {
            out[t * m + c0..t * m + c1].copy_from_slice(&buf[t * width..(t + 1) * width]);
        }
    }
}

/// Panels `p0..p1` against all `n` token rows into `out`, whose rows hold the columns
/// `8·p0 .. min(8·p1, m)`.
///
/// On x86-64 CPUs with AVX-512 or AVX2 the same code runs compiled for those instruction
/// sets (wider vectors, more registers, so larger blocks), chosen at run time. The
/// arithmetic is the same IEEE operations in the same order (separate multiply and add, never
/// a fused multiply-add), so the results are bit-identical on every CPU; only speed differs.
fn matmul_panels(x: &[f32], n: usize, w: &Packed, p0: usize, p1: usize, out: &mut [f32]) {
    // `pulp` checks the CPU once and runs the closure inside a function compiled for its
    // features: no `unsafe` here.
    #[cfg(target_arch = "x86_64")]
    {
        if let Some(simd) = pulp::x86::V4::try_new() {
            simd.vectorize(|| matmul_blocks::<4, 4>(x, n, w, p0, p1, out));
            return;
        }
        if let Some(simd) = pulp::x86::V3::try_new() {
            simd.vectorize(|| matmul_blocks::<4, 2>(x, n, w, p0, p1, out));
            return;
        }
    }
    matmul_blocks::<2, 2>(x, n, w, p0, p1, out);
}

/// The panel loop with blocks of `TB` tokens × `PB` panels (the register tile), leftover
/// tokens one at a time against the same panels, leftover panels one by one. Every shape runs
/// the same per-lane sums.
#[inline(always)]
fn matmul_blocks<const TB: usize, const PB: usize>(
    x: &[f32],
    n: usize,
    w: &Packed,
    p0: usize,
    p1: usize,
    out: &mut [f32],
) {
    let k = w.cols;
    let c0 = p0 * PANEL;
    let width = (p1 * PANEL).min(w.rows) - c0;
    let row = |t: usize| &x[t * k..(t + 1) * k];
    let mut store = |t: usize, p: usize, lanes: &[f32; PANEL]| {
        let c = p * PANEL - c0;
        let take = PANEL.min(width - c);
        out[t * width + c..t * width + c + take].copy_from_slice(&lanes[..take]);
    };
    let mut p = p0;
    while p + PB <= p1 {
        let panels: [&[[u16; PANEL]]; PB] = std::array::from_fn(|i| w.panel(p + i));
        let mut t = 0;
        while t + TB <= n {
            let a = micro::<TB, PB>(std::array::from_fn(|i| row(t + i)), panels);
            for (dt, per_token) in a.iter().enumerate() {
                for (dp, lanes) in per_token.iter().enumerate() {
                    store(t + dt, p + dp, lanes);
                }
            }
            t += TB;
        }
        while t < n {
            let a = micro::<1, PB>([row(t)], panels);
            for (dp, lanes) in a[0].iter().enumerate() {
                store(t, p + dp, lanes);
            }
            t += 1;
        }
        p += PB;
    }
    while p < p1 {
        let panel = [w.panel(p)];
        let mut t = 0;
        while t + TB <= n {
            let a = micro::<TB, 1>(std::array::from_fn(|i| row(t + i)), panel);
            for (dt, per_token) in a.iter().enumerate() {
                store(t + dt, p, &per_token[0]);
            }
            t += TB;
        }
        while t < n {
            let a = micro::<1, 1>([row(t)], panel);
            store(t, p, &a[0][0]);
            t += 1;
        }
        p += 1;
    }
}

/// RMSNorm of each `w.len()`-wide row of `x` in place: `x · (mean(x²) + eps)^-½ · w`.
pub fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
    let d = w.len();
    for row in x.chunks_exact_mut(d) {
        let ms = dot(row, row) / d as f32;
        let r = 1.0 / (ms + eps).sqrt();
        for (v, &wi) in row.iter_mut().zip(w) {
            *v = (*v * r) * wi;
        }
    }
}

/// SwiGLU's gate: `gate[i] = silu(gate[i]) · up[i]`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        let s = *g / (1.0 + (-*g).exp());
        *g = s * u;
    }
}

/// Rotary position embedding tables in Hugging Face's "rotate_half" layout: for position
/// `p` and `i < head_dim / 2`, angle `p · θ^(-2i/head_dim)`; dimension `i` pairs with
/// `i + head_dim / 2`. Computed in f64 and rounded once to f32.
#[derive(Debug, Clone)]
pub struct Rope {
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl Rope {
    pub fn new(head_dim: usize, theta: f64, max_positions: usize) -> Self {
        Self::scaled(head_dim, theta, RopeScaling::None, max_positions)
    }

    /// Tables with the frequencies scaled as `scaling` says (transformers' formulas, in f64).
    pub fn scaled(head_dim: usize, theta: f64, scaling: RopeScaling, max_positions: usize) -> Self {
        let half = head_dim / 2;
        let inv: Vec<f64> = (0..half)
            .map(|i| 1.0 / theta.powf((2 * i) as f64 / head_dim as f64))
            .map(|f| match scaling {
                RopeScaling::None => f,
                RopeScaling::Linear { factor } => f / factor,
                RopeScaling::Llama3 {
                    factor,
                    low_freq_factor: lo,
                    high_freq_factor: hi,
                    original_max_position_embeddings: old,
                } => {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen > old / lo {
                        f / factor
                    } else if wavelen < old / hi {
                        f
                    } else {
                        let smooth = (old / wavelen - lo) / (hi - lo);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                }
            })
            .collect();
        let mut cos = Vec::with_capacity(max_positions * half);
        let mut sin = Vec::with_capacity(max_positions * half);
        for p in 0..max_positions {
            for &f in &inv {
                let a = p as f64 * f;
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
            }
        }
        Self { half, cos, sin }
    }

    /// Rotates every `head_dim`-wide head of `x` for position `pos`:
    /// `x·cos + rotate_half(x)·sin` with `rotate_half(a, b) = (-b, a)`.
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        let h = self.half;
        let cos = &self.cos[pos * h..(pos + 1) * h];
        let sin = &self.sin[pos * h..(pos + 1) * h];
        for head in x.chunks_exact_mut(2 * h) {
            let (a, b) = head.split_at_mut(h);
            for i in 0..h {
                let (x1, x2) = (a[i], b[i]);
                a[i] = x1 * cos[i] - x2 * sin[i];
                b[i] = x2 * cos[i] + x1 * sin[i];
            }
        }
    }
}

/// Causal grouped-query attention for one query token over the first `len` cached keys
/// and values (rows of width `kv_heads · head_dim`), writing `heads · head_dim` outputs.
/// Scores are `q·k / √head_dim`; softmax subtracts the max and sums with [`sum`]; the
/// output accumulates `p_j · v_j` for `j = 0, 1, …, len − 1` in that order. Both the
/// incremental and the full-sequence paths call this with the same keys, so they agree
/// bit for bit.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    len: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let group = heads / kv_heads;
    let kvd = kv_heads * head_dim;
    let scale = 1.0 / (head_dim as f32).sqrt();
    for h in 0..heads {
        let g = h / group;
        let qh = &q[h * head_dim..(h + 1) * head_dim];
        scores.clear();
        scores.extend((0..len).map(|j| {
            let kj = &keys[j * kvd + g * head_dim..j * kvd + (g + 1) * head_dim];
            dot(qh, kj) * scale
        }));
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
        }
        let inv = 1.0 / sum(scores);
        let oh = &mut out[h * head_dim..(h + 1) * head_dim];
        oh.fill(0.0);
        for (j, &e) in scores.iter().enumerate() {
            let p = e * inv;
            let vj = &values[j * kvd + g * head_dim..j * kvd + (g + 1) * head_dim];
            for (o, &v) in oh.iter_mut().zip(vj) {
                *o += p * v;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// BF16 weights and the f32 values they stand for.
    fn bf16_data(n: usize, salt: u32) -> (Vec<u16>, Vec<f32>) {
        let bits: Vec<u16> = data(n, salt)
            .iter()
            .map(|x| (x.to_bits() >> 16) as u16)
            .collect();
        let vals = bits
            .iter()
            .map(|&b| f32::from_bits(u32::from(b) << 16))
            .collect();
        (bits, vals)
    }

    fn data(n: usize, salt: u32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ salt) as f32 / u32::MAX as f32 - 0.5)
            .collect()
    }

    /// The definition: per output, f32 sums of blocks of KBLOCK terms, added in order.
    fn naive(x: &[f32], w: &[f32], n: usize, m: usize, k: usize) -> Vec<f32> {
        let mut out = vec![0f32; n * m];
        for t in 0..n {
            for r in 0..m {
                let mut total = 0f32;
                for block in (0..k).collect::<Vec<_>>().chunks(KBLOCK) {
                    let mut acc = 0f32;
                    for &i in block {
                        acc += x[t * k + i] * w[r * k + i];
                    }
                    total += acc;
                }
                out[t * m + r] = total;
            }
        }
        out
    }

    fn to_bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn matmul_is_the_blockwise_sum_bitwise_for_any_batch_and_threads() {
        for k in [1, 7, 8, 13, 64, 67] {
            for m in [1, 8, 9, 37, 40] {
                let (bits, w) = bf16_data(m * k, 1);
                let packed = Packed::new(&bits, m, k);
                for n in [1, 2, 3, 4, 5, 9] {
                    let x = data(n * k, 2);
                    let want = to_bits(&naive(&x, &w, n, m, k));
                    for threads in [1, 2, 3] {
                        let mut out = vec![0f32; n * m];
                        matmul(&x, n, &packed, &mut out, threads);
                        assert_eq!(to_bits(&out), want, "k {k} m {m} n {n} threads {threads}");
                    }
                }
            }
        }
    }

    #[test]
    fn every_block_shape_and_instruction_set_gives_the_blockwise_sum_bitwise() {
        // The portable tiles and the ones the AVX2 / AVX-512 paths use, called directly (the
        // dispatching `matmul` above runs whichever this CPU has).
        let (k, m) = (37, 45);
        let (bits, w) = bf16_data(m * k, 5);
        let packed = Packed::new(&bits, m, k);
        let np = packed.num_panels();
        for n in [1, 3, 4, 7, 9] {
            let x = data(n * k, 6);
            let want = to_bits(&naive(&x, &w, n, m, k));
            let mut runs: Vec<(&str, Vec<f32>)> = Vec::new();
            let mut run = |name, f: &dyn Fn(&mut [f32])| {
                let mut out = vec![0f32; n * m];
                f(&mut out);
                runs.push((name, out));
            };
            run("1x1", &|o| matmul_blocks::<1, 1>(&x, n, &packed, 0, np, o));
            run("2x2", &|o| matmul_blocks::<2, 2>(&x, n, &packed, 0, np, o));
            run("4x2", &|o| matmul_blocks::<4, 2>(&x, n, &packed, 0, np, o));
            run("4x4", &|o| matmul_blocks::<4, 4>(&x, n, &packed, 0, np, o));
            run("dispatch", &|o| matmul_panels(&x, n, &packed, 0, np, o));
            for (name, out) in runs {
                assert_eq!(to_bits(&out), want, "{name}, n {n}");
            }
        }
    }

    #[test]
    fn threaded_matmul_is_bitwise_equal_to_single_threaded() {
        let (n, m, k) = (7, 301, 200);
        let x = data(n * k, 3);
        let (bits, w) = bf16_data(m * k, 4);
        let packed = Packed::new(&bits, m, k);
        assert!(
            n * m * k >= PARALLEL_MIN_MACS,
            "shape must take the threaded path"
        );
        let mut one = vec![0f32; n * m];
        let mut many = vec![0f32; n * m];
        matmul(&x, n, &packed, &mut one, 1);
        matmul(&x, n, &packed, &mut many, 3);
        assert_eq!(to_bits(&one), to_bits(&many));
        assert_eq!(to_bits(&one), to_bits(&naive(&x, &w, n, m, k)));
    }

    #[test]
    fn dot_and_sum_are_accurate() {
        let a = data(1001, 5);
        let b = data(1001, 6);
        let exact: f64 = a
            .iter()
            .zip(&b)
            .map(|(x, y)| f64::from(*x) * f64::from(*y))
            .sum();
        assert!((f64::from(dot(&a, &b)) - exact).abs() < 1e-4);
        let s: f64 = a.iter().map(|&x| f64::from(x)).sum();
        assert!((f64::from(sum(&a)) - s).abs() < 1e-4);
    }
}

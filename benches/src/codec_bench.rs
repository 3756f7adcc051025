//! Side-by-side benchmark of Starling's delta codec.
//!
//! For each learning rate it generates a consecutive checkpoint pair with the workload
//! generator and measures, in the same run and on the same bytes:
//! - encoded size of Starling and of the peers' encodings (implemented here from their
//!   papers' descriptions, and slime's from its source: the new BF16 bytes XOR the base's,
//!   zstd-1 per changed tensor), and the empirical entropy bounds;
//! - diff+encode throughput (dense GB/s scanned) on 1 thread and on all threads, next to
//!   a plain two-buffer compare loop over the same bytes;
//! - decode (staging) speed, commit-time apply next to a bare scatter of the same pairs,
//!   and the digest update cost per change.
//!
//! `cargo run --release -p starling-benches --bin codec-bench -- --help`

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Parser;
use rayon::prelude::*;
use starling_checkpoint::workload::{ModelSpec, TrainConfig, generate_in_memory};
use starling_proto::delta::apply::{StagingBuffers, VersionedWeights, full_digest, scatter};
use starling_proto::delta::codec::value::ulp_step_zigzag;
use starling_proto::delta::codec::{IndexCodec, ValueCodec};
use starling_proto::delta::container::read_delta;
use starling_proto::delta::diff::{count_differences, diff_range};
use starling_proto::delta::digest::DigestKey;
use starling_proto::delta::encode::{DeltaHeader, EncoderConfig, encode_in_memory, flat_pairs};
use starling_proto::delta::manifest::TrustPolicy;
use starling_proto::delta::segment::PartPayload;
use starling_proto::wire::put_varint;

// The actor's allocator, so that staging here costs what it costs in the actor.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser, Debug)]
#[command(about = "Starling codec benchmark: sizes vs peers and bounds, speed vs a compare loop")]
struct Args {
    /// Model preset of the workload generator (tiny, small, 100m, 0.5b, 1.5b).
    #[arg(long, default_value = "100m")]
    model: String,
    /// Learning rates to generate pairs at (the defaults give ~0.3%, 1%, 2% and 5% of
    /// elements changed on the 100m preset).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "4e-7,1.5e-6,3.5e-6,1.1e-5"
    )]
    lrs: Vec<f32>,
    /// Timed repetitions per measurement (the median is reported).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Only run diff+encode this many times on the first learning rate (for profilers).
    #[arg(long)]
    profile_encode: Option<usize>,
    /// Only stage (decode, verify, seal) the first learning rate's delta this many times
    /// (for profilers).
    #[arg(long)]
    profile_stage: Option<usize>,
    /// With --profile-stage: pause this long between stagings (untimed), as versions come
    /// seconds apart in a run; the allocator gives idle memory back meanwhile.
    #[arg(long, default_value_t = 0)]
    profile_stage_gap_ms: u64,
    /// With --profile-stage: hand each staging's vectors to the next (as the actor hands an
    /// undo log's vectors to the next version's staging).
    #[arg(long)]
    profile_stage_recycle: bool,
    /// The codec set the profile modes use: `default` or `v1` (the first release's codecs).
    #[arg(long, default_value = "default")]
    profile_codecs: String,
    /// Only measure encoded sizes (they do not depend on timing); skip the speed tables.
    #[arg(long)]
    sizes_only: bool,
    /// Keep generated checkpoint pairs in this directory and reuse them (generation takes
    /// longer than the measurements on large presets). Off by default.
    #[arg(long)]
    cache_dir: Option<std::path::PathBuf>,
}

type Model = BTreeMap<String, Vec<u16>>;

fn main() -> Result<()> {
    let args = Args::parse();
    let spec = ModelSpec::preset(&args.model).context("unknown model preset")?;
    let threads = rayon::current_num_threads();
    println!(
        "# codec-bench: model {} ({:.1} M params, {:.1} MB BF16), {} threads, {} reps (median)\n",
        spec.name,
        spec.numel() as f64 / 1e6,
        spec.numel() as f64 * 2.0 / 1e6,
        threads,
        args.reps
    );
    let row_lens: BTreeMap<String, usize> = spec
        .tensors
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                t.shape.last().copied().unwrap_or(1) as usize,
            )
        })
        .collect();
    if args.profile_encode.is_some() || args.profile_stage.is_some() {
        let lr = args.lrs.first().copied().unwrap_or(3e-6);
        let (old, new) = pair(&spec, lr, args.seed, args.cache_dir.as_deref())?;
        let ts = flat_pairs(&old, &new);
        let hdr = header(&old);
        let profile_cfg = match args.profile_codecs.as_str() {
            "v1" => v1_config(),
            "adaptive" => adaptive_config(),
            "default" => EncoderConfig::default(),
            other => anyhow::bail!("unknown --profile-codecs {other} (default, adaptive, v1)"),
        };
        if let Some(n) = args.profile_encode {
            let c = cpu_seconds();
            let t = Instant::now();
            let mut bytes = 0;
            for _ in 0..n {
                bytes += encode_in_memory(hdr.clone(), profile_cfg.clone(), &ts, None)
                    .0
                    .len();
            }
            println!(
                "{n} encodes, {bytes} bytes, {:.3} s, {:.3} CPU s",
                t.elapsed().as_secs_f64(),
                cpu_seconds() - c
            );
        }
        if let Some(n) = args.profile_stage {
            let (bytes, _) = encode_in_memory(hdr.clone(), profile_cfg.clone(), &ts, None);
            let delta = read_delta(&bytes, &TrustPolicy::AnySigner)?;
            let w =
                VersionedWeights::new("bench", old.clone(), 1, hdr.pre_digest.unwrap_or_default());
            let buffers = Arc::new(StagingBuffers::new());
            let (mut wall, mut cpu) = (0.0, 0.0);
            for i in 0..n {
                if i > 0 && args.profile_stage_gap_ms > 0 {
                    std::thread::sleep(Duration::from_millis(args.profile_stage_gap_ms));
                }
                let (c, t) = (cpu_seconds(), Instant::now());
                let mut st = w.stager();
                if args.profile_stage_recycle {
                    st = st.with_buffers(buffers.clone());
                }
                for s in &delta.segments {
                    let e = &delta.manifest.manifest.segments[s.seq as usize];
                    st.stage_segment(s, e.hash, e.frame_len, w.weights())?;
                }
                st.stage_manifest(delta.manifest.clone())?;
                let sealed = std::hint::black_box(st.seal(&TrustPolicy::AnySigner)?);
                (wall, cpu) = (wall + t.elapsed().as_secs_f64(), cpu + cpu_seconds() - c);
                if args.profile_stage_recycle {
                    buffers.recycle_sealed(sealed);
                }
            }
            println!(
                "{n} stagings of {} changes, {wall:.3} s, {cpu:.3} CPU s",
                delta.manifest.manifest.total_changes(),
            );
        }
        return Ok(());
    }
    let mut size_rows = Vec::new();
    let mut speed_rows = Vec::new();
    for &lr in &args.lrs {
        let (old, new) = pair(&spec, lr, args.seed, args.cache_dir.as_deref())?;
        size_rows.push(sizes(lr, &old, &new, &row_lens));
        if !args.sizes_only {
            speed_rows.push(speeds(lr, &old, &new, args.reps)?);
        }
    }
    print_sizes(&size_rows);
    if !args.sizes_only {
        print_speeds(&speed_rows, threads);
    }
    Ok(())
}

/// Steps 1 and 2 of the workload generator at `lr` (step 0 is the warm start), read from
/// `cache` when a previous run left them there.
fn pair(spec: &ModelSpec, lr: f32, seed: u64, cache: Option<&Path>) -> Result<(Model, Model)> {
    let file = cache.map(|d| d.join(format!("{}-lr{lr:e}-seed{seed}.pair", spec.name)));
    if let Some(f) = &file
        && let Ok(bytes) = std::fs::read(f)
        && let Some(p) = parse_pair(&bytes)
    {
        return Ok(p);
    }
    let mut steps = generate_in_memory(
        spec,
        2,
        &TrainConfig {
            seed,
            lr,
            ..TrainConfig::default()
        },
    );
    let new = steps.pop().context("generator returned no step 2")?;
    let old = steps.pop().context("generator returned no step 1")?;
    if let Some(f) = &file {
        if let Some(d) = f.parent() {
            std::fs::create_dir_all(d).with_context(|| format!("create {}", d.display()))?;
        }
        let mut out = Vec::new();
        for (name, o) in &old {
            let n = &new[name];
            out.extend_from_slice(&(name.len() as u64).to_le_bytes());
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(&(o.len() as u64).to_le_bytes());
            out.extend(o.iter().chain(n).flat_map(|v| v.to_le_bytes()));
        }
        let tmp = f.with_extension("tmp");
        std::fs::write(&tmp, &out).with_context(|| format!("write {}", tmp.display()))?;
        std::fs::rename(&tmp, f).with_context(|| format!("rename to {}", f.display()))?;
    }
    Ok((old, new))
}

/// The cache file's layout: per tensor, name length u64, name, element count u64, the old
/// then the new BF16 words (little-endian). `None` for a truncated or malformed file.
fn parse_pair(mut b: &[u8]) -> Option<(Model, Model)> {
    fn take<'a>(b: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
        if b.len() < n {
            return None;
        }
        let (h, t) = b.split_at(n);
        *b = t;
        Some(h)
    }
    fn u64le(b: &mut &[u8]) -> Option<u64> {
        Some(u64::from_le_bytes(take(b, 8)?.try_into().ok()?))
    }
    let words = |x: &[u8]| -> Vec<u16> {
        x.chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect()
    };
    let (mut old, mut new) = (Model::new(), Model::new());
    while !b.is_empty() {
        let len = usize::try_from(u64le(&mut b)?).ok()?;
        let name = String::from_utf8(take(&mut b, len)?.to_vec()).ok()?;
        let n = usize::try_from(u64le(&mut b)?).ok()?;
        let o = words(take(&mut b, n.checked_mul(2)?)?);
        let v = words(take(&mut b, n.checked_mul(2)?)?);
        old.insert(name.clone(), o);
        new.insert(name, v);
    }
    Some((old, new))
}

struct SizeRow {
    lr: f32,
    elements: u64,
    changes: u64,
    starling: usize,
    /// The same encoder limited to the first release's codecs.
    starling_v1: usize,
    /// The default without the table-driven codecs.
    starling_adaptive: usize,
    /// Payload bytes of positions, values and dense parts.
    split: [usize; 3],
    split_v1: [usize; 3],
    /// The bounds' parts, in bytes.
    mask_bits: f64,
    mask_ctx_bits: f64,
    step_bits: f64,
    naive: usize,
    sparrow: usize,
    pulse: usize,
    /// int32 flat positions + BF16 values, zstd-1 over the whole model.
    pos_vals: usize,
    /// slime's disk delta: each changed tensor's BF16 bytes XORed with the base, zstd-1.
    slime: usize,
    bound: f64,
    bound_ctx: f64,
}

fn header(model: &Model) -> DeltaHeader {
    let names: Vec<String> = model.keys().cloned().collect();
    DeltaHeader {
        model_id: "bench".into(),
        base_version: 1,
        version: 2,
        created_unix_ms: 0,
        pre_digest: Some(full_digest("bench", model, &names)),
    }
}

/// zstd level 1: the level of the PULSE-style baseline, and the level slime hard-codes for its
/// XOR deltas (`zstandard.ZstdCompressor(level=1)` in THUDM/slime's
/// `update_weight_from_disk_delta.py`).
fn zstd1(b: &[u8]) -> usize {
    zstd::bulk::compress(b, 1)
        .map(|c| c.len())
        .unwrap_or(b.len())
}

/// `row_lens`: last dimension of each tensor, for the 2-D COO baseline.
/// The encoder restricted to the codecs of the first release (no base-conditioned
/// contexts), for the side-by-side columns.
fn v1_config() -> EncoderConfig {
    let mut c = EncoderConfig::default();
    c.choice.index = IndexCodec::V1.to_vec();
    c.choice.value = ValueCodec::V1.to_vec();
    c
}

/// The default without the table-driven codecs (index 6, value 5): what the default was
/// before them, with the adaptive range-coded codecs, for the side-by-side columns.
fn adaptive_config() -> EncoderConfig {
    let mut c = EncoderConfig::default();
    c.choice
        .index
        .retain(|&i| i != IndexCodec::ExpClassGapsRans);
    c.choice.value.retain(|&v| v != ValueCodec::UlpStepRans);
    c
}

fn sizes(lr: f32, old: &Model, new: &Model, row_lens: &BTreeMap<String, usize>) -> SizeRow {
    let pairs = flat_pairs(old, new);
    let (bytes, _) = encode_in_memory(header(old), EncoderConfig::default(), &pairs, None);
    let (v1_bytes, _) = encode_in_memory(header(old), v1_config(), &pairs, None);
    let (adaptive_bytes, _) = encode_in_memory(header(old), adaptive_config(), &pairs, None);
    let split = |bytes: &[u8]| -> [usize; 3] {
        let mut b = [0usize; 3];
        if let Ok(d) = read_delta(bytes, &TrustPolicy::AnySigner) {
            for p in d.segments.iter().flat_map(|s| &s.parts) {
                match &p.payload {
                    PartPayload::Sparse {
                        index_bytes,
                        value_bytes,
                        ..
                    } => {
                        b[0] += index_bytes.len();
                        b[1] += value_bytes.len();
                    }
                    PartPayload::Dense { bytes, .. } => b[2] += bytes.len(),
                }
            }
        }
        b
    };
    let mut naive = 0;
    let mut sparrow = Vec::new();
    let (mut p_rows, mut p_cols, mut p_vals) = (Vec::new(), Vec::new(), Vec::new());
    let (mut s_pos, mut s_vals) = (Vec::new(), Vec::new());
    let mut slime = 0;
    let mut xor = Vec::new();
    let mut changes = 0u64;
    let mut elements = 0u64;
    let mut mask_bits = 0f64;
    let mut mask_ctx_bits = 0f64;
    let mut residual_hist: BTreeMap<u16, u64> = BTreeMap::new();
    for (name, o) in old {
        let n = &new[name];
        let d = diff_range(o, n);
        elements += o.len() as u64;
        changes += d.len() as u64;
        naive += d.len() * 6;
        // SparrowRL: delta-coded LEB128 indices (per tensor) + raw BF16 values.
        let mut prev = 0u64;
        for &p in &d.positions {
            put_varint(&mut sparrow, p - prev);
            prev = p;
        }
        for v in &d.new {
            sparrow.extend_from_slice(&v.to_le_bytes());
        }
        // PULSE-style: per-tensor 2-D COO, uint8 row deltas (255 + u32 escape), uint16
        // column deltas within a row (absolute at a new row), BF16 values; zstd-1 on top.
        let cols = row_lens.get(name).copied().unwrap_or(o.len()).max(1);
        let (mut pr, mut pc) = (0usize, 0usize);
        for &p in &d.positions {
            let (r, c) = (p as usize / cols, p as usize % cols);
            let dr = r - pr;
            if dr < 255 {
                p_rows.push(dr as u8);
            } else {
                p_rows.push(255);
                p_rows.extend_from_slice(&(dr as u32).to_le_bytes());
            }
            let dc = if dr == 0 { c - pc } else { c };
            p_cols.extend_from_slice(&(dc as u16).to_le_bytes());
            pr = r;
            pc = c;
        }
        for v in &d.new {
            p_vals.extend_from_slice(&v.to_le_bytes());
        }
        // int32 flat positions + BF16 values, zstd-1 (a sparse COO baseline).
        for (&p, &v) in d.positions.iter().zip(&d.new) {
            s_pos.extend_from_slice(&(p as u32).to_le_bytes());
            s_vals.extend_from_slice(&v.to_le_bytes());
        }
        // slime (disk delta, its default `xor` encoding): the new tensor's bytes XOR the
        // base's over every element, dense and mostly zeros, zstd-1 per tensor; a tensor
        // without changes is not sent. (Its safetensors header and per-tensor checksums are
        // left out, as Starling's per-tensor BLAKE3 is.)
        if !d.is_empty() {
            xor.clear();
            xor.extend(o.iter().zip(n).flat_map(|(a, b)| (a ^ b).to_le_bytes()));
            slime += zstd1(&xor);
        }
        // Bounds: order-0 mask entropy per tensor; mask entropy given the base value's
        // BF16 exponent; order-0 entropy of the ULP step over all changes.
        mask_bits += o.len() as f64 * h2(d.len() as f64 / o.len() as f64);
        let mut by_exp = [[0u64; 2]; 256];
        let mut is_changed = vec![false; o.len()];
        for &p in &d.positions {
            is_changed[p as usize] = true;
        }
        for (v, &c) in o.iter().zip(&is_changed) {
            by_exp[((v >> 7) & 0xFF) as usize][usize::from(c)] += 1;
        }
        for [u, c] in by_exp {
            let t = (u + c) as f64;
            if t > 0.0 {
                mask_ctx_bits += t * h2(c as f64 / t);
            }
        }
        for (&a, &b) in d.old.iter().zip(&d.new) {
            *residual_hist.entry(ulp_step_zigzag(a, b)).or_default() += 1;
        }
    }
    let total: u64 = residual_hist.values().sum();
    let residual_bits: f64 = residual_hist
        .values()
        .map(|&c| -(c as f64) * (c as f64 / total as f64).log2())
        .sum();
    let mut pulse_all = p_rows;
    pulse_all.extend_from_slice(&p_cols);
    pulse_all.extend_from_slice(&p_vals);
    let mut pos_vals = s_pos;
    pos_vals.extend_from_slice(&s_vals);
    SizeRow {
        lr,
        elements,
        changes,
        starling: bytes.len(),
        starling_v1: v1_bytes.len(),
        starling_adaptive: adaptive_bytes.len(),
        split: split(&bytes),
        split_v1: split(&v1_bytes),
        mask_bits: mask_bits / 8.0,
        mask_ctx_bits: mask_ctx_bits / 8.0,
        step_bits: residual_bits / 8.0,
        naive,
        sparrow: sparrow.len(),
        pulse: zstd1(&pulse_all),
        pos_vals: zstd1(&pos_vals),
        slime,
        bound: (mask_bits + residual_bits) / 8.0,
        bound_ctx: (mask_ctx_bits + residual_bits) / 8.0,
    }
}

fn h2(p: f64) -> f64 {
    if p <= 0.0 || p >= 1.0 {
        0.0
    } else {
        -(p * p.log2() + (1.0 - p) * (1.0 - p).log2())
    }
}

fn print_sizes(rows: &[SizeRow]) {
    println!("### Encoded size (bytes per changed element; whole-model totals in MB)\n");
    println!(
        "| lr | density | changes | naive i32+bf16 | SparrowRL | PULSE-style | i32 pos + bf16, zstd-1 | slime (XOR, zstd-1) | Starling v1 codecs | Starling adaptive codecs | **Starling** | bound (mask+step) | bound (mask\\|exp + step) | vs SparrowRL | vs slime | vs best baseline | vs v1 codecs | ÷ adaptive codecs | vs bound (mask+step) | vs bound (mask\\|exp + step) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        let per = |b: f64| b / r.changes.max(1) as f64;
        let best = r
            .naive
            .min(r.sparrow)
            .min(r.pulse)
            .min(r.pos_vals)
            .min(r.slime) as f64;
        println!(
            "| {:.1e} | {:.2}% | {} | {:.2} ({:.1}) | {:.2} ({:.1}) | {:.2} ({:.1}) | {:.2} ({:.1}) | {:.2} ({:.1}) | {:.2} ({:.1}) | {:.2} ({:.1}) | **{:.2} ({:.1})** | {:.2} | {:.2} | {:.2}× smaller | {:.2}× smaller | {:.2}× smaller | {:.2}× smaller | {:.3}× | {:.2}× | {:.2}× |",
            r.lr,
            100.0 * r.changes as f64 / r.elements as f64,
            r.changes,
            per(r.naive as f64),
            r.naive as f64 / 1e6,
            per(r.sparrow as f64),
            r.sparrow as f64 / 1e6,
            per(r.pulse as f64),
            r.pulse as f64 / 1e6,
            per(r.pos_vals as f64),
            r.pos_vals as f64 / 1e6,
            per(r.slime as f64),
            r.slime as f64 / 1e6,
            per(r.starling_v1 as f64),
            r.starling_v1 as f64 / 1e6,
            per(r.starling_adaptive as f64),
            r.starling_adaptive as f64 / 1e6,
            per(r.starling as f64),
            r.starling as f64 / 1e6,
            per(r.bound),
            per(r.bound_ctx),
            r.sparrow as f64 / r.starling as f64,
            r.slime as f64 / r.starling as f64,
            best / r.starling as f64,
            r.starling_v1 as f64 / r.starling as f64,
            r.starling as f64 / r.starling_adaptive as f64,
            r.starling as f64 / r.bound,
            r.starling as f64 / r.bound_ctx,
        );
    }
    let r = &rows[0];
    println!(
        "\nDense BF16 checkpoint: {:.1} MB.\n",
        r.elements as f64 * 2.0 / 1e6
    );
    println!("### Where the bytes go (bytes per changed element)\n");
    println!(
        "| lr | positions, v1 codecs | **positions** | mask bound | mask\\|exp bound | values, v1 codecs | **values** | step bound (order 0) | dense parts | rest (headers, manifest) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        let per = |b: f64| b / r.changes.max(1) as f64;
        println!(
            "| {:.1e} | {:.3} | **{:.3}** | {:.3} | {:.3} | {:.3} | **{:.3}** | {:.3} | {:.3} | {:.3} |",
            r.lr,
            per(r.split_v1[0] as f64),
            per(r.split[0] as f64),
            per(r.mask_bits),
            per(r.mask_ctx_bits),
            per(r.split_v1[1] as f64),
            per(r.split[1] as f64),
            per(r.step_bits),
            per(r.split[2] as f64),
            per((r.starling - r.split.iter().sum::<usize>()) as f64),
        );
    }
    println!();
}

struct SpeedRow {
    lr: f32,
    dense_bytes: f64,
    changes: u64,
    compare_1: f64,
    encode_1: f64,
    /// The encoder limited to the first release's codecs.
    encode_1_v1: f64,
    /// The default without the table-driven codecs.
    encode_1_adaptive: f64,
    compare_n: f64,
    encode_n: f64,
    sparrow_1: f64,
    decode_1: f64,
    decode_1_v1: f64,
    decode_1_adaptive: f64,
    /// Staging with every thread (parts of a segment decode in parallel).
    decode_n: f64,
    commit: f64,
    scatter: f64,
    digest_ns: f64,
    memcpy: f64,
}

/// CPU time of this process so far (every thread's time on a CPU, from
/// `/proc/self/task/*/schedstat`, in nanoseconds there): on a machine shared with other work,
/// the time the measured code ran rather than the time it waited for a core. 0 where the
/// file is missing.
fn cpu_seconds() -> f64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0.0;
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum::<u64>() as f64
        / 1e9
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn time<T>(reps: usize, mut f: impl FnMut() -> T) -> f64 {
    median(
        (0..reps)
            .map(|_| {
                let t = Instant::now();
                std::hint::black_box(f());
                t.elapsed().as_secs_f64()
            })
            .collect(),
    )
}

/// The median time of each of `fs` over `reps` rounds, each round running every `f` in
/// turn, twice: the first run, untimed, lets the pool it runs on wake and warm up after the
/// others'.
fn time_round_robin<T, const N: usize>(reps: usize, fs: [&dyn Fn() -> T; N]) -> [f64; N] {
    let mut times: [Vec<f64>; N] = core::array::from_fn(|_| Vec::with_capacity(reps));
    for _ in 0..reps {
        for (f, t) in fs.iter().zip(&mut times) {
            std::hint::black_box(f());
            let start = Instant::now();
            std::hint::black_box(f());
            t.push(start.elapsed().as_secs_f64());
        }
    }
    times.map(median)
}

/// One row of the speed tables. "1T" runs on a pool of one thread; "NT" on the process's
/// own pool (`RAYON_NUM_THREADS`), which the hub and the actor use too. A second pool of N
/// threads built here beside it ran encode and staging 5–15% slower than the process's pool
/// on the 2-vCPU machine of `docs/benchmarks.md` (not explained; `--profile-encode` and
/// `--profile-stage`, which run on the process's pool alone, agree with the process's pool).
fn speeds(lr: f32, old: &Model, new: &Model, reps: usize) -> Result<SpeedRow> {
    let one = rayon::ThreadPoolBuilder::new().num_threads(1).build()?;
    let ts = flat_pairs(old, new);
    let hdr = header(old);
    let dense_bytes = 2.0 * 2.0 * old.values().map(Vec::len).sum::<usize>() as f64; // both buffers
    let compare = || -> usize {
        ts.par_iter()
            .map(|t| {
                t.old
                    .par_chunks(1 << 22)
                    .zip(t.new.par_chunks(1 << 22))
                    .map(|(a, b)| count_differences(a, b))
                    .sum::<usize>()
            })
            .sum()
    };
    let encode = || {
        encode_in_memory(hdr.clone(), EncoderConfig::default(), &ts, None)
            .0
            .len()
    };
    let encode_v1 = || {
        encode_in_memory(hdr.clone(), v1_config(), &ts, None)
            .0
            .len()
    };
    let encode_adaptive = || {
        encode_in_memory(hdr.clone(), adaptive_config(), &ts, None)
            .0
            .len()
    };
    let sparrow = || -> usize {
        ts.par_iter()
            .map(|t| {
                let d = diff_range(t.old, t.new);
                let mut out = Vec::with_capacity(d.len() * 4);
                let mut prev = 0;
                for &p in &d.positions {
                    put_varint(&mut out, p - prev);
                    prev = p;
                }
                for v in &d.new {
                    out.extend_from_slice(&v.to_le_bytes());
                }
                out.len()
            })
            .sum()
    };
    let memcpy_src: Vec<u16> = old.values().flatten().copied().collect();
    let mut memcpy_dst = vec![0u16; memcpy_src.len()];
    let memcpy = time(reps, || memcpy_dst.copy_from_slice(&memcpy_src));
    // Round robin, so that a slower minute of a shared machine weighs on every column alike
    // and the ratios (÷ compare, ÷ SparrowRL, 1T→NT) compare like with like.
    let [
        compare_1,
        encode_1,
        encode_1_v1,
        encode_1_adaptive,
        sparrow_1,
        compare_n,
        encode_n,
    ] = time_round_robin(
        reps,
        [
            &|| one.install(compare),
            &|| one.install(encode),
            &|| one.install(encode_v1),
            &|| one.install(encode_adaptive),
            &|| one.install(sparrow),
            &compare,
            &encode,
        ],
    );

    // Decode = staging (verify, decode to absolute bits, gather undo log, digest change).
    let (bytes, _) = encode_in_memory(hdr.clone(), EncoderConfig::default(), &ts, None);
    let delta = read_delta(&bytes, &TrustPolicy::AnySigner)?;
    let (bytes_v1, _) = encode_in_memory(hdr.clone(), v1_config(), &ts, None);
    let delta_v1 = read_delta(&bytes_v1, &TrustPolicy::AnySigner)?;
    let (bytes_adaptive, _) = encode_in_memory(hdr.clone(), adaptive_config(), &ts, None);
    let delta_adaptive = read_delta(&bytes_adaptive, &TrustPolicy::AnySigner)?;
    let pre = hdr.pre_digest.unwrap_or_default();
    let stage_delta = |delta: &starling_proto::delta::container::Delta,
                       w: &VersionedWeights<Model>|
     -> Result<_> {
        let mut st = w.stager();
        for s in &delta.segments {
            let e = &delta.manifest.manifest.segments[s.seq as usize];
            st.stage_segment(s, e.hash, e.frame_len, w.weights())?;
        }
        st.stage_manifest(delta.manifest.clone())?;
        Ok(st.seal(&TrustPolicy::AnySigner)?)
    };
    let stage = |w: &VersionedWeights<Model>| stage_delta(&delta, w);
    let w = VersionedWeights::new("bench", old.clone(), 1, pre);
    // Each delta stages once before it is timed, so that a refusal fails the bench.
    stage(&w)?;
    stage_delta(&delta_v1, &w)?;
    stage_delta(&delta_adaptive, &w)?;
    let [decode_1, decode_1_v1, decode_1_adaptive, decode_n] = time_round_robin(
        reps,
        [
            &|| one.install(|| stage(&w).is_ok()),
            &|| one.install(|| stage_delta(&delta_v1, &w).is_ok()),
            &|| one.install(|| stage_delta(&delta_adaptive, &w).is_ok()),
            &|| stage(&w).is_ok(),
        ],
    );
    // Commit vs bare scatter of the same pairs, each on a fresh copy of the base.
    let mut commits = Vec::new();
    let mut scatters = Vec::new();
    let pairs: Vec<(String, Vec<u64>, Vec<u16>)> = old
        .iter()
        .map(|(n, o)| {
            let d = diff_range(o, &new[n]);
            (n.clone(), d.positions, d.new)
        })
        .collect();
    for _ in 0..reps {
        let mut w = VersionedWeights::new("bench", old.clone(), 1, pre);
        let sealed = stage(&w)?;
        let t = Instant::now();
        let undo = w.commit(sealed)?;
        commits.push(t.elapsed().as_secs_f64());
        std::hint::black_box(undo);
        let mut plain = old.clone();
        let t = Instant::now();
        for (n, p, v) in &pairs {
            if let Some(x) = plain.get_mut(n) {
                scatter(x, p, v);
            }
        }
        scatters.push(t.elapsed().as_secs_f64());
        std::hint::black_box(&plain);
    }
    let changes: u64 = pairs.iter().map(|p| p.1.len() as u64).sum();
    // Digest update per change: h(old) and h(new) for every change.
    let key = DigestKey::for_model("bench");
    let diffs: Vec<(String, starling_proto::delta::diff::RangeDiff)> = old
        .iter()
        .map(|(n, o)| (n.clone(), diff_range(o, &new[n])))
        .collect();
    let digest_only = time(reps, || {
        diffs
            .iter()
            .map(|(n, d)| key.tensor(n).delta(0, &d.positions, &d.old, &d.new).0)
            .fold(0u128, u128::wrapping_add)
    });
    Ok(SpeedRow {
        lr,
        dense_bytes,
        changes,
        compare_1,
        encode_1,
        encode_1_v1,
        encode_1_adaptive,
        compare_n,
        encode_n,
        sparrow_1,
        decode_1,
        decode_1_v1,
        decode_1_adaptive,
        decode_n,
        commit: median(commits),
        scatter: median(scatters),
        digest_ns: digest_only * 1e9 / changes.max(1) as f64,
        memcpy,
    })
}

fn print_speeds(rows: &[SpeedRow], threads: usize) {
    println!("### Speed (dense GB/s scanned = both checkpoints' bytes / time)\n");
    println!(
        "| lr | compare loop 1T | **diff+encode 1T** | ratio | ÷ SparrowRL | diff+encode 1T, adaptive codecs | ratio | diff+encode 1T, v1 codecs | ratio | SparrowRL diff+encode 1T | compare loop {threads}T | **diff+encode {threads}T** | ratio | scaling 1T→{threads}T | memcpy GB/s |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        let g = |t: f64| r.dense_bytes / t / 1e9;
        println!(
            "| {:.1e} | {:.2} | **{:.2}** | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | **{:.2}** | {:.2} | {:.2}× | {:.2} |",
            r.lr,
            g(r.compare_1),
            g(r.encode_1),
            r.compare_1 / r.encode_1,
            r.sparrow_1 / r.encode_1,
            g(r.encode_1_adaptive),
            r.compare_1 / r.encode_1_adaptive,
            g(r.encode_1_v1),
            r.compare_1 / r.encode_1_v1,
            g(r.sparrow_1),
            g(r.compare_n),
            g(r.encode_n),
            r.compare_n / r.encode_n,
            r.encode_1 / r.encode_n,
            r.dense_bytes / 2.0 / r.memcpy / 1e9 * 2.0,
        );
    }
    println!("\n### Decode and apply\n");
    println!(
        "| lr | changes | **staging (decode+verify+undo) 1T, ns/change** | same, adaptive codecs | same, v1 codecs | staging {threads}T, ns/change | scaling 1T→{threads}T | **commit apply**, ms | bare scatter, ms | commit / scatter | digest update, ns/change |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        println!(
            "| {:.1e} | {} | **{:.1}** | {:.1} | {:.1} | {:.1} | {:.2}× | **{:.2}** | {:.2} | {:.2} | {:.1} |",
            r.lr,
            r.changes,
            r.decode_1 * 1e9 / r.changes.max(1) as f64,
            r.decode_1_adaptive * 1e9 / r.changes.max(1) as f64,
            r.decode_1_v1 * 1e9 / r.changes.max(1) as f64,
            r.decode_n * 1e9 / r.changes.max(1) as f64,
            r.decode_1 / r.decode_n,
            r.commit * 1e3,
            r.scatter * 1e3,
            r.commit / r.scatter,
            r.digest_ns,
        );
    }
}

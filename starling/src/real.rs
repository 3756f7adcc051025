//! `starling demo --model DIR`: the real run — a pretrained model trained through Starling by
//! the SDK's PyTorch GRPO trainer (`python -m starling.grpo`), and with `--compare` delta
//! delivery measured against full broadcast and the no-transfer ideal, the way the papers
//! measure it (`docs/real-run.md`).
//!
//! Each run starts a cluster (`cluster.rs`: hub, two regions behind emulated links, relays,
//! built-in engine actors and optionally a vLLM actor) from the model directory, then the
//! trainer as a child process speaking only the trainer HTTP API. The trainer appends one JSON
//! line per step to `trainer.jsonl`; this module follows that file, prints a progress line per
//! step, hard-links each published checkpoint into the shared directory in no-transfer mode,
//! and at the end writes `summary.json` and `summary.png`.
//!
//! Throughput is measured in the steady state: the trainer submits batch k+1 for the newest
//! version before it trains on batch k, so the first two batches are for version 0, which every
//! actor already holds; from step 3 on each batch waits for a version just published. The
//! steady-state figures count steps 3..N (`steady_from`).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Seek};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use starling_actor::shared_dir::version_file_name;

use crate::cluster::{Cluster, Mode, Spec, mean, mean_arrival_by_region, path};
use crate::demo_args::DemoArgs;
use crate::links::Region;
use crate::plot::{Panel, Series, render_png};
use crate::procs::Proc;
use crate::real_summary::{
    EngineCheck, FIGURES, Figures, LinkCarried, Makespan, QuarterReward, Ratios, RealComparison,
    RealModel, RealRunSettings, RealStep, RealSummary, RoundRun, RunCheck, ShareVsSpeed,
    SteadyThroughput, TrainerStep, VersionBytes,
};
use crate::summary::region_summary;
use crate::vllm_server::{VllmServer, VllmSetup};

/// The first step whose batch waits for a freshly published version.
pub(crate) const STEADY_FROM: u32 = 3;

/// How long a run waits, once the trainer has finished, for its last version to reach every
/// actor. A full checkpoint may take minutes more to cross the slow link; the run does not
/// wait for it: a version not arrived by then is reported as not arrived (null) and left out
/// of the mean transfer times.
pub(crate) const ARRIVAL_WAIT: Duration = Duration::from_secs(30);

/// How a run delivers weights, and whether a late region's share waits for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RunMode {
    pub(crate) mode: Mode,
    /// Hand a region's share to the others once it has waited `--claim-timeout` (10 s) for its
    /// version (the hub's default: version-aware exclusion of a late region), instead of
    /// waiting for it, as SparrowRL's comparison has every region take part in every step.
    pub(crate) exclude_late: bool,
}

impl RunMode {
    pub(crate) fn name(self) -> String {
        if self.exclude_late {
            format!("{}-exclusive", self.mode.name())
        } else {
            self.mode.name().to_owned()
        }
    }
}

/// What a real run needs besides the cluster.
#[derive(Debug, Clone)]
pub(crate) struct RealSettings {
    pub(crate) model: PathBuf,
    pub(crate) python: PathBuf,
    /// `sdk/python/src`: the SDK and its trainer.
    pub(crate) sdk: PathBuf,
    pub(crate) vllm: Option<VllmSetup>,
    pub(crate) steps: u32,
    pub(crate) groups: usize,
    pub(crate) samples: u32,
    pub(crate) max_new_tokens: u32,
    pub(crate) temperature: f64,
    pub(crate) lr: f64,
    pub(crate) seed: u64,
    pub(crate) http_port: u16,
    pub(crate) engine_slowdown: f64,
    /// PyTorch threads of the trainer (None: PyTorch's default).
    pub(crate) trainer_threads: Option<u32>,
    /// The trainer's training set, in problems (0: a new problem every time). One size for
    /// every mode of a comparison, so every mode trains on the same problems in the same order.
    pub(crate) problems: usize,
}

/// One run in `mode`, in `out` (created), its vLLM actor (if any) attached to `vllm`;
/// returns its summary.
pub(crate) fn run_mode(
    s: &RealSettings,
    mode: RunMode,
    regions: &[Region],
    mut vllm: Option<&mut VllmServer>,
    out: &Path,
) -> Result<RealSummary> {
    std::fs::create_dir_all(out.join("checkpoints"))
        .with_context(|| format!("create {}", out.join("checkpoints").display()))?;
    println!("== mode {} (output in {})", mode.name(), out.display());
    let t_start = Instant::now();
    let mut hub_args = Vec::new();
    if !mode.exclude_late {
        // A region's share waits for its version however long the link takes.
        hub_args.extend(["--claim-timeout".into(), "3600".into()]);
    }
    let spec = Spec {
        mode: mode.mode,
        regions,
        init: &s.model,
        hub_args,
        http_port: s.http_port,
        seed: s.seed,
        engine_slowdown: s.engine_slowdown,
        vllm: vllm.as_ref().map(|v| v.addr),
    };
    let mut cluster = Cluster::start(&spec, out)?;
    // The vLLM actor digests the running server's weights and, after another mode, loads
    // version 0 in full and digests them again: tens of seconds on 2 busy cores.
    let within = if vllm.is_some() { 300 } else { 120 };
    cluster.wait_ready(Duration::from_secs(within))?;
    println!(
        "   every actor holds version 0 and is registered for work ({:.0} s); training\n",
        t_start.elapsed().as_secs_f64()
    );

    let report = out.join("trainer.jsonl");
    let mut trainer = start_trainer(s, &cluster, out, &report)?;
    println!(
        "{:>4} {:>4} {:>7} {:>6} {:>10} {:>7} {:>8} {:>8} {:>7}  per-actor share",
        "step", "ver", "reward", "solved", "version", "density", "eu s", "ap s", "step s"
    );
    let mut steps: Vec<TrainerStep> = Vec::new();
    let mut published_at: BTreeMap<u64, Instant> = BTreeMap::new();
    let mut follow = Follow::new(&report);
    loop {
        for rec in follow.read_new()? {
            let at = instant_of_unix_ms(rec.published.at_unix_ms);
            published_at.insert(rec.published.version, at);
            if mode.mode == Mode::NoTransfer {
                let to = cluster
                    .shared
                    .join(version_file_name(rec.published.version));
                std::fs::hard_link(&rec.published.path, &to).with_context(|| {
                    format!("share {} as {}", rec.published.path.display(), to.display())
                })?;
            }
            let prev = rec.published.version.saturating_sub(1);
            let arrival = published_at
                .get(&prev)
                .map(|&t| cluster.region_arrival(t, prev))
                .unwrap_or_default();
            println!(
                "{:>4} {:>4} {:>7.3} {:>5.0}% {:>8.1}kB {:>6.2}% {:>8} {:>8} {:>7.1}  {}",
                rec.step,
                rec.published.version,
                rec.mean_reward,
                100.0 * rec.solved,
                rec.published.bytes as f64 / 1e3,
                100.0 * rec.published.density,
                fmt_s(arrival.get("eu").copied().flatten()),
                fmt_s(arrival.get("ap").copied().flatten()),
                rec.seconds.get("step").copied().unwrap_or(f64::NAN),
                share_line(&rec.per_actor_samples),
            );
            steps.push(rec);
        }
        if let Some(status) = trainer.exited()? {
            // Read what it wrote last, then judge its exit.
            for rec in follow.read_new()? {
                published_at.insert(
                    rec.published.version,
                    instant_of_unix_ms(rec.published.at_unix_ms),
                );
                steps.push(rec);
            }
            if !status.success() {
                bail!(
                    "the trainer exited ({status}); the end of {}:\n{}",
                    trainer.log.display(),
                    crate::procs::tail(&trainer.log, 20)
                );
            }
            break;
        }
        cluster.check_alive()?;
        if let Some(v) = vllm.as_deref_mut() {
            v.check_alive()?;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let last = steps.last().map(|r| r.published.version).unwrap_or(0);
    cluster.wait_all_reach(last, ARRIVAL_WAIT);
    let arrivals: BTreeMap<u64, BTreeMap<String, Option<f64>>> = published_at
        .iter()
        .map(|(&v, &t)| (v, cluster.region_arrival(t, v)))
        .collect();
    let late = not_arrived(&arrivals);
    for (region, versions) in &late {
        println!(
            "   {region}: version(s) {} not arrived within {} s after the run (left out of its mean transfer)",
            join(versions),
            ARRIVAL_WAIT.as_secs()
        );
    }
    let taus = actor_taus(&cluster);
    let wall_s = t_start.elapsed().as_secs_f64();
    let link_stats = cluster.stop();
    drop(trainer);

    let summary = summarize(
        s,
        mode,
        regions,
        &steps,
        &arrivals,
        &late,
        &taus,
        &link_stats,
        wall_s,
    )?;
    std::fs::write(
        out.join("summary.json"),
        serde_json::to_string_pretty(&summary)?,
    )
    .context("write summary.json")?;
    render_png(
        &panels(&steps, &arrivals),
        "step",
        900,
        720,
        &out.join("summary.png"),
    )?;
    println!(
        "\n   {}: reward {:.3} (first quarter) -> {:.3} (last quarter); {:.0} steps/hour, {:.0} rollout tokens/s (steady state); {:.2} MB per version ({:.2}% of the checkpoint), density {:.2}%",
        mode.name(),
        summary.reward.first_quarter,
        summary.reward.last_quarter,
        summary.throughput.steps_per_hour,
        summary.throughput.rollout_tokens_per_s,
        summary.bytes.per_version / 1e6,
        100.0 * summary.bytes.ratio,
        100.0 * summary.delta_density,
    );
    if !summary.share_vs_speed.is_empty() {
        let line: Vec<String> = summary
            .share_vs_speed
            .iter()
            .map(|(a, v)| {
                format!(
                    "{a} {:.0}% of tokens at {:.0}% of the speed ({:.2}x)",
                    100.0 * v.token_share,
                    100.0 * v.speed_share,
                    v.ratio
                )
            })
            .collect();
        println!(
            "   shares against speed (τ on the hub's clock): {}",
            line.join("; ")
        );
    }
    Ok(summary)
}

fn start_trainer(s: &RealSettings, cluster: &Cluster, out: &Path, report: &Path) -> Result<Proc> {
    let exe = std::env::current_exe().context("locate the starling executable")?;
    let mut cmd = Command::new(&s.python);
    cmd.env("PYTHONPATH", &s.sdk)
        .env("PYTHONUNBUFFERED", "1")
        .env("TRANSFORMERS_VERBOSITY", "error")
        .env("HF_HUB_OFFLINE", "1")
        .args(["-m", "starling.grpo", "--hub"])
        .arg(format!("http://{}", cluster.http))
        .arg("--credentials")
        .arg(&cluster.trainer_credentials)
        .arg("--model")
        .arg(&s.model)
        .arg("--checkpoint-dir")
        .arg(out.join("checkpoints"))
        .args(["--steps", &s.steps.to_string()])
        .args(["--groups", &s.groups.to_string()])
        .args(["-n", &s.samples.to_string()])
        .args(["--max-new-tokens", &s.max_new_tokens.to_string()])
        .args(["--temperature", &s.temperature.to_string()])
        .args(["--lr", &s.lr.to_string()])
        .args(["--seed", &s.seed.to_string()])
        .args(["--problems", &s.problems.to_string()])
        .arg("--starling-bin")
        .arg(&exe)
        .arg("--report")
        .arg(report);
    if let Some(t) = s.trainer_threads {
        cmd.args(["--threads", &t.to_string()]);
    }
    Proc::spawn("trainer", cmd, &out.join("logs/trainer.log"))
}

/// Reads the lines a growing JSON-lines file gains.
struct Follow {
    path: PathBuf,
    at: u64,
    partial: String,
}

impl Follow {
    fn new(path: &Path) -> Self {
        Self {
            path: path.to_owned(),
            at: 0,
            partial: String::new(),
        }
    }

    fn read_new(&mut self) -> Result<Vec<TrainerStep>> {
        let Ok(mut f) = std::fs::File::open(&self.path) else {
            return Ok(Vec::new());
        };
        f.seek(std::io::SeekFrom::Start(self.at))
            .with_context(|| format!("read {}", self.path.display()))?;
        let mut out = Vec::new();
        let mut r = BufReader::new(f);
        loop {
            let mut line = String::new();
            let n = r
                .read_line(&mut line)
                .with_context(|| format!("read {}", self.path.display()))?;
            if n == 0 {
                break;
            }
            self.at += n as u64;
            self.partial.push_str(&line);
            if !self.partial.ends_with('\n') {
                break; // the rest of the line comes later
            }
            let text = std::mem::take(&mut self.partial);
            let rec: TrainerStep = serde_json::from_str(text.trim()).with_context(|| {
                format!(
                    "a line of {} is not a trainer step: {:.200}",
                    self.path.display(),
                    text
                )
            })?;
            out.push(rec);
        }
        Ok(out)
    }
}

/// The `Instant` of a Unix time in milliseconds (the trainer's clock is this machine's).
fn instant_of_unix_ms(ms: f64) -> Instant {
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1e3);
    let ago = ((now_ms - ms) / 1e3).max(0.0);
    Instant::now()
        .checked_sub(Duration::from_secs_f64(ago))
        .unwrap_or_else(Instant::now)
}

/// Each actor's throughput estimate τ (tokens/s) as the hub's ledger has it.
fn actor_taus(cluster: &Cluster) -> BTreeMap<String, f64> {
    let client = starling_trainer::HubClient::new(cluster.http.to_string(), cluster.token.clone());
    let Ok(status) = client.run_status() else {
        return BTreeMap::new();
    };
    status["actors"]
        .as_array()
        .map(|actors| {
            actors
                .iter()
                .filter_map(|a| Some((a["name"].as_str()?.to_owned(), a["tokens_per_s"].as_f64()?)))
                .collect()
        })
        .unwrap_or_default()
}

/// Per region, the versions that had not reached all its actors (`None` in `arrivals`).
fn not_arrived(
    arrivals: &BTreeMap<u64, BTreeMap<String, Option<f64>>>,
) -> BTreeMap<String, Vec<u64>> {
    let mut late: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for (&v, regions) in arrivals {
        for (region, at) in regions {
            if at.is_none() {
                late.entry(region.clone()).or_default().push(v);
            }
        }
    }
    late
}

fn join(versions: &[u64]) -> String {
    versions
        .iter()
        .map(u64::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

fn fmt_s(s: Option<f64>) -> String {
    s.map(|s| format!("{s:.2}")).unwrap_or_else(|| "-".into())
}

fn share_line(per_actor: &BTreeMap<String, u64>) -> String {
    let total: u64 = per_actor.values().sum();
    per_actor
        .iter()
        .map(|(a, n)| format!("{a} {:.0}%", 100.0 * *n as f64 / total.max(1) as f64))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The full BF16 checkpoint's bytes: 2 per parameter of the model directory's weights.
fn checkpoint_bytes(model: &Path) -> Result<u64> {
    let c = starling_checkpoint::safetensors::Checkpoint::open(model)
        .with_context(|| format!("open the weights in {}", model.display()))?;
    Ok(2 * c.numel())
}

#[allow(clippy::too_many_arguments)]
fn summarize(
    s: &RealSettings,
    mode: RunMode,
    regions: &[Region],
    steps: &[TrainerStep],
    arrivals: &BTreeMap<u64, BTreeMap<String, Option<f64>>>,
    late: &BTreeMap<String, Vec<u64>>,
    taus: &BTreeMap<String, f64>,
    links: &BTreeMap<&'static str, starling_netem::ProxyStats>,
    wall_s: f64,
) -> Result<RealSummary> {
    let full = checkpoint_bytes(&s.model)?;
    let n = steps.len();
    let q = (n / 4).max(1);
    let first_q = mean(steps.iter().take(q).map(|r| r.mean_reward));
    let last_q = mean(
        steps
            .iter()
            .skip(n.saturating_sub(q))
            .map(|r| r.mean_reward),
    );
    // Steady state: from the end of step STEADY_FROM - 1 to the end of the last step.
    let steady: Vec<&TrainerStep> = steps.iter().filter(|r| r.step >= STEADY_FROM).collect();
    let start_ms = steps
        .iter()
        .find(|r| r.step == STEADY_FROM - 1)
        .map(|r| r.ended_at_unix_ms);
    let end_ms = steps.last().map(|r| r.ended_at_unix_ms);
    let steady_s = match (start_ms, end_ms) {
        (Some(a), Some(b)) if b > a => (b - a) / 1e3,
        _ => f64::NAN,
    };
    let loop_s = match (steps.first(), steps.last()) {
        (Some(a), Some(b)) => (b.ended_at_unix_ms - a.loop_started_at_unix_ms) / 1e3,
        _ => f64::NAN,
    };
    let steady_tokens: u64 = steady.iter().map(|r| r.completion_tokens).sum();
    let bytes: u64 = steps.iter().map(|r| r.published.bytes).sum();
    let mut per_actor: BTreeMap<String, u64> = BTreeMap::new();
    for r in steps {
        for (a, k) in &r.per_actor_samples {
            *per_actor.entry(a.clone()).or_default() += k;
        }
    }
    let total: u64 = per_actor.values().sum();
    // Shares against speed: each actor's share of the tokens generated, over its share of the
    // actors' summed throughput as the hub measured it (τ, tokens per second of wall time on
    // the hub's clock). 1.0 is a split exactly in proportion to speed.
    let mut tokens_of: BTreeMap<String, u64> = BTreeMap::new();
    for r in steps {
        for (a, k) in &r.per_actor_tokens {
            *tokens_of.entry(a.clone()).or_default() += k;
        }
    }
    let all_tokens: u64 = tokens_of.values().sum();
    let tau_total: f64 = taus.values().sum();
    let share_vs_speed: BTreeMap<String, ShareVsSpeed> = taus
        .iter()
        .map(|(a, tau)| {
            let token_share =
                tokens_of.get(a).copied().unwrap_or(0) as f64 / all_tokens.max(1) as f64;
            let speed_share = tau / tau_total;
            let ratio = token_share / speed_share;
            let share = ShareVsSpeed {
                token_share,
                speed_share,
                ratio,
            };
            (a.clone(), share)
        })
        .collect();
    // Over the versions that arrived (within ARRIVAL_WAIT of the run's end for the last ones):
    // NaN, written as null, where none did.
    let transfer = mean_arrival_by_region(regions, arrivals);
    // Each batch's makespan (posted → last accepted group) against the ideal: its tokens at
    // the actors' combined throughput as the hub measured it.
    let tau_sum: f64 = taus.values().sum();
    let makespans: Vec<Makespan> = steps
        .iter()
        .map(|r| {
            let made = match (r.batch_created_at_ms, r.last_accepted_at_ms) {
                (Some(a), Some(b)) => (b - a) / 1e3,
                _ => f64::NAN,
            };
            let ideal = r.completion_tokens as f64 / tau_sum;
            Makespan {
                batch: r.batch,
                makespan_s: made,
                ideal_s: ideal,
                ratio: made / ideal,
            }
        })
        .collect();
    let mut per_engine: BTreeMap<String, EngineCheck> = BTreeMap::new();
    for r in steps {
        for (engine, c) in &r.check.per_engine {
            per_engine.entry(engine.clone()).or_default().add(c);
        }
    }
    let refused_groups = steps.iter().map(|r| r.check.refused_groups.len()).sum();
    let versions = n.max(1) as f64;
    Ok(RealSummary {
        mode: mode.name(),
        model: RealModel {
            dir: path(&s.model),
            bf16_bytes: full,
        },
        task: "arithmetic word problems as chat messages (math verifier)".into(),
        settings: RealRunSettings {
            steps: s.steps,
            groups: s.groups,
            samples_per_group: s.samples,
            max_new_tokens: s.max_new_tokens,
            temperature: s.temperature,
            lr: s.lr,
            seed: s.seed,
            problems: s.problems,
            max_staleness: 1,
            engine_slowdown: s.engine_slowdown,
            vllm: s.vllm.is_some(),
            exclude_late_region: mode.exclude_late,
        },
        regions: regions.iter().map(region_summary).collect(),
        reward: QuarterReward {
            first_quarter: first_q,
            last_quarter: last_q,
            steps_per_quarter: q,
            per_step: steps.iter().map(|r| r.mean_reward).collect(),
        },
        bytes: VersionBytes {
            per_version: bytes as f64 / versions,
            full_checkpoint: full,
            ratio: bytes as f64 / (full as f64 * versions),
            per_step: steps.iter().map(|r| r.published.bytes).collect(),
        },
        delta_density: mean(steps.iter().map(|r| r.published.density)),
        density_per_step: steps.iter().map(|r| r.published.density).collect(),
        mean_transfer_s: transfer
            .into_iter()
            .map(|(region, t)| (region.to_owned(), t))
            .collect(),
        arrival_wait_s: ARRIVAL_WAIT.as_secs(),
        not_arrived: late.clone(),
        link_bytes: links
            .iter()
            .map(|(name, st)| {
                let carried = LinkCarried {
                    to_region: st.down.delivered_bytes,
                    to_hub: st.up.delivered_bytes,
                };
                (name.to_string(), carried)
            })
            .collect(),
        throughput: SteadyThroughput {
            steady_from_step: STEADY_FROM,
            steady_s,
            steps_per_hour: steady.len() as f64 * 3600.0 / steady_s,
            rollout_tokens_per_s: steady_tokens as f64 / steady_s,
            loop_s,
            loop_steps_per_hour: n as f64 * 3600.0 / loop_s,
            median_step_s: median(
                steady
                    .iter()
                    .map(|r| r.seconds.get("step").copied().unwrap_or(f64::NAN))
                    .collect(),
            ),
        },
        per_actor_share: per_actor
            .iter()
            .map(|(a, k)| (a.clone(), *k as f64 / total.max(1) as f64))
            .collect(),
        tau_at_end: taus.clone(),
        share_vs_speed,
        makespans,
        behaviour_check: RunCheck {
            per_engine,
            refused_groups,
        },
        wall_s,
        steps: steps
            .iter()
            .map(|r| RealStep {
                trainer: r.clone(),
                arrival_s: arrivals.get(&r.published.version).cloned(),
            })
            .collect(),
    })
}

pub(crate) fn median(mut xs: Vec<f64>) -> f64 {
    xs.retain(|x| x.is_finite());
    if xs.is_empty() {
        return f64::NAN;
    }
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

fn panels(
    steps: &[TrainerStep],
    arrivals: &BTreeMap<u64, BTreeMap<String, Option<f64>>>,
) -> Vec<Panel> {
    let xs = |f: &dyn Fn(&TrainerStep) -> f64| -> Vec<(f64, f64)> {
        steps.iter().map(|r| (f64::from(r.step), f(r))).collect()
    };
    let transfer = [("eu", [31, 119, 180]), ("ap", [214, 39, 40])]
        .into_iter()
        .map(|(name, color)| Series {
            label: format!("{name}: publish to all actors active"),
            color,
            points: steps
                .iter()
                .filter_map(|r| {
                    let s = arrivals.get(&r.published.version)?.get(name).copied()??;
                    Some((f64::from(r.step), s))
                })
                .collect(),
        })
        .collect();
    vec![
        Panel {
            title: "Reward (math verifier)".into(),
            y_label: "mean reward".into(),
            series: vec![Series {
                label: "mean reward".into(),
                color: [44, 160, 44],
                points: xs(&|r| r.mean_reward),
            }],
        },
        Panel {
            title: "Step time".into(),
            y_label: "seconds".into(),
            series: vec![Series {
                label: "trainer step (wait, check, train, publish)".into(),
                color: [255, 127, 14],
                points: xs(&|r| r.seconds.get("step").copied().unwrap_or(f64::NAN)),
            }],
        },
        Panel {
            title: "Weight transfer per region".into(),
            y_label: "seconds".into(),
            series: transfer,
        },
    ]
}

/// `starling demo --model DIR [--compare]`.
pub(crate) fn run(a: &DemoArgs, regions: &[Region], out: &Path) -> Result<()> {
    let Some(model) = &a.real.model else {
        bail!("no --model");
    };
    let model = model
        .canonicalize()
        .with_context(|| format!("the model directory {}", model.display()))?;
    if !model.join("config.json").is_file() {
        bail!(
            "{} is not a model directory (no config.json): pass the directory scripts/fetch-model.sh prints",
            model.display()
        );
    }
    // The SDK and the vLLM extension of the checkout this binary was built from.
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let settings = RealSettings {
        model,
        python: a.real.python.clone(),
        sdk: repo.join("sdk/python/src"),
        vllm: a.real.vllm.then(|| VllmSetup {
            python: a.real.python.clone(),
            extension: repo.join("integrations/vllm/src"),
            max_num_seqs: 32,
        }),
        steps: a.steps(),
        groups: a.groups(),
        samples: a.samples(),
        max_new_tokens: a.real.max_new_tokens,
        temperature: a.real.temperature,
        lr: a.lr(),
        seed: a.seed,
        http_port: a.http_port,
        engine_slowdown: a.engine_slowdown,
        trainer_threads: a.real.trainer_threads,
        problems: a
            .real
            .problems
            .unwrap_or_else(|| a.groups() * (a.steps() as usize).div_ceil(4)),
    };
    check_python(&settings)?;
    // The runs, before anything starts: a mistyped --modes costs no vLLM start-up.
    let modes = if a.compare {
        a.real
            .modes
            .iter()
            .map(|m| parse_mode(m))
            .collect::<Result<Vec<_>>>()?
    } else {
        let mode = if a.full_broadcast {
            Mode::FullBroadcast
        } else if a.no_transfer {
            Mode::NoTransfer
        } else {
            Mode::Delta
        };
        vec![RunMode {
            mode,
            exclude_late: false,
        }]
    };
    println!(
        "== Starling real run: GRPO on {} with the SDK's PyTorch trainer ({} steps, {} prompts x {} samples, lr {}, up to {} new tokens)",
        settings.model.display(),
        settings.steps,
        settings.groups,
        settings.samples,
        settings.lr,
        settings.max_new_tokens
    );
    // One vLLM server for the whole invocation (vllm_server.rs), confined to `out`, under
    // which every mode's actor store lies; dropped (stopped) when this returns.
    let mut vllm = match &settings.vllm {
        Some(setup) => Some(VllmServer::start(
            setup,
            &settings.model,
            out,
            &out.join("vllm-server.log"),
        )?),
        None => None,
    };
    if a.compare {
        compare(a, &settings, &modes, regions, vllm.as_mut(), out)
    } else {
        run_mode(&settings, modes[0], regions, vllm.as_mut(), out).map(|_| ())
    }
}

/// Removes a finished mode's weight files — the trainer's checkpoints, the hub's store, the
/// shared directory of no-transfer, every safetensors and delta file under the regions — and
/// keeps its summary, reports and logs: four modes would otherwise leave ~20 GB behind.
fn remove_weights(dir: &Path) {
    for sub in ["checkpoints", "hub-store", "shared-weights"] {
        let p = dir.join(sub);
        if p.exists()
            && let Err(e) = std::fs::remove_dir_all(&p)
        {
            eprintln!("   could not remove {}: {e}", p.display());
        }
    }
    remove_files_named(&dir.join("regions"), &["safetensors", "sdc"]);
}

/// Removes every file under `dir` (recursively) whose extension is one of `extensions`.
fn remove_files_named(dir: &Path, extensions: &[&str]) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        match entry.file_type() {
            Ok(t) if t.is_dir() => remove_files_named(&path, extensions),
            Ok(t) if t.is_file() => {
                let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
                if extensions.contains(&ext)
                    && let Err(e) = std::fs::remove_file(&path)
                {
                    eprintln!("   could not remove {}: {e}", path.display());
                }
            }
            _ => {}
        }
    }
}

fn parse_mode(name: &str) -> Result<RunMode> {
    let (mode, exclude_late) = match name.trim() {
        "delta" => (Mode::Delta, false),
        "no-transfer" => (Mode::NoTransfer, false),
        "full-broadcast" => (Mode::FullBroadcast, false),
        "full-broadcast-exclusive" => (Mode::FullBroadcast, true),
        "delta-exclusive" => (Mode::Delta, true),
        other => bail!(
            "--modes: no mode {other:?} (delta, no-transfer, full-broadcast, full-broadcast-exclusive, delta-exclusive)"
        ),
    };
    Ok(RunMode { mode, exclude_late })
}

/// Fails with a sentence that says what to install when `--python` cannot run the trainer.
fn check_python(s: &RealSettings) -> Result<()> {
    let mut probe = "import torch, transformers".to_owned();
    if s.vllm.is_some() {
        probe.push_str(", vllm");
    }
    let out = Command::new(&s.python)
        .args(["-c", &probe])
        .env("PYTHONPATH", &s.sdk)
        .output()
        .with_context(|| format!("run {} (--python)", s.python.display()))?;
    if !out.status.success() {
        bail!(
            "{} cannot `{probe}`: pass --python with an interpreter that has torch and transformers{} (scripts/real-run.sh makes one); it said: {}",
            s.python.display(),
            if s.vllm.is_some() {
                " and vLLM's CPU build"
            } else {
                ""
            },
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
        );
    }
    Ok(())
}

/// Runs every mode `--rounds` times (modes interleaved), then prints and writes the
/// comparison (`compare.json`, `compare.png`).
fn compare(
    a: &DemoArgs,
    s: &RealSettings,
    modes: &[RunMode],
    regions: &[Region],
    mut vllm: Option<&mut VllmServer>,
    out: &Path,
) -> Result<()> {
    let rounds = a.rounds.max(1);
    let t0 = Instant::now();
    let mut runs: Vec<(u32, RunMode, RealSummary)> = Vec::new();
    for round in 1..=rounds {
        for &mode in modes {
            let dir = out.join(format!("r{round}-{}", mode.name()));
            let mut settings = s.clone();
            if mode.mode == Mode::FullBroadcast {
                settings.steps = a.real.full_steps.max(STEADY_FROM);
            }
            println!(
                "\n== round {round}/{rounds} ({:.0} s so far)",
                t0.elapsed().as_secs_f64()
            );
            let summary = run_mode(&settings, mode, regions, vllm.as_deref_mut(), &dir)?;
            if !a.real.keep_weights {
                remove_weights(&dir);
            }
            runs.push((round, mode, summary));
        }
    }
    let mut medians: BTreeMap<String, Figures> = BTreeMap::new();
    for &mode in modes {
        let of_mode: Vec<&RealSummary> = runs
            .iter()
            .filter(|(_, m, _)| *m == mode)
            .map(|(_, _, v)| v)
            .collect();
        medians.insert(
            mode.name(),
            Figures(
                FIGURES
                    .iter()
                    .map(|(name, f)| {
                        (
                            name.to_string(),
                            median(of_mode.iter().map(|v| f(v)).collect()),
                        )
                    })
                    .collect(),
            ),
        );
    }
    let fig =
        |mode: &str, name: &str| -> f64 { medians.get(mode).map_or(f64::NAN, |m| m.get(name)) };
    let ideal = fig("no-transfer", "steps_per_hour");
    println!(
        "\n== comparison ({rounds} round(s), {:.0} s; links: {})\n",
        t0.elapsed().as_secs_f64(),
        regions
            .iter()
            .map(|r| format!(
                "{} {} Mbit/s RTT {} ms loss {}%",
                r.name,
                r.rate_mbit,
                r.rtt_ms,
                r.loss * 100.0
            ))
            .collect::<Vec<_>>()
            .join("; ")
    );
    println!(
        "{:<26} {:>8} {:>7} {:>7} {:>11} {:>7} {:>7} {:>13} {:>8} {:>8}",
        "mode",
        "steps/h",
        "tok/s",
        "step s",
        "version MB",
        "eu s",
        "ap s",
        "reward",
        "vs ideal",
        "vs full"
    );
    // A region none of whose versions arrived has no transfer time.
    let secs = |x: f64| {
        if x.is_finite() {
            format!("{x:.1}")
        } else {
            "-".to_owned()
        }
    };
    for &mode in modes {
        let m = mode.name();
        println!(
            "{:<26} {:>8.1} {:>7.1} {:>7.1} {:>11.2} {:>7} {:>7} {:>6.3}->{:<6.3} {:>8.3} {:>8.2}",
            m,
            fig(&m, "steps_per_hour"),
            fig(&m, "rollout_tokens_per_s"),
            fig(&m, "median_step_s"),
            fig(&m, "bytes_per_version") / 1e6,
            secs(fig(&m, "transfer_eu_s")),
            secs(fig(&m, "transfer_ap_s")),
            fig(&m, "reward_first_quarter"),
            fig(&m, "reward_last_quarter"),
            fig(&m, "steps_per_hour") / ideal,
            fig(&m, "steps_per_hour") / fig("full-broadcast", "steps_per_hour"),
        );
    }
    let delta = fig("delta", "steps_per_hour");
    let ratios = Ratios {
        delta_over_full_broadcast_steps_per_hour: delta / fig("full-broadcast", "steps_per_hour"),
        delta_over_full_broadcast_exclusive_steps_per_hour: delta
            / fig("full-broadcast-exclusive", "steps_per_hour"),
        delta_over_no_transfer_steps_per_hour: delta / ideal,
        delta_over_no_transfer_tokens_per_s: fig("delta", "rollout_tokens_per_s")
            / fig("no-transfer", "rollout_tokens_per_s"),
    };
    println!(
        "\n   steady state from step {STEADY_FROM}; vs ideal: steps/hour over no-transfer's; vs full: over full-broadcast's (every region taking part)"
    );
    println!(
        "   eu s, ap s: mean publish-to-active time over the versions that arrived; a version not arrived within {} s after the run is left out",
        ARRIVAL_WAIT.as_secs()
    );
    for (round, mode, v) in &runs {
        if !v.not_arrived.is_empty() {
            let line: Vec<String> = v
                .not_arrived
                .iter()
                .map(|(region, versions)| format!("{region} version(s) {}", join(versions)))
                .collect();
            println!(
                "   {} (round {round}): not arrived within {} s after the run: {}",
                mode.name(),
                ARRIVAL_WAIT.as_secs(),
                line.join("; ")
            );
        }
    }
    println!("   ratios: {}", serde_json::to_string(&ratios)?);
    let panels = compare_panels(&runs);
    let report = RealComparison {
        rounds,
        wall_s: t0.elapsed().as_secs_f64(),
        modes: modes.iter().map(|m| m.name()).collect(),
        medians,
        ratios,
        runs: runs
            .into_iter()
            .map(|(round, mode, summary)| RoundRun {
                round,
                mode: mode.name(),
                summary,
            })
            .collect(),
    };
    let path = out.join("compare.json");
    std::fs::write(&path, serde_json::to_string_pretty(&report)?)
        .with_context(|| format!("write {}", path.display()))?;
    render_png(&panels, "step", 900, 720, &out.join("compare.png"))?;
    println!(
        "   wrote {} and {}",
        path.display(),
        out.join("compare.png").display()
    );
    Ok(())
}

const COLORS: [[u8; 3]; 5] = [
    [31, 119, 180],
    [44, 160, 44],
    [214, 39, 40],
    [148, 103, 189],
    [255, 127, 14],
];

/// Reward and step time per step, one series per run.
fn compare_panels(runs: &[(u32, RunMode, RealSummary)]) -> Vec<Panel> {
    let series = |y: fn(&TrainerStep) -> f64| -> Vec<Series> {
        runs.iter()
            .enumerate()
            .map(|(i, (round, mode, v))| Series {
                label: format!("{} (round {round})", mode.name()),
                color: COLORS[i % COLORS.len()],
                points: v
                    .steps
                    .iter()
                    .map(|st| (f64::from(st.trainer.step), y(&st.trainer)))
                    .collect(),
            })
            .collect()
    };
    vec![
        Panel {
            title: "Reward per step".into(),
            y_label: "mean reward".into(),
            series: series(|t| t.mean_reward),
        },
        Panel {
            title: "Step time".into(),
            y_label: "seconds".into(),
            series: series(|t| t.seconds.get("step").copied().unwrap_or(f64::NAN)),
        },
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_finished_mode_keeps_its_reports_and_loses_its_weights() {
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path();
        let write = |rel: &str| {
            let p = d.join(rel);
            std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
            std::fs::write(&p, b"x").expect("write");
        };
        for f in [
            "checkpoints/step-00000001.safetensors",
            "hub-store/v00000001.sdc",
            "regions/eu/eu-a1/store/v00000001.safetensors",
            "regions/eu/eu-a1/journal/v00000002.sdc",
            "regions/eu/eu-a1/journal/state.json",
            "summary.json",
            "trainer.jsonl",
            "logs/hub.log",
        ] {
            write(f);
        }
        remove_weights(d);
        for gone in [
            "checkpoints",
            "hub-store",
            "regions/eu/eu-a1/store/v00000001.safetensors",
            "regions/eu/eu-a1/journal/v00000002.sdc",
        ] {
            assert!(!d.join(gone).exists(), "{gone} removed");
        }
        for kept in [
            "summary.json",
            "trainer.jsonl",
            "logs/hub.log",
            "regions/eu/eu-a1/journal/state.json",
        ] {
            assert!(d.join(kept).exists(), "{kept} kept");
        }
    }

    #[test]
    fn versions_not_arrived_are_listed_per_region_and_left_out_of_the_mean() {
        let at = |eu: Option<f64>, ap: Option<f64>| {
            BTreeMap::from([("eu".to_owned(), eu), ("ap".to_owned(), ap)])
        };
        let arrivals = BTreeMap::from([
            (1, at(Some(2.0), Some(4.0))),
            (2, at(Some(3.0), None)),
            (3, at(None, None)),
        ]);
        let late = not_arrived(&arrivals);
        assert_eq!(late.get("ap"), Some(&vec![2, 3]));
        assert_eq!(late.get("eu"), Some(&vec![3]));
        assert_eq!(join(&late["ap"]), "2, 3");
        let ap = mean(arrivals.values().filter_map(|m| m["ap"]));
        assert_eq!(ap, 4.0);
        // A region none of whose versions arrived has no mean: null in JSON, skipped by the
        // comparison's median.
        let none = mean(std::iter::empty());
        assert!(none.is_nan());
        assert_eq!(serde_json::json!(none), serde_json::Value::Null);
        assert!(median(vec![none, 1.0, 3.0]) == 2.0);
    }
}

//! One run of the demo's toy model in one mode (delta, no-transfer or full-broadcast): the
//! cluster started, the built-in GRPO trainer trained through the hub, everything stopped,
//! and the run's `summary.json` and `summary.png` written.
//!
//! `demo` calls it once for a plain `starling demo`, `compare` once per mode and round; the
//! real run (`--model`) has its own (`real`), with the SDK's trainer as a child process.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use starling_actor::shared_dir::version_file_name;
use starling_engine::Bf16Tensors;
use starling_trainer::policy::write_bf16;
use starling_trainer::{HubClient, Policy, ReverseDigits, StepReport, TrainConfig, Trainer};

use starling_netem::ProxyStats;

use crate::cluster::{Cluster, Mode, Spec, mean, mean_arrival_by_region};
use crate::demo_args::DemoArgs;
use crate::links::Region;
use crate::plot::{Panel, Series, render_png};
use crate::summary::{
    BehaviourCheck, Bytes, LinkBytes, ModelSummary, Reward, Settings, StepSummary, Summary,
    Throughput, region_summary,
};

/// One run in `mode` from the BF16 checkpoint `init`, in directory `out` (which exists and
/// is empty): starts the cluster, trains, stops everything; writes `summary.json` and
/// `summary.png` there and returns the summary.
pub(crate) fn run_mode(
    a: &DemoArgs,
    mode: Mode,
    regions: &[Region],
    init_tensors: &Bf16Tensors,
    out: &Path,
) -> Result<Summary> {
    for d in ["logs", "model", "checkpoints"] {
        std::fs::create_dir_all(out.join(d))
            .with_context(|| format!("create {}", out.join(d).display()))?;
    }
    let config = starling_trainer::demo_model_config();
    let init = out.join("model/step-000000.safetensors");
    write_bf16(init_tensors, &init)?;
    std::fs::write(out.join("model/config.json"), config.to_json())
        .context("write model/config.json")?;
    let full_bf16_bytes = 2 * config.parameter_count();
    let policy = Policy::from_bf16(config.clone(), init_tensors)?;
    let t_start = Instant::now();
    println!("== mode {} (output in {})", mode.name(), out.display());

    // 2. Cluster, hub, regions.
    let spec = Spec {
        mode,
        regions,
        init: &init,
        hub_args: Vec::new(),
        http_port: a.http_port,
        seed: a.seed,
        engine_slowdown: a.engine_slowdown,
        vllm: None,
    };
    let mut cluster = Cluster::start(&spec, out)?;
    let client = HubClient::new(cluster.http.to_string(), cluster.token.clone());
    cluster.wait_ready(Duration::from_secs(60))?;
    println!("   every actor holds version 0 and is registered for work; training\n");
    println!(
        "{:>4} {:>4} {:>7} {:>6} {:>9} {:>7} {:>9} {:>9} {:>8}  per-actor share",
        "step", "ver", "reward", "solved", "delta", "ratio", "eu s", "ap s", "rollout/s"
    );

    // 3. Train.
    let cfg = TrainConfig {
        steps: a.steps(),
        groups_per_batch: a.groups(),
        samples_per_group: a.samples(),
        lr: a.lr(),
        seed: a.seed,
        checkpoint_dir: out.join("checkpoints"),
        // No-transfer shares the trainer's file with the actors after the publish, so it
        // keeps it; the other modes give it to the hub.
        handover: mode != Mode::NoTransfer,
        task: ReverseDigits::default(),
        ..TrainConfig::default()
    };
    let mut trainer = Trainer::new(policy, cfg, client)?;
    let mut published_at: BTreeMap<u64, Instant> = BTreeMap::new();
    let mut link_error = None;
    let t_loop = Instant::now();
    let reports = trainer.run(0, |r: &StepReport| {
        let started = Instant::now() - Duration::from_secs_f64(r.publish_s);
        published_at.insert(r.published.version, started);
        if mode == Mode::NoTransfer {
            // The version exists once the hub has numbered it: share the finished file.
            let to = cluster.shared.join(version_file_name(r.published.version));
            if let Err(e) = std::fs::hard_link(&r.checkpoint, &to) {
                link_error.get_or_insert(format!(
                    "link {} to {}: {e}",
                    r.checkpoint.display(),
                    to.display()
                ));
            }
        }
        // The previous version has had a whole step to land: report its arrival per region.
        let prev = r.published.version.saturating_sub(1);
        let arrival = arrival_of(&cluster, &published_at, prev);
        let share = share_line(&r.per_actor);
        println!(
            "{:>4} {:>4} {:>7.3} {:>5.0}% {:>7.1}kB {:>6.1}% {:>9} {:>9} {:>8.0}  {share}",
            r.step,
            r.published.version,
            r.mean_reward,
            100.0 * r.solved,
            r.published.delta_bytes as f64 / 1e3,
            100.0 * r.published.delta_bytes as f64 / full_bf16_bytes as f64,
            fmt_s(arrival.get("eu").copied().flatten()),
            fmt_s(arrival.get("ap").copied().flatten()),
            r.rollouts_per_s,
        );
    })?;
    let loop_s = t_loop.elapsed().as_secs_f64();
    if let Some(e) = link_error {
        bail!("no-transfer mode could not share a checkpoint: {e}");
    }

    // The last version's arrival.
    let last = reports.last().map(|r| r.published.version).unwrap_or(0);
    cluster.wait_all_reach(last, Duration::from_secs(30));
    let mut arrivals: BTreeMap<u64, BTreeMap<String, Option<f64>>> = BTreeMap::new();
    for v in 1..=last {
        arrivals.insert(v, arrival_of(&cluster, &published_at, v));
    }
    let wall_s = t_start.elapsed().as_secs_f64();
    let link_stats = cluster.stop();

    // 4. Summary and plot.
    let summary = summarize(
        a,
        mode,
        regions,
        &reports,
        &arrivals,
        full_bf16_bytes,
        Timing { wall_s, loop_s },
        &link_stats,
        &config,
    );
    let summary_path = out.join("summary.json");
    std::fs::write(&summary_path, serde_json::to_string_pretty(&summary)?)
        .context("write summary.json")?;
    let png = out.join("summary.png");
    render_png(&panels(&reports, &arrivals), "step", 900, 720, &png)?;
    Ok(summary)
}

/// Seconds from `version`'s publish to the last actor of each region holding it.
fn arrival_of(
    cluster: &Cluster,
    published_at: &BTreeMap<u64, Instant>,
    version: u64,
) -> BTreeMap<String, Option<f64>> {
    match published_at.get(&version) {
        Some(&t0) => cluster.region_arrival(t0, version),
        None => cluster
            .region_actors
            .keys()
            .map(|r| (r.to_string(), None))
            .collect(),
    }
}

fn share_line(per_actor: &BTreeMap<String, usize>) -> String {
    let total: usize = per_actor.values().sum();
    per_actor
        .iter()
        .map(|(a, n)| format!("{a} {:.0}%", 100.0 * *n as f64 / total.max(1) as f64))
        .collect::<Vec<_>>()
        .join(" ")
}

fn fmt_s(s: Option<f64>) -> String {
    s.map(|s| format!("{s:.3}")).unwrap_or_else(|| "-".into())
}

/// How long a run took: all of it, and its training loop (first submit to last publish).
struct Timing {
    wall_s: f64,
    loop_s: f64,
}

#[allow(clippy::too_many_arguments)]
fn summarize(
    a: &DemoArgs,
    mode: Mode,
    regions: &[Region],
    reports: &[StepReport],
    arrivals: &BTreeMap<u64, BTreeMap<String, Option<f64>>>,
    full_bf16_bytes: u64,
    timing: Timing,
    links: &BTreeMap<&str, ProxyStats>,
    config: &starling_engine::ModelConfig,
) -> Summary {
    let k = 3.min(reports.len());
    let first = mean(reports[..k].iter().map(|r| f64::from(r.mean_reward)));
    let last = mean(
        reports[reports.len() - k..]
            .iter()
            .map(|r| f64::from(r.mean_reward)),
    );
    let deltas: u64 = reports.iter().map(|r| r.published.delta_bytes).sum();
    let mut per_actor: BTreeMap<String, usize> = BTreeMap::new();
    for r in reports {
        for (a, n) in &r.per_actor {
            *per_actor.entry(a.clone()).or_default() += n;
        }
    }
    let total: usize = per_actor.values().sum();
    let transfer = mean_arrival_by_region(regions, arrivals);
    let tokens: usize = reports.iter().map(|r| r.tokens).sum();
    let samples: usize = reports.iter().map(|r| r.samples).sum();
    let mut step_s: Vec<f64> = reports.iter().map(|r| r.step_s).collect();
    step_s.sort_by(f64::total_cmp);
    let median_step_s = step_s.get(step_s.len() / 2).copied().unwrap_or(f64::NAN);
    let density = mean(
        reports
            .iter()
            .map(|r| r.published.changes as f64 / config.parameter_count() as f64),
    );
    let verified: usize = reports.iter().map(|r| r.verified_samples).sum();
    let mismatches: usize = reports.iter().map(|r| r.logprob_mismatches).sum();
    let first_mismatch = reports.iter().find_map(|r| r.first_mismatch.clone());
    let Timing { wall_s, loop_s } = timing;
    let per_step = |total: f64| total / reports.len().max(1) as f64;
    Summary {
        mode,
        model: ModelSummary {
            parameters: config.parameter_count(),
            bf16_bytes: full_bf16_bytes,
            config: config.clone(),
        },
        task: "digit reversal (char_match reward)".to_owned(),
        settings: Settings {
            steps: a.steps(),
            groups: a.groups(),
            samples_per_group: a.samples(),
            lr: a.lr(),
            warm_steps: a.warm_steps,
            seed: a.seed,
            max_staleness: 1,
            engine_slowdown: a.engine_slowdown,
        },
        regions: regions.iter().map(region_summary).collect(),
        reward: Reward {
            first,
            last,
            averaged_over_steps: k,
        },
        bytes: Bytes {
            deltas,
            per_step: per_step(deltas as f64),
            full_checkpoints: full_bf16_bytes * reports.len() as u64,
            ratio: deltas as f64 / (full_bf16_bytes * reports.len().max(1) as u64) as f64,
        },
        delta_density: density,
        link_bytes_per_step: per_step(mean(links.values().map(|s| s.down.delivered_bytes as f64))),
        link_bytes: links
            .iter()
            .map(|(name, s)| {
                let bytes = LinkBytes {
                    to_region: s.down.delivered_bytes,
                    to_hub: s.up.delivered_bytes,
                    lost_datagrams: s.down.dropped_loss
                        + s.down.dropped_queue
                        + s.up.dropped_loss
                        + s.up.dropped_queue,
                };
                (name.to_string(), bytes)
            })
            .collect(),
        mean_transfer_s: transfer
            .into_iter()
            .map(|(r, s)| (r.to_owned(), s))
            .collect(),
        rollouts_per_s: mean(reports.iter().map(|r| r.rollouts_per_s)),
        throughput: Throughput {
            loop_s,
            steps_per_hour: reports.len() as f64 * 3600.0 / loop_s,
            rollout_tokens_per_s: tokens as f64 / loop_s,
            samples_per_s: samples as f64 / loop_s,
            median_step_s,
        },
        behaviour_check: BehaviourCheck {
            verified_samples: verified,
            mismatches,
            first_mismatch,
        },
        per_actor_share: per_actor
            .iter()
            .map(|(a, n)| (a.clone(), *n as f64 / total.max(1) as f64))
            .collect(),
        wall_s,
        steps: reports
            .iter()
            .map(|r| StepSummary {
                report: r.clone(),
                arrival_s: arrivals.get(&r.published.version).cloned(),
            })
            .collect(),
    }
}

fn panels(
    reports: &[StepReport],
    arrivals: &BTreeMap<u64, BTreeMap<String, Option<f64>>>,
) -> Vec<Panel> {
    let xs = |f: &dyn Fn(&StepReport) -> f64| -> Vec<(f64, f64)> {
        reports.iter().map(|r| (f64::from(r.step), f(r))).collect()
    };
    let mut transfer = Vec::new();
    for (name, color) in [("eu", [31, 119, 180]), ("ap", [214, 39, 40])] {
        let pts = reports
            .iter()
            .filter_map(|r| {
                let s = arrivals.get(&r.published.version)?.get(name).copied()??;
                Some((f64::from(r.step), s))
            })
            .collect();
        transfer.push(Series {
            label: format!("{name}: publish to all actors active"),
            color,
            points: pts,
        });
    }
    vec![
        Panel {
            title: "Reward".into(),
            y_label: "mean reward".into(),
            series: vec![
                Series {
                    label: "mean char-match reward".into(),
                    color: [44, 160, 44],
                    points: xs(&|r| f64::from(r.mean_reward)),
                },
                Series {
                    label: "share solved exactly".into(),
                    color: [148, 103, 189],
                    points: xs(&|r| f64::from(r.solved)),
                },
            ],
        },
        Panel {
            title: "Rollout throughput".into(),
            y_label: "samples/s".into(),
            series: vec![Series {
                label: "samples per second of rollout time".into(),
                color: [255, 127, 14],
                points: xs(&|r| r.rollouts_per_s),
            }],
        },
        Panel {
            title: "Weight transfer per region".into(),
            y_label: "seconds".into(),
            series: transfer,
        },
    ]
}

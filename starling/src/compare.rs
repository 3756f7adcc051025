//! `starling demo --compare`: the three ways of getting weights to the actors, side by side in
//! one invocation on the same machine, from the same BF16 checkpoint and seed.
//!
//! Each round runs delta, no-transfer and full-broadcast in turn (rounds interleave the
//! modes, so a machine that slows down over time slows all of them), each a complete run in
//! `OUT/r<round>-<mode>/` with its own hub, relays, actors, logs, summary and plot. The table
//! compares end-to-end throughput (steps/hour and rollout tokens/s over the training loop, from
//! the first submit to the last publish), with no-transfer — every actor reading the trainer's
//! checkpoint from a shared directory, no bytes on any link — as the ideal. `compare.json`
//! holds every run's summary and the per-mode medians.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use starling_engine::Bf16Tensors;

use crate::cluster::Mode;
use crate::demo_args::DemoArgs;
use crate::links::Region;
use crate::summary::{Summary, figure};
use crate::toy_run::run_mode;

/// `compare.json`: every run's summary and the per-mode medians.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Report {
    rounds: u32,
    /// Mode name → figure name ([`FIGURES`]) → median over rounds (`null` without any).
    medians: BTreeMap<String, BTreeMap<String, Option<f64>>>,
    ratios: Ratios,
    /// Median over the delta runs.
    #[serde(with = "figure")]
    delta_density: f64,
    runs: Vec<Run>,
}

/// Delta against the other modes, from the medians.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Ratios {
    #[serde(with = "figure")]
    delta_over_no_transfer_tokens_per_s: f64,
    #[serde(with = "figure")]
    delta_over_no_transfer_steps_per_hour: f64,
    #[serde(with = "figure")]
    delta_over_full_broadcast_steps_per_hour: f64,
    #[serde(with = "figure")]
    delta_over_full_broadcast_tokens_per_s: f64,
}

/// One run of one mode in one round.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Run {
    round: u32,
    mode: Mode,
    summary: Summary,
}

fn median(mut xs: Vec<f64>) -> f64 {
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

/// One figure of a run's summary (NaN where the run did not measure it).
type Figure = fn(&Summary) -> f64;

/// The figures a mode is compared on, medians over its rounds.
const FIGURES: [(&str, Figure); 10] = [
    ("steps_per_hour", |s| s.throughput.steps_per_hour),
    ("rollout_tokens_per_s", |s| {
        s.throughput.rollout_tokens_per_s
    }),
    ("samples_per_s", |s| s.throughput.samples_per_s),
    ("median_step_s", |s| s.throughput.median_step_s),
    ("bytes_per_step", |s| s.bytes.per_step),
    ("link_bytes_per_step", |s| s.link_bytes_per_step),
    ("transfer_eu_s", |s| transfer_s(s, "eu")),
    ("transfer_ap_s", |s| transfer_s(s, "ap")),
    ("reward_first", |s| s.reward.first),
    ("reward_last", |s| s.reward.last),
];

/// A region's mean transfer time (NaN when the run had no such region).
fn transfer_s(s: &Summary, region: &str) -> f64 {
    s.mean_transfer_s.get(region).copied().unwrap_or(f64::NAN)
}

/// Runs every mode `a.rounds` times into subdirectories of `out`; prints and writes the
/// comparison.
pub(crate) fn run(a: &DemoArgs, regions: &[Region], init: &Bf16Tensors, out: &Path) -> Result<()> {
    let rounds = a.rounds.max(1);
    let mut runs: Vec<Run> = Vec::new();
    for round in 1..=rounds {
        for mode in Mode::ALL {
            let dir = out.join(format!("r{round}-{}", mode.name()));
            std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
            println!("\n== round {round}/{rounds}");
            let summary = run_mode(a, mode, regions, init, &dir)?;
            runs.push(Run {
                round,
                mode,
                summary,
            });
        }
    }
    let mut medians: BTreeMap<&str, BTreeMap<&str, f64>> = BTreeMap::new();
    for mode in Mode::ALL {
        let of_mode: Vec<&Summary> = runs
            .iter()
            .filter(|r| r.mode == mode)
            .map(|r| &r.summary)
            .collect();
        let figures = FIGURES
            .iter()
            .map(|(name, figure)| (*name, median(of_mode.iter().map(|s| figure(s)).collect())))
            .collect();
        medians.insert(mode.name(), figures);
    }
    let fig = |mode: Mode, name: &str| -> f64 {
        medians
            .get(mode.name())
            .and_then(|m| m.get(name))
            .copied()
            .unwrap_or(f64::NAN)
    };
    let ideal = fig(Mode::NoTransfer, "rollout_tokens_per_s");
    let ideal_steps = fig(Mode::NoTransfer, "steps_per_hour");
    println!(
        "\n== comparison ({rounds} round(s); medians; links: {})\n",
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
        "{:<15} {:>9} {:>9} {:>8} {:>10} {:>10} {:>7} {:>7} {:>13} {:>15}",
        "mode",
        "steps/h",
        "tok/s",
        "step s",
        "version kB",
        "link kB/st",
        "eu s",
        "ap s",
        "reward",
        "vs no-transfer"
    );
    for mode in Mode::ALL {
        println!(
            "{:<15} {:>9.0} {:>9.0} {:>8.3} {:>10.1} {:>10.1} {:>7.3} {:>7.3} {:>6.3}->{:<6.3} {:>7.3} / {:<6.3}",
            mode.name(),
            fig(mode, "steps_per_hour"),
            fig(mode, "rollout_tokens_per_s"),
            fig(mode, "median_step_s"),
            fig(mode, "bytes_per_step") / 1e3,
            fig(mode, "link_bytes_per_step") / 1e3,
            fig(mode, "transfer_eu_s"),
            fig(mode, "transfer_ap_s"),
            fig(mode, "reward_first"),
            fig(mode, "reward_last"),
            fig(mode, "rollout_tokens_per_s") / ideal,
            fig(mode, "steps_per_hour") / ideal_steps,
        );
    }
    let delta_over_full =
        fig(Mode::Delta, "steps_per_hour") / fig(Mode::FullBroadcast, "steps_per_hour");
    println!(
        "\n   version kB: what the hub encoded per version (shipped in delta and full-broadcast, \
         not in no-transfer); link kB/st: bytes each region's link carried towards it per step \
         (weights and job traffic), mean over regions"
    );
    println!(
        "   ratios (tokens/s / steps/h): delta over no-transfer {:.3} / {:.3}; delta over full broadcast {:.2}x steps/hour",
        fig(Mode::Delta, "rollout_tokens_per_s") / ideal,
        fig(Mode::Delta, "steps_per_hour") / ideal_steps,
        delta_over_full,
    );
    let density = median(
        runs.iter()
            .filter(|r| r.mode == Mode::Delta)
            .map(|r| r.summary.delta_density)
            .collect(),
    );
    println!(
        "   delta density at lr {}: {:.1}% of weights changed per step",
        a.lr(),
        100.0 * density
    );
    let report = Report {
        rounds,
        medians: medians
            .iter()
            .map(|(mode, figures)| {
                let figures = figures
                    .iter()
                    .map(|(name, x)| ((*name).to_owned(), x.is_finite().then_some(*x)))
                    .collect();
                ((*mode).to_owned(), figures)
            })
            .collect(),
        ratios: Ratios {
            delta_over_no_transfer_tokens_per_s: fig(Mode::Delta, "rollout_tokens_per_s") / ideal,
            delta_over_no_transfer_steps_per_hour: fig(Mode::Delta, "steps_per_hour") / ideal_steps,
            delta_over_full_broadcast_steps_per_hour: delta_over_full,
            delta_over_full_broadcast_tokens_per_s: fig(Mode::Delta, "rollout_tokens_per_s")
                / fig(Mode::FullBroadcast, "rollout_tokens_per_s"),
        },
        delta_density: density,
        runs,
    };
    let path = out.join("compare.json");
    std::fs::write(&path, serde_json::to_string_pretty(&report)?)
        .with_context(|| format!("write {}", path.display()))?;
    println!("   wrote {}", path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_skip_missing_figures() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, f64::NAN, 2.0, 3.0]), 2.5);
        assert!(median(vec![f64::NAN]).is_nan());
    }
}

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
use serde_json::{Value, json};
use starling_engine::Bf16Tensors;

use crate::cluster::Mode;
use crate::demo_args::DemoArgs;
use crate::links::Region;
use crate::toy_run::run_mode;

/// A number from a run's summary (NaN if absent).
fn num(summary: &Value, path: &[&str]) -> f64 {
    path.iter()
        .fold(summary, |v, k| &v[*k])
        .as_f64()
        .unwrap_or(f64::NAN)
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

/// The figures a mode is compared on, medians over its rounds.
const FIGURES: [(&str, &[&str]); 10] = [
    ("steps_per_hour", &["throughput", "steps_per_hour"]),
    (
        "rollout_tokens_per_s",
        &["throughput", "rollout_tokens_per_s"],
    ),
    ("samples_per_s", &["throughput", "samples_per_s"]),
    ("median_step_s", &["throughput", "median_step_s"]),
    ("bytes_per_step", &["bytes", "per_step"]),
    ("link_bytes_per_step", &["link_bytes_per_step"]),
    ("transfer_eu_s", &["mean_transfer_s", "eu"]),
    ("transfer_ap_s", &["mean_transfer_s", "ap"]),
    ("reward_first", &["reward", "first"]),
    ("reward_last", &["reward", "last"]),
];

/// Runs every mode `a.rounds` times into subdirectories of `out`; prints and writes the
/// comparison.
pub(crate) fn run(a: &DemoArgs, regions: &[Region], init: &Bf16Tensors, out: &Path) -> Result<()> {
    let rounds = a.rounds.max(1);
    let mut runs: Vec<(u32, Mode, Value)> = Vec::new();
    for round in 1..=rounds {
        for mode in Mode::ALL {
            let dir = out.join(format!("r{round}-{}", mode.name()));
            std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
            println!("\n== round {round}/{rounds}");
            let summary = run_mode(a, mode, regions, init, &dir)?;
            runs.push((round, mode, summary));
        }
    }
    let mut medians: BTreeMap<&str, BTreeMap<&str, f64>> = BTreeMap::new();
    for mode in Mode::ALL {
        let of_mode: Vec<&Value> = runs
            .iter()
            .filter(|(_, m, _)| *m == mode)
            .map(|(_, _, s)| s)
            .collect();
        let figures = FIGURES
            .iter()
            .map(|(name, path)| {
                (
                    *name,
                    median(of_mode.iter().map(|s| num(s, path)).collect()),
                )
            })
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
            .filter(|(_, m, _)| *m == Mode::Delta)
            .map(|(_, _, s)| num(s, &["delta_density"]))
            .collect(),
    );
    println!(
        "   delta density at lr {}: {:.1}% of weights changed per step",
        a.lr(),
        100.0 * density
    );
    let report = json!({
        "rounds": rounds,
        "medians": medians,
        "ratios": {
            "delta_over_no_transfer_tokens_per_s": fig(Mode::Delta, "rollout_tokens_per_s") / ideal,
            "delta_over_no_transfer_steps_per_hour": fig(Mode::Delta, "steps_per_hour") / ideal_steps,
            "delta_over_full_broadcast_steps_per_hour": delta_over_full,
            "delta_over_full_broadcast_tokens_per_s":
                fig(Mode::Delta, "rollout_tokens_per_s") / fig(Mode::FullBroadcast, "rollout_tokens_per_s"),
        },
        "delta_density": density,
        "runs": runs.iter().map(|(round, mode, s)| json!({
            "round": round, "mode": mode.name(), "summary": s,
        })).collect::<Vec<_>>(),
    });
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
        let s = json!({"a": {"b": 1.5}});
        assert_eq!(num(&s, &["a", "b"]), 1.5);
        assert!(num(&s, &["a", "c"]).is_nan());
    }
}

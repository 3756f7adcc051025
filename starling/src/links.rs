//! The demo's regions and their emulated wide-area links.
//!
//! Each region reaches the hub through one `starling-netem` proxy (in this process): the
//! relay's weight stream and the actors' job traffic share it, as they would share a region's
//! uplink. Rates and delays are per direction; the round trip is twice the one-way delay.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use starling_netem::{LinkProfile, Proxy, ProxyHandle};

/// One emulated region.
#[derive(Debug, Clone)]
pub(crate) struct Region {
    pub(crate) name: &'static str,
    pub(crate) rate_mbit: f64,
    pub(crate) rtt_ms: u64,
    /// Loss probability per packet, each direction (0.001 = 0.1%).
    pub(crate) loss: f64,
    /// The region's actors.
    pub(crate) actors: Vec<ActorSpec>,
}

/// One actor of a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ActorSpec {
    pub(crate) name: &'static str,
    /// Nominal speed: 3 runs the built-in engine at full speed, 1 three times slower
    /// (`--engine-slowdown 3/speed`, times the run's own slowdown).
    pub(crate) speed: u32,
    /// Generates with a vLLM server the actor starts (`--engine vllm`) instead of the built-in
    /// engine; `speed` does not apply to it.
    pub(crate) vllm: bool,
}

impl ActorSpec {
    pub(crate) const fn builtin(name: &'static str, speed: u32) -> Self {
        Self {
            name,
            speed,
            vllm: false,
        }
    }
}

/// The demo's two regions: a near one and a far, lossy, slower one; actors at speeds 1:2:3.
pub(crate) fn demo_regions() -> Vec<Region> {
    vec![
        Region {
            name: "eu",
            rate_mbit: 200.0,
            rtt_ms: 40,
            loss: 0.0,
            actors: vec![
                ActorSpec::builtin("eu-a1", 3),
                ActorSpec::builtin("eu-a2", 1),
            ],
        },
        Region {
            name: "ap",
            rate_mbit: 50.0,
            rtt_ms: 150,
            loss: 0.001,
            actors: vec![ActorSpec::builtin("ap-a1", 2)],
        },
    ]
}

/// The real-model run's regions (`starling demo --model`): links where a full checkpoint of
/// a 135 M-parameter model (269 MB) takes as long as an 8B model's 16 GB over 0.5–1 Gbit/s
/// (the regime the papers measure), or with `fast`, the quick demo's own links. `eu` holds a
/// built-in engine actor and, with `vllm`, a vLLM actor; `ap` a built-in engine actor.
pub(crate) fn real_regions(fast: bool, vllm: bool) -> Vec<Region> {
    let mut eu = vec![ActorSpec::builtin("eu-a1", 3)];
    if vllm {
        eu.push(ActorSpec {
            name: "eu-v1",
            speed: 3,
            vllm: true,
        });
    }
    vec![
        Region {
            name: "eu",
            rate_mbit: if fast { 200.0 } else { 17.0 },
            rtt_ms: 40,
            loss: 0.0,
            actors: eu,
        },
        Region {
            name: "ap",
            rate_mbit: if fast { 50.0 } else { 8.0 },
            rtt_ms: 150,
            loss: 0.001,
            actors: vec![ActorSpec::builtin("ap-a1", 3)],
        },
    ]
}

/// Applies `--link-mbit NAME=MBIT` overrides to the regions' link rates.
pub(crate) fn override_rates(regions: &mut [Region], overrides: &[String]) -> Result<()> {
    for o in overrides {
        let Some((name, rate)) = o.split_once('=') else {
            bail!("--link-mbit {o:?} is not NAME=MBIT (e.g. eu=4)");
        };
        let rate: f64 = match rate.trim().parse() {
            Ok(r) if r > 0.0 && f64::is_finite(r) => r,
            _ => bail!("--link-mbit {o:?}: the rate must be a positive number of Mbit/s"),
        };
        let known: Vec<&str> = regions.iter().map(|r| r.name).collect();
        let Some(region) = regions.iter_mut().find(|r| r.name == name.trim()) else {
            bail!("--link-mbit {o:?}: no region {name:?} (the regions are {known:?})");
        };
        region.rate_mbit = rate;
    }
    Ok(())
}

impl Region {
    fn profile(&self, seed: u64) -> LinkProfile {
        LinkProfile::ideal()
            .with_rate_bps((self.rate_mbit * 1e6) as u64)
            .with_delay(Duration::from_millis(self.rtt_ms / 2))
            .with_loss(self.loss)
            .with_seed(seed)
    }

    /// Starts the region's WAN link to `hub`; returns the proxy (send to its `local_addr`).
    pub(crate) fn start_link(&self, hub: SocketAddr, seed: u64) -> Result<ProxyHandle> {
        let listen: SocketAddr = ([127, 0, 0, 1], 0).into();
        Proxy::start(listen, hub, self.profile(seed), self.profile(seed + 1))
            .with_context(|| format!("start the emulated link of region {}", self.name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_are_overridden_by_region_name_and_bad_overrides_refused() {
        let mut r = demo_regions();
        override_rates(&mut r, &["eu=4".into(), "ap=0.5".into()]).expect("valid");
        assert_eq!((r[0].rate_mbit, r[1].rate_mbit), (4.0, 0.5));
        for bad in ["eu", "eu=0", "eu=x", "us=3"] {
            let e = override_rates(&mut r, &[bad.into()]).expect_err(bad);
            assert!(e.to_string().contains("--link-mbit"), "{e}");
        }
    }
}

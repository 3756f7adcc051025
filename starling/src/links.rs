//! The demo's regions and their emulated wide-area links.
//!
//! Each region reaches the hub through one `starling-netem` proxy (in this process): the
//! relay's weight stream and the actors' job traffic share it, as they would share a region's
//! uplink. Rates and delays are per direction; the round trip is twice the one-way delay.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result};
use starling_netem::{LinkProfile, Proxy, ProxyHandle};

/// One emulated region.
#[derive(Debug, Clone)]
pub(crate) struct Region {
    pub(crate) name: &'static str,
    pub(crate) rate_mbit: u64,
    pub(crate) rtt_ms: u64,
    /// Loss probability per packet, each direction (0.001 = 0.1%).
    pub(crate) loss: f64,
    /// The region's actors: (name, speed). Speed 3 runs the engine at full speed, speed 1 three
    /// times slower.
    pub(crate) actors: Vec<(&'static str, u32)>,
}

/// The demo's two regions: a near one and a far, lossy, slower one; actors at speeds 1:2:3.
pub(crate) fn demo_regions() -> Vec<Region> {
    vec![
        Region {
            name: "eu",
            rate_mbit: 200,
            rtt_ms: 40,
            loss: 0.0,
            actors: vec![("eu-a1", 3), ("eu-a2", 1)],
        },
        Region {
            name: "ap",
            rate_mbit: 50,
            rtt_ms: 150,
            loss: 0.001,
            actors: vec![("ap-a1", 2)],
        },
    ]
}

impl Region {
    fn profile(&self, seed: u64) -> LinkProfile {
        LinkProfile::ideal()
            .with_rate_bps(self.rate_mbit * 1_000_000)
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

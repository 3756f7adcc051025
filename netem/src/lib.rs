//! `starling-netem`: a user-space UDP link emulator.
//!
//! The kernel on Starling's machines has no `netem` qdisc, so tests and
//! benchmarks that need wide-area links between emulated regions put a
//! [`Proxy`] between a client and a server. Each direction follows a
//! [`LinkProfile`] — rate, delay, jitter, loss, queue limit — through a pure,
//! clock-injected [`LinkModel`], and a dedicated thread per direction sends
//! each packet at the instant the model chose.
//!
//! ```no_run
//! use std::time::Duration;
//! use starling_netem::{LinkProfile, Proxy};
//!
//! # fn main() -> Result<(), starling_netem::NetemError> {
//! let wan = LinkProfile::ideal()
//!     .with_rate_bps(100_000_000)
//!     .with_delay(Duration::from_millis(25))
//!     .with_loss(0.001);
//! let proxy = Proxy::start(
//!     "127.0.0.1:0".parse().expect("literal address"),
//!     "127.0.0.1:7001".parse().expect("literal address"),
//!     wan.clone(),
//!     wan.with_seed(1),
//! )?;
//! println!("send to {}", proxy.local_addr());
//! let stats = proxy.shutdown()?;
//! println!("{stats}");
//! # Ok(())
//! # }
//! ```
//!
//! Modules: [`model`] (the link model), [`profile`] (its parameters),
//! [`proxy`] (sockets and threads), `delivery` (the timed send queue),
//! [`stats`] (counters), [`units`] (`100mbit`, `25ms`, ...), [`cli`] (the
//! binary's arguments). See `docs/netem.md` for the model's limits and
//! measured figures.

pub mod cli;
mod delivery;
pub mod error;
pub mod model;
pub mod profile;
pub mod proxy;
pub mod rng;
pub mod stats;
pub mod units;

pub use error::NetemError;
pub use model::{DropReason, LinkModel, Verdict};
pub use profile::{LinkProfile, UDP_IPV4_ETHERNET_OVERHEAD};
pub use proxy::{Proxy, ProxyHandle};
pub use stats::{DirectionStats, ProxyStats};

//! `starling-relay`: the per-region relay (verified cut-through forwarding, version cache,
//! commit propagation). Its data plane arrives with the streaming-distribution work; until
//! then the binary only says so and exits with an error, so nobody mistakes it for a relay.

fn main() -> std::process::ExitCode {
    eprintln!(
        "starling-relay: the relay data plane is not implemented yet (see docs/ARCHITECTURE.md)"
    );
    std::process::ExitCode::from(2)
}

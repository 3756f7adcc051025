//! `starling-actor`: stages deltas beside the inference engine and activates them on COMMIT.
//! Its data plane arrives with the streaming-distribution work; until then the binary only
//! says so and exits with an error, so nobody mistakes it for an actor.

fn main() -> std::process::ExitCode {
    eprintln!("starling-actor: the actor is not implemented yet (see docs/ARCHITECTURE.md)");
    std::process::ExitCode::from(2)
}

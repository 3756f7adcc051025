//! `starling-fault-hub`: the hub's command line (`starling-hub …`, the same code) with one
//! test-only fault armed from the environment, for the end-to-end tests that prove receivers
//! refuse what does not verify.
//!
//! `STARLING_TEST_CORRUPT_VERSION=N`: the first transmission of version N by this hub has one
//! byte of its first segment flipped (`starling_transport::fanout::inject_corruption`).
//!
//! The released binaries (`starling-hub`, `starling-relay`, `starling-actor`, `starling`) never
//! arm it and never read that variable: the hook has no switch a user's build can turn on
//! (`tests/tests/distribution.rs` checks both the bytes of the binaries and their behaviour).

fn main() -> std::process::ExitCode {
    if let Ok(v) = std::env::var(starling_tests::CORRUPT_VERSION_VAR) {
        match v.parse::<u64>() {
            Ok(version) => starling_transport::fanout::inject_corruption(version),
            Err(_) => {
                eprintln!(
                    "error: {}={v:?} is not a version number",
                    starling_tests::CORRUPT_VERSION_VAR
                );
                return std::process::ExitCode::from(2);
            }
        }
    }
    starling_hub::cli::main_from(std::env::args_os())
}

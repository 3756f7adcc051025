//! Running a service binary: a multi-threaded runtime, the service told when the process is
//! asked to stop (Ctrl-C/SIGTERM) so it can drain within its grace period, and the exit code
//! with the error's causes on stderr.
//!
//! The relay and the actor run under it, so they stop the same way: the first signal cancels
//! the service's token and waits for it to return, a second one stops at once, and blocking
//! work left after that gets half a second before the runtime is dropped.

use std::fmt::Display;
use std::future::Future;
use std::process::ExitCode;

use tokio_util::sync::CancellationToken;

use crate::logging::fatal;
use crate::signal::shutdown_signal;

/// Runs `service` to completion. The token it is given is cancelled at the first SIGTERM or
/// SIGINT: the service drains (bounded by its own grace period) and returns. A second signal
/// stops it at once.
pub fn run_service<E, S, F>(service: S) -> ExitCode
where
    E: Display,
    S: FnOnce(CancellationToken) -> F,
    F: Future<Output = Result<(), E>>,
{
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            fatal(&format_args!("start the async runtime: {e}"));
            return ExitCode::FAILURE;
        }
    };
    let stop = CancellationToken::new();
    let result = rt.block_on(async {
        let service = service(stop.clone());
        tokio::pin!(service);
        tokio::select! {
            r = &mut service => r,
            _ = shutdown_signal() => {
                tracing::info!("asked to stop; draining");
                stop.cancel();
                tokio::select! {
                    r = &mut service => r,
                    _ = shutdown_signal() => {
                        tracing::warn!("asked again; stopping now");
                        Ok(())
                    }
                }
            }
        }
    });
    // Blocking work still running (a generation, a hash) past the service's own grace period
    // does not hold the process up.
    rt.shutdown_timeout(std::time::Duration::from_millis(500));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            fatal(&format_args!("{e:#}"));
            ExitCode::FAILURE
        }
    }
}

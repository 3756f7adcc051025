//! Running a service binary: a multi-threaded runtime, the service told when the process is
//! asked to stop (Ctrl-C/SIGTERM) so it can drain within its grace period, and the exit code
//! with the error's causes on stderr.

use std::fmt::Display;
use std::future::Future;
use std::process::ExitCode;

use tokio_util::sync::CancellationToken;

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
            starling_telemetry::logging::fatal(&format_args!("start the async runtime: {e}"));
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
            starling_telemetry::logging::fatal(&format_args!("{e:#}"));
            ExitCode::FAILURE
        }
    }
}

/// Completes when the process is asked to stop: SIGTERM (systemd, Kubernetes) or SIGINT
/// (Ctrl-C).
pub async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
    }
}

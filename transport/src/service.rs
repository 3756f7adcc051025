//! Running a service binary: a multi-threaded runtime, the service future raced against
//! Ctrl-C/SIGTERM, and the exit code with the error's causes on stderr.

use std::fmt::Display;
use std::future::Future;
use std::process::ExitCode;

/// Runs `service` to completion or until the process is asked to stop.
pub fn run_service<E: Display>(service: impl Future<Output = Result<(), E>>) -> ExitCode {
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
    let result = rt.block_on(async {
        tokio::select! {
            r = service => r,
            _ = shutdown_signal() => Ok(()),
        }
    });
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

//! When the process is asked to stop: SIGTERM (systemd, Kubernetes, the demo stopping its
//! children) or SIGINT (Ctrl-C).
//!
//! A future, not a handler that exits: the caller decides what stopping means (cancel a token
//! and drain, as [`run_service`](crate::service::run_service) does, or end a server's accept
//! loop, as the hub does), so no process is cut off mid-write by its own signal handling.

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

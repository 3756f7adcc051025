//! A server's subscribers on its own endpoint (a relay's region): every connection is
//! admitted ([`admit`]), sends its `Subscribe`, takes a place among its certificate's
//! subscriptions ([`Downstream::subscriptions`]; over the bound it is refused
//! `TooManyConnections` and closed), and is served ([`serve_subscription`]) in a task this
//! accept loop owns, until the connection ends. When the loop is told to stop
//! accepting it takes no new connections and keeps serving the ones it has until they end
//! (a stopping relay forwards what it verified to the actors subscribed), so its caller
//! decides how long the drain may last by when it drops the loop's future.
//!
//! The hub does not use this loop: its connections carry work as well as subscriptions, so
//! it reads each connection's first message itself, and bounds and serves the subscribers
//! the same way.

use std::sync::Arc;

use quinn::{Connection, Endpoint};
use starling_proto::protocol::msg::{Message, Role as MsgRole};
use starling_telemetry::Metrics;
use thiserror::Error;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::admit::{AdmitError, admit};
use crate::book::VersionBook;
use crate::connections::ConnectionCap;
use crate::fanout::{FanoutConfig, FanoutError, serve_subscription};
use crate::framed::FramedError;

/// What the accept loop serves, and to whom.
#[derive(Debug, Clone)]
pub struct Downstream {
    /// The versions it sends.
    pub book: Arc<VersionBook>,
    /// How the server names itself in refusals (`relay`).
    pub server: String,
    /// The model a subscriber must hold.
    pub model_id: String,
    /// The roles admitted.
    pub serves: Vec<MsgRole>,
    /// The live subscriptions each certificate holds, and how many it may.
    pub subscriptions: Arc<ConnectionCap>,
    /// How versions are sent; its observer is also told when each subscriber arrives and
    /// leaves.
    pub fanout: FanoutConfig,
    pub metrics: Metrics,
}

/// Why serving one subscriber's connection ended.
#[derive(Debug, Error)]
pub enum DownstreamError {
    #[error(transparent)]
    Admit(#[from] AdmitError),
    #[error(transparent)]
    Framed(#[from] FramedError),
    #[error(transparent)]
    Fanout(#[from] FanoutError),
}

/// Accepts subscribers on `endpoint` until `accepting` is cancelled (or the endpoint
/// closes), then waits for the connections it serves to end.
pub async fn accept_subscribers(
    endpoint: Endpoint,
    downstream: Downstream,
    accepting: CancellationToken,
) {
    let downstream = Arc::new(downstream);
    let mut connections = JoinSet::new();
    loop {
        let incoming = tokio::select! {
            i = endpoint.accept() => i,
            _ = accepting.cancelled() => None,
        };
        let Some(incoming) = incoming else {
            while connections.join_next().await.is_some() {}
            return;
        };
        while connections.try_join_next().is_some() {}
        let downstream = downstream.clone();
        connections.spawn(async move {
            match incoming.await {
                Ok(conn) => {
                    if let Err(e) = serve_connection(&downstream, conn.clone()).await {
                        let e = starling_process::error_chain(&e);
                        tracing::warn!(remote = %conn.remote_address(), "subscriber connection ended: {e}");
                    }
                }
                Err(e) => tracing::warn!("refused a connection during the handshake: {e}"),
            }
        });
    }
}

/// One connection: admission, its `Subscribe`, its place among its certificate's
/// subscriptions, then versions until it ends.
async fn serve_connection(d: &Downstream, conn: Connection) -> Result<(), DownstreamError> {
    let Some(mut a) = admit(&conn, &d.server, &d.model_id, &d.serves, d.book.latest()).await?
    else {
        return Ok(());
    };
    let mut reader = a.reader;
    let after = match reader.next().await? {
        Some(Message::Subscribe { after_version }) => after_version,
        other => return Err(FanoutError::NoSubscribe(format!("{other:?}")).into()),
    };
    let Some(slot) = d
        .subscriptions
        .take(a.role, &a.name, &mut a.control)
        .await?
    else {
        d.metrics.subscription_refused();
        return Ok(());
    };
    let span = tracing::info_span!("peer", peer = %a.name, role = ?a.role);
    span.in_scope(|| tracing::info!(after_version = after, "subscribed"));
    let observer = d.fanout.observer.clone();
    if let Some(o) = &observer {
        o.subscribed(&a.name, after);
    }
    let name = a.name.clone();
    let served = serve_subscription(
        d.book.clone(),
        conn,
        a.control,
        reader,
        a.name,
        d.fanout.clone(),
        d.metrics.clone(),
        after,
    )
    .instrument(span.clone())
    .await;
    // The place is free before anyone hears the subscriber left.
    drop(slot);
    if let Some(o) = &observer {
        o.left(&name);
    }
    span.in_scope(|| tracing::info!("left"));
    Ok(served?)
}

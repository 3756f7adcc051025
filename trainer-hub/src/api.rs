//! The hub's HTTP API for the trainer: `POST /v1/versions` publishes a checkpoint (a path on
//! the hub's machine, as with `starling-hub publish`), `GET /v1/versions` says what is
//! published. Served next to `/metrics` by `starling_telemetry::http`.
//!
//! The HTTP listener has no TLS or authentication of its own: bind it to loopback or the
//! training cluster's private network (the QUIC side is where remote peers come in).

use std::path::PathBuf;
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use starling_proto::msg::Message;

use crate::serve::{Hub, publish};

/// `POST /v1/versions` body.
#[derive(Debug, Deserialize)]
pub struct PublishRequest {
    /// A safetensors file or sharded directory readable by the hub.
    pub path: PathBuf,
    /// The trainer's own step number, recorded with the version.
    #[serde(default)]
    pub step: Option<u64>,
}

/// `POST /v1/versions` answer.
#[derive(Debug, Serialize)]
pub struct Published {
    pub version: u64,
    pub changes: u64,
    pub bytes: u64,
}

/// `GET /v1/versions` answer.
#[derive(Debug, Serialize)]
pub struct Versions {
    /// The newest version whose delta is durable.
    pub latest: u64,
    /// The oldest version still served as a delta.
    pub oldest_retained: u64,
}

#[derive(Debug, Serialize)]
struct ApiError {
    error: String,
}

type Reply<T> = Result<Json<T>, (StatusCode, Json<ApiError>)>;

pub(crate) fn router(hub: Arc<Hub>) -> Router {
    Router::new()
        .route("/v1/versions", get(list).post(create))
        .with_state(hub)
}

async fn list(State(hub): State<Arc<Hub>>) -> Json<Versions> {
    Json(Versions {
        latest: hub.book().latest(),
        oldest_retained: hub.book().oldest(),
    })
}

async fn create(State(hub): State<Arc<Hub>>, Json(req): Json<PublishRequest>) -> Reply<Published> {
    let fail = |code, error: String| Err((code, Json(ApiError { error })));
    if !req.path.is_absolute() {
        return fail(
            StatusCode::BAD_REQUEST,
            format!("path must be absolute: {}", req.path.display()),
        );
    }
    match publish(&hub, &req.path, req.step).await {
        Ok(Message::Published {
            version,
            changes,
            bytes,
        }) => Ok(Json(Published {
            version,
            changes,
            bytes,
        })),
        Ok(other) => fail(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("unexpected {other:?}"),
        ),
        Err(e) => fail(StatusCode::UNPROCESSABLE_ENTITY, format!("{e:#}")),
    }
}

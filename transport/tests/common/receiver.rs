//! The receiving side the integration tests that run `drive::run` share: actor `a1`'s
//! `Hello`, and a feed and receiving core following sources on loopback.

use std::net::SocketAddr;
use std::time::Instant;

use starling_proto::protocol::msg::{Message, PROTOCOL_VERSION, Role as MsgRole};
use starling_telemetry::{Component, Metrics};
use starling_transport::endpoint::{client_config, client_endpoint};
use starling_transport::follow::{Bounds, FollowConfig, Follower, PolicyConfig, SourcePolicy};
use starling_transport::framed::StreamFrame;
use starling_transport::identity::{Credentials, Role};
use starling_transport::link::LinkProfile;
use starling_transport::upstream::{Feed, SourceAddr};

/// Actor `a1`'s `Hello` (model `m`, holding nothing yet).
pub(crate) fn hello() -> Message {
    Message::Hello {
        protocol: PROTOCOL_VERSION,
        role: MsgRole::Actor,
        name: "a1".into(),
        region: "eu".into(),
        model_id: "m".into(),
        active: None,
        link: None,
    }
}

/// Actor `a1`'s feed over `sources` (in order of preference, each served as a hub) and an
/// actor's receiving core at version 0, for `drive::run`.
pub(crate) fn receiver(a1: &Credentials, sources: &[SocketAddr]) -> (Feed, Follower<StreamFrame>) {
    let endpoint = client_endpoint(a1, "127.0.0.1:0".parse().expect("addr"), &LinkProfile::LAN)
        .expect("client endpoint");
    let config = client_config(a1, &LinkProfile::LAN).expect("client config");
    let n = sources.len();
    let sources = sources
        .iter()
        .map(|&addr| SourceAddr {
            role: Role::Hub,
            name: "hub".into(),
            addr,
        })
        .collect();
    let feed = Feed::new(endpoint, config, sources, Metrics::new(Component::Actor));
    let core = Follower::new(
        FollowConfig::actor(Bounds::for_model(1 << 20)),
        SourcePolicy::new(PolicyConfig::actor(), n),
        0,
        Instant::now(),
    );
    (feed, core)
}

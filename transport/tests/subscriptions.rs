//! The subscriptions one certificate may hold on a server, over real QUIC on loopback: the
//! accept loop a relay runs serves up to its bound, refuses the next one by name, and takes a
//! new one once an earlier one ended.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use starling_proto::protocol::msg::{Message, PROTOCOL_VERSION, RefuseReason, Role as MsgRole};
use starling_telemetry::{Component, Metrics};
use starling_transport::book::VersionBook;
use starling_transport::connections::ConnectionCap;
use starling_transport::downstream::{Downstream, accept_subscribers};
use starling_transport::endpoint::{client_config, client_endpoint, server_endpoint};
use starling_transport::fanout::{FanoutConfig, SubscriberObserver};
use starling_transport::identity::{Credentials, Role};
use starling_transport::link::LinkProfile;
use starling_transport::upstream::{Upstream, UpstreamEvent};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

const LOOPBACK: &str = "127.0.0.1:0";
/// The bound under test.
const K: usize = 2;
const T: Duration = Duration::from_secs(10);

/// Tells the test each time a subscriber's subscription ended.
#[derive(Debug)]
struct Departures(mpsc::UnboundedSender<String>);

impl SubscriberObserver for Departures {
    fn left(&self, peer: &str) {
        let _ = self.0.send(peer.to_owned());
    }
}

/// A server running the relays' accept loop with at most [`K`] subscriptions per certificate.
fn spawn_server(
    creds: &Credentials,
    accepting: CancellationToken,
    metrics: &Metrics,
) -> (SocketAddr, mpsc::UnboundedReceiver<String>) {
    let ep =
        server_endpoint(creds, LOOPBACK.parse().expect("addr"), &LinkProfile::LAN).expect("server");
    let addr = ep.local_addr().expect("local addr");
    let (left, departures) = mpsc::unbounded_channel();
    let downstream = Downstream {
        book: Arc::new(VersionBook::new(0, 4)),
        server: "relay".into(),
        model_id: "m".into(),
        serves: vec![MsgRole::Actor],
        subscriptions: ConnectionCap::new("subscription", K),
        fanout: FanoutConfig {
            observer: Some(Arc::new(Departures(left))),
            ..FanoutConfig::default()
        },
        metrics: metrics.clone(),
    };
    tokio::spawn(accept_subscribers(ep, downstream, accepting));
    (addr, departures)
}

/// Connects as actor `a1` on an endpoint of its own, subscribes, and pings: the first answer
/// says whether the subscription is served (`Pong`) or refused.
async fn subscribe(a1: &Credentials, addr: SocketAddr, nonce: u64) -> (Upstream, UpstreamEvent) {
    let ep = client_endpoint(a1, LOOPBACK.parse().expect("addr"), &LinkProfile::LAN)
        .expect("client endpoint");
    let config = client_config(a1, &LinkProfile::LAN).expect("client config");
    let hello = Message::Hello {
        protocol: PROTOCOL_VERSION,
        role: MsgRole::Actor,
        name: "a1".into(),
        region: "eu".into(),
        model_id: "m".into(),
        active: None,
        link: None,
    };
    let mut up = Upstream::connect(&ep, config, addr, Role::Hub, "hub", &hello)
        .await
        .expect("admitted");
    up.subscribe(0).await.expect("subscribe");
    up.send(&Message::Ping { nonce }).await.expect("ping");
    let first = tokio::time::timeout(T, up.next_event())
        .await
        .expect("an answer in time")
        .expect("an event");
    (up, first)
}

fn served(ev: &UpstreamEvent, nonce: u64) -> bool {
    matches!(ev, UpstreamEvent::Pong(n) if *n == nonce)
}

#[tokio::test]
async fn a_certificate_over_its_subscription_bound_is_refused_until_one_ends() {
    let d = tempfile::tempdir().expect("tempdir");
    let (hub, a1) = common::hub_and_actor(d.path());
    let accepting = CancellationToken::new();
    let metrics = Metrics::new(Component::Relay);
    let (addr, mut departures) = spawn_server(&hub, accepting.clone(), &metrics);

    let mut held = Vec::new();
    for nonce in 0..K as u64 {
        let (up, ev) = subscribe(&a1, addr, nonce).await;
        assert!(
            served(&ev, nonce),
            "subscription {nonce} within the bound: {ev:?}"
        );
        held.push(up);
    }

    // One more with the same certificate: refused by name, with the bound, and closed.
    let (mut over, ev) = subscribe(&a1, addr, 10).await;
    match ev {
        UpstreamEvent::Refused { reason, detail } => {
            assert_eq!(reason, RefuseReason::TooManyConnections);
            assert!(
                detail.contains(&format!("a1 already holds {K} subscription connections")),
                "{detail}"
            );
        }
        other => panic!("subscription over the bound: expected a refusal, got {other:?}"),
    }
    let end = tokio::time::timeout(T, over.next_event())
        .await
        .expect("the refused connection ends in time");
    assert!(
        matches!(end, Some(UpstreamEvent::Closed(_)) | None),
        "after the refusal: {end:?}"
    );
    // Counted once the server is done with the refused connection.
    let counted = async {
        while !metrics
            .encode_prometheus()
            .contains("starling_relay_subscriptions_refused_total 1\n")
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(T, counted)
        .await
        .expect("the refusal counted in time");

    // One of the served ones leaves: its place is free once the server saw it end.
    held.remove(0).close();
    let gone = tokio::time::timeout(T, departures.recv())
        .await
        .expect("the departure seen in time");
    assert_eq!(gone.as_deref(), Some("a1"));
    let (again, ev) = subscribe(&a1, addr, 20).await;
    assert!(served(&ev, 20), "subscription after one ended: {ev:?}");

    again.close();
    for up in held {
        up.close();
    }
    accepting.cancel();
}

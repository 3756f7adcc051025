//! The subscriptions one certificate may hold on a server, over real QUIC on loopback: the
//! accept loop a relay runs serves up to its bound, refuses the next one by name, and takes a
//! new one once an earlier one ended; and a receiver (the receiving core run by
//! `drive::run` over a real `Feed`) refused for connections by its relay waits for a place
//! there instead of subscribing to its fallback.

mod common;
#[path = "common/receiver.rs"]
mod receiver;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use starling_proto::delta::anchor::AnchorSeal;
use starling_proto::protocol::msg::{Message, RefuseReason, Role as MsgRole};
use starling_telemetry::{Component, Metrics};
use starling_transport::book::VersionBook;
use starling_transport::connections::ConnectionCap;
use starling_transport::downstream::{Downstream, accept_subscribers};
use starling_transport::drive::{self, Shell};
use starling_transport::endpoint::{client_config, client_endpoint, server_endpoint};
use starling_transport::fanout::{FanoutConfig, SubscriberObserver};
use starling_transport::follow::{GaveUp, Notice};
use starling_transport::framed::{DataStreamReader, StreamFrame};
use starling_transport::identity::{Credentials, Role};
use starling_transport::link::LinkProfile;
use starling_transport::upstream::{Feed, SourceAddr, Upstream, UpstreamError, UpstreamEvent};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

const LOOPBACK: &str = "127.0.0.1:0";
/// The bound under test.
const K: usize = 2;
const T: Duration = Duration::from_secs(10);

/// What a server's accept loop told about a subscriber.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Seen {
    /// Its subscription was admitted and is served.
    Subscribed(String),
    /// Its subscription ended.
    Left(String),
}

/// Tells the test each time a subscriber's subscription was admitted or ended.
#[derive(Debug)]
struct Departures(mpsc::UnboundedSender<Seen>);

impl SubscriberObserver for Departures {
    fn subscribed(&self, peer: &str, _after: u64) {
        let _ = self.0.send(Seen::Subscribed(peer.to_owned()));
    }

    fn left(&self, peer: &str) {
        let _ = self.0.send(Seen::Left(peer.to_owned()));
    }
}

/// The next time `seen` tells of `what`, within [`T`].
async fn next_seen(seen: &mut mpsc::UnboundedReceiver<Seen>, what: Seen) {
    let found = async {
        while let Some(s) = seen.recv().await {
            if s == what {
                return;
            }
        }
        panic!("the server stopped before {what:?}");
    };
    tokio::time::timeout(T, found)
        .await
        .unwrap_or_else(|_| panic!("{what:?} in time"));
}

/// Waits until the server counted `n` refused subscriptions.
async fn refused(metrics: &Metrics, n: u64) {
    let line = format!("starling_relay_subscriptions_refused_total {n}\n");
    let counted = async {
        while !metrics.encode_prometheus().contains(&line) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(T, counted)
        .await
        .unwrap_or_else(|_| panic!("{n} refusals counted in time"));
}

/// A server running the relays' accept loop with at most [`K`] subscriptions per certificate.
fn spawn_server(
    creds: &Credentials,
    accepting: CancellationToken,
    metrics: &Metrics,
) -> (SocketAddr, mpsc::UnboundedReceiver<Seen>) {
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
    let mut up = Upstream::connect(&ep, config, addr, Role::Hub, "hub", &receiver::hello())
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
    refused(&metrics, 1).await;

    // One of the served ones leaves: its place is free once the server saw it end.
    held.remove(0).close();
    next_seen(&mut departures, Seen::Left("a1".into())).await;
    let (again, ev) = subscribe(&a1, addr, 20).await;
    assert!(served(&ev, 20), "subscription after one ended: {ev:?}");

    again.close();
    for up in held {
        up.close();
    }
    accepting.cancel();
}

/// A receiving shell that stages and activates nothing it is not given (no version is
/// published here) and tells the test where it subscribed.
#[derive(Debug)]
struct Subscriptions(mpsc::UnboundedSender<SocketAddr>);

impl Shell for Subscriptions {
    type Error = GaveUp;
    type Done = ();

    fn hello(&self) -> Message {
        receiver::hello()
    }
    fn begin(&mut self, _version: u64, _base: u64, _delta_id: [u8; 32]) -> bool {
        true
    }
    fn stage(&mut self, _version: u64, _frame: StreamFrame) -> bool {
        true
    }
    fn discard(&mut self, _version: u64) {}
    async fn activate(
        &mut self,
        _feed: &mut Feed,
        _version: u64,
        _started: Instant,
    ) -> Result<Option<bool>, GaveUp> {
        Ok(Some(true))
    }
    async fn background(&mut self) {
        std::future::pending().await
    }
    async fn finish(&mut self, _feed: &mut Feed, _done: ()) -> (u64, bool) {
        (0, false)
    }
    async fn restore(&mut self, _seal: AnchorSeal, _stream: DataStreamReader) -> bool {
        false
    }
    fn subscribed(&mut self, source: &SourceAddr, _after: u64) {
        let _ = self.0.send(source.addr);
    }
    fn left(&mut self, _source: &SourceAddr) {}
    fn not_reached(&mut self, _error: UpstreamError) -> Result<(), GaveUp> {
        Ok(())
    }
    fn notice(&mut self, _notice: Notice, _source: Option<&SourceAddr>) -> Result<(), GaveUp> {
        Ok(())
    }
}

/// An actor restarted twice within the idle timeout: its relay still counts the two
/// connections of its earlier incarnations, and refuses its subscription for connections.
/// The actor asks the relay again after a pause instead of subscribing to its fallback (the
/// hub, which would send every version over the WAN once more), and is served by the relay
/// once one of the old connections ended.
#[tokio::test]
async fn a_receiver_refused_for_connections_waits_for_its_relay_not_the_fallback() {
    let d = tempfile::tempdir().expect("tempdir");
    let (hub, a1) = common::hub_and_actor(d.path());
    let accepting = CancellationToken::new();
    let relay_metrics = Metrics::new(Component::Relay);
    let (relay, mut at_relay) = spawn_server(&hub, accepting.clone(), &relay_metrics);
    let fallback_metrics = Metrics::new(Component::Relay);
    let (fallback, mut at_fallback) = spawn_server(&hub, accepting.clone(), &fallback_metrics);

    // The earlier incarnations' connections, as the relay sees them: live.
    let mut held = Vec::new();
    for nonce in 0..K as u64 {
        let (up, ev) = subscribe(&a1, relay, nonce).await;
        assert!(served(&ev, nonce), "old connection {nonce}: {ev:?}");
        next_seen(&mut at_relay, Seen::Subscribed("a1".into())).await;
        held.push(up);
    }

    // The new incarnation: the receiving core over a real feed, the relay first.
    let (mut feed, mut core) = receiver::receiver(&a1, &[relay, fallback]);
    let (tx, mut subscriptions) = mpsc::unbounded_channel();
    let mut shell = Subscriptions(tx);
    let stop = CancellationToken::new();
    let stopping = stop.clone();
    let receiver =
        tokio::spawn(async move { drive::run(&mut core, &mut feed, &mut shell, &stopping).await });

    // Refused: the relay counts it, and the fallback hears nothing.
    refused(&relay_metrics, 1).await;
    let first = subscriptions
        .try_recv()
        .expect("the refused subscription was sent");
    assert_eq!(first, relay);

    // One old connection ends: the relay has a place, and the receiver takes it.
    held.remove(0).close();
    next_seen(&mut at_relay, Seen::Left("a1".into())).await;
    next_seen(&mut at_relay, Seen::Subscribed("a1".into())).await;

    let mut sent_to = vec![first];
    while let Ok(addr) = subscriptions.try_recv() {
        sent_to.push(addr);
    }
    assert!(
        sent_to.iter().all(|&a| a == relay),
        "subscribed to the relay only: {sent_to:?} (relay {relay}, fallback {fallback})"
    );
    assert!(
        at_fallback.try_recv().is_err(),
        "the fallback served no subscription"
    );
    assert!(
        !fallback_metrics
            .encode_prometheus()
            .contains("starling_relay_subscriptions_refused_total 1"),
        "nor refused one"
    );

    stop.cancel();
    tokio::time::timeout(T, receiver)
        .await
        .expect("the receiver stops in time")
        .expect("the receiver's task")
        .expect("the receiver stops without giving up");
    for up in held {
        up.close();
    }
    accepting.cancel();
}

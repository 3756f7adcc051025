//! Mutual TLS over real QUIC sockets on loopback: who gets in, who is refused, and when.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use quinn::crypto::rustls::QuicClientConfig;
use rustls::pki_types::pem::PemObject;
use starling_proto::protocol::msg::{
    MIN_PEER_PROTOCOL, Message, PROTOCOL_VERSION, RefuseReason, Role as MsgRole,
};
use starling_transport::admit::admit;
use starling_transport::endpoint::{
    EndpointError, client_endpoint, connect, server_endpoint, verify_peer,
};
use starling_transport::framed::{MessageReader, send};
use starling_transport::identity::{Credentials, Role, init_cluster, issue};
use starling_transport::link::LinkProfile;

const LOOPBACK: &str = "127.0.0.1:0";

fn cluster(dir: &Path, name: &str) -> Credentials {
    init_cluster(dir, name, [7; 32]).expect("init");
    Credentials::load_hub(dir).expect("hub creds")
}

/// A hub that answers each connection's first Hello: Welcome if the certificate proves the
/// claimed identity, Refuse(NotAuthorized) otherwise. Returns its address.
fn spawn_hub(creds: &Credentials) -> (SocketAddr, quinn::Endpoint) {
    let ep =
        server_endpoint(creds, LOOPBACK.parse().expect("addr"), &LinkProfile::LAN).expect("server");
    let addr = ep.local_addr().expect("local addr");
    let server = ep.clone();
    tokio::spawn(async move {
        while let Some(incoming) = server.accept().await {
            tokio::spawn(async move {
                let Ok(conn) = incoming.await else { return };
                let Ok((mut tx, rx)) = conn.accept_bi().await else {
                    return;
                };
                let mut reader = MessageReader::new(rx);
                let Ok(Some(Message::Hello { role, name, .. })) = reader.next().await else {
                    return;
                };
                let role = match role {
                    MsgRole::Relay => Role::Relay,
                    MsgRole::Actor => Role::Actor,
                    MsgRole::Trainer => Role::Hub,
                };
                let reply = match verify_peer(&conn, role, &name) {
                    Ok(()) => Message::Welcome { latest_version: 41 },
                    Err(e) => Message::Refuse {
                        reason: RefuseReason::NotAuthorized,
                        detail: e.to_string(),
                    },
                };
                let _ = send(&mut tx, &reply).await;
                let _ = tx.finish();
                // Keep the connection open until the client closes it.
                let _ = conn.closed().await;
            });
        }
    });
    (addr, ep)
}

/// A hub that runs the real admission on each connection and reports, for each peer it
/// admitted, the protocol version admission says it speaks.
/// Admission failures come back as their error's text, and the connection is closed as the
/// hub closes it.
fn spawn_admitting_hub(
    creds: &Credentials,
) -> (
    SocketAddr,
    quinn::Endpoint,
    tokio::sync::mpsc::UnboundedReceiver<Result<u16, String>>,
) {
    let ep =
        server_endpoint(creds, LOOPBACK.parse().expect("addr"), &LinkProfile::LAN).expect("server");
    let addr = ep.local_addr().expect("local addr");
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let server = ep.clone();
    tokio::spawn(async move {
        while let Some(incoming) = server.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let Ok(conn) = incoming.await else { return };
                match admit(&conn, "hub", "m", &[MsgRole::Actor], 41).await {
                    Ok(Some(a)) => {
                        let _ = tx.send(Ok(a.protocol));
                    }
                    Ok(None) => {}
                    Err(e) => {
                        let _ = tx.send(Err(starling_process::error_chain(&e)));
                        conn.close(1u32.into(), b"error");
                    }
                }
                let _ = conn.closed().await;
            });
        }
    });
    (addr, ep, rx)
}

fn hello(name: &str) -> Message {
    hello_in(name, PROTOCOL_VERSION)
}

fn hello_in(name: &str, protocol: u16) -> Message {
    Message::Hello {
        protocol,
        role: MsgRole::Actor,
        name: name.into(),
        region: "eu".into(),
        model_id: "m".into(),
        active: None,
        link: None,
    }
}

async fn say_hello(
    creds: &Credentials,
    addr: SocketAddr,
    claimed: &str,
) -> Result<Message, String> {
    say(creds, addr, hello(claimed)).await
}

async fn say(creds: &Credentials, addr: SocketAddr, hello: Message) -> Result<Message, String> {
    let ep = client_endpoint(creds, LOOPBACK.parse().expect("addr"), &LinkProfile::LAN)
        .map_err(|e| e.to_string())?;
    let conn = connect(&ep, addr, Role::Hub, "hub")
        .await
        .map_err(|e| e.to_string())?;
    let (mut tx, rx) = conn.open_bi().await.map_err(|e| e.to_string())?;
    send(&mut tx, &hello).await.map_err(|e| e.to_string())?;
    let reply = MessageReader::new(rx)
        .next()
        .await
        .map_err(|e| e.to_string())?;
    conn.close(0u32.into(), b"done");
    ep.wait_idle().await;
    reply.ok_or_else(|| "no reply".to_string())
}

#[tokio::test]
async fn only_cluster_members_get_in_and_only_as_themselves() {
    let d = tempfile::tempdir().expect("tempdir");
    let hub = cluster(&d.path().join("cluster"), "test");
    issue(
        &d.path().join("cluster"),
        Role::Actor,
        "a1",
        &d.path().join("a1"),
    )
    .expect("issue a1");
    issue(
        &d.path().join("cluster"),
        Role::Relay,
        "r1",
        &d.path().join("r1"),
    )
    .expect("issue r1");
    let a1 = Credentials::load_peer(&d.path().join("a1")).expect("a1 creds");
    assert_eq!((a1.role, a1.name.as_str()), (Role::Actor, "a1"));
    let (addr, _server) = spawn_hub(&hub);

    let t = Duration::from_secs(20);
    // A member, as itself: welcomed.
    let r = tokio::time::timeout(t, say_hello(&a1, addr, "a1"))
        .await
        .expect("in time");
    assert_eq!(r, Ok(Message::Welcome { latest_version: 41 }));
    // A member claiming to be another actor: refused with a reason.
    let r = tokio::time::timeout(t, say_hello(&a1, addr, "a2"))
        .await
        .expect("in time");
    assert!(
        matches!(
            r,
            Ok(Message::Refuse {
                reason: RefuseReason::NotAuthorized,
                ..
            })
        ),
        "{r:?}"
    );

    // The same name in other letter case: DNS names match case-insensitively, identities do
    // not. Admitted, `A1` would become a second ledger actor with a1's certificate.
    {
        let claimed = "A1";
        let r = tokio::time::timeout(t, say_hello(&a1, addr, claimed))
            .await
            .expect("in time");
        assert!(
            matches!(
                &r,
                Ok(Message::Refuse {
                    reason: RefuseReason::NotAuthorized,
                    detail,
                }) if detail.contains("byte for byte")
            ),
            "a1's certificate claimed as {claimed:?}: {r:?}"
        );
    }

    // Credentials of another cluster: the handshake itself fails.
    let other = d.path().join("other");
    cluster(&other, "other");
    issue(&other, Role::Actor, "a1", &d.path().join("other-a1")).expect("issue");
    let foreign = Credentials::load_peer(&d.path().join("other-a1")).expect("creds");
    let r = tokio::time::timeout(t, say_hello(&foreign, addr, "a1"))
        .await
        .expect("in time");
    assert!(
        r.as_ref()
            .is_err_and(|e| e.contains("do not belong to the same cluster")),
        "foreign credentials must fail the handshake, saying why: {r:?}"
    );

    // No client certificate at all: refused during the handshake.
    let ep =
        client_endpoint(&a1, LOOPBACK.parse().expect("addr"), &LinkProfile::LAN).expect("endpoint");
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls::pki_types::CertificateDer::pem_slice_iter(a1.ca_pem.as_bytes()) {
        roots.add(c.expect("ca")).expect("add");
    }
    let mut tls = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    tls.alpn_protocols = vec![starling_transport::ALPN.to_vec()];
    let cfg =
        quinn::ClientConfig::new(Arc::new(QuicClientConfig::try_from(tls).expect("quic tls")));
    let r = tokio::time::timeout(t, async {
        let conn = ep
            .connect_with(cfg, addr, "hub.starling")
            .map_err(|e| e.to_string())?
            .await
            .map_err(|e| e.to_string())?;
        let (mut tx, rx) = conn.open_bi().await.map_err(|e| e.to_string())?;
        send(&mut tx, &hello("a1"))
            .await
            .map_err(|e| e.to_string())?;
        MessageReader::new(rx)
            .next()
            .await
            .map_err(|e| e.to_string())
    })
    .await
    .expect("in time");
    assert!(
        !matches!(r, Ok(Some(Message::Welcome { .. }))),
        "a client without a certificate was welcomed: {r:?}"
    );

    // The client checks the server too: a relay is not the hub.
    let relay = Credentials::load_peer(&d.path().join("r1")).expect("r1 creds");
    let relay_ep = server_endpoint(&relay, LOOPBACK.parse().expect("addr"), &LinkProfile::LAN)
        .expect("relay server");
    let relay_addr = relay_ep.local_addr().expect("addr");
    let accepting = relay_ep.clone();
    tokio::spawn(async move {
        while let Some(incoming) = accepting.accept().await {
            if let Ok(conn) = incoming.await {
                tokio::spawn(async move { conn.closed().await });
            }
        }
    });
    let client =
        client_endpoint(&a1, LOOPBACK.parse().expect("addr"), &LinkProfile::LAN).expect("endpoint");
    let r = tokio::time::timeout(t, connect(&client, relay_addr, Role::Hub, "hub"))
        .await
        .expect("in time");
    assert!(matches!(r, Err(EndpointError::Connect { .. })), "{r:?}");
    let r = tokio::time::timeout(t, connect(&client, relay_addr, Role::Relay, "r1"))
        .await
        .expect("in time");
    assert!(r.is_ok(), "{r:?}");
}

/// A hub admits clients of its own protocol version and older ones down to
/// `MIN_PEER_PROTOCOL` (so a deployment upgrades the hub first, then relays and actors), and
/// refuses any other version at `Hello`, naming both and which side to upgrade.
#[tokio::test]
async fn admission_takes_older_clients_down_to_the_floor_and_no_others() {
    let d = tempfile::tempdir().expect("tempdir");
    let (hub, a1) = common::hub_and_actor(d.path());
    let (addr, _server, mut admitted) = spawn_admitting_hub(&hub);
    let t = Duration::from_secs(20);
    const { assert!(MIN_PEER_PROTOCOL < PROTOCOL_VERSION) };

    for protocol in MIN_PEER_PROTOCOL..=PROTOCOL_VERSION {
        let r = tokio::time::timeout(t, say(&a1, addr, hello_in("a1", protocol)))
            .await
            .expect("in time");
        assert_eq!(r, Ok(Message::Welcome { latest_version: 41 }), "{protocol}");
        let seen = tokio::time::timeout(t, admitted.recv())
            .await
            .expect("in time");
        assert_eq!(
            seen,
            Some(Ok(protocol)),
            "admission reports what the peer speaks"
        );
    }
    for (protocol, advice) in [
        (MIN_PEER_PROTOCOL - 1, "upgrade this peer"),
        (PROTOCOL_VERSION + 1, "upgrade hub first"),
    ] {
        let r = tokio::time::timeout(t, say(&a1, addr, hello_in("a1", protocol)))
            .await
            .expect("in time");
        let Ok(Message::Refuse {
            reason: RefuseReason::ProtocolVersion,
            detail,
        }) = &r
        else {
            panic!("protocol {protocol} must be refused for its version: {r:?}");
        };
        for said in [
            format!("speaks protocol {PROTOCOL_VERSION}"),
            format!("this peer speaks {protocol}"),
            advice.to_string(),
        ] {
            assert!(detail.contains(&said), "{detail:?} lacks {said:?}");
        }
    }
    assert!(admitted.try_recv().is_err(), "a refused peer was admitted");
}

/// Before a peer is admitted, what it can hold open is bounded: a `Hello` over the
/// pre-admission limit ends the connection once that much is read, and a peer that says
/// nothing is closed after the Hello timeout.
#[tokio::test]
async fn a_peer_not_yet_admitted_holds_little_for_little_time() {
    use starling_transport::admit::{HELLO_LIMIT, HELLO_TIMEOUT};
    let d = tempfile::tempdir().expect("tempdir");
    let (hub, a1) = common::hub_and_actor(d.path());
    let (addr, _server, mut admitted) = spawn_admitting_hub(&hub);
    let client =
        client_endpoint(&a1, LOOPBACK.parse().expect("addr"), &LinkProfile::LAN).expect("client");

    // Silent: opens nothing.
    let silent = connect(&client, addr, Role::Hub, "hub")
        .await
        .expect("connect");
    // Oversized: a Hello's type byte, a declared body of 8 MiB (within the protocol's limit,
    // far over the pre-admission one), then 1 MiB of it.
    let big = connect(&client, addr, Role::Hub, "hub")
        .await
        .expect("connect");
    let (mut tx, _rx) = big.open_bi().await.expect("stream");
    let mut hello = Vec::new();
    hello_in("a1", PROTOCOL_VERSION).encode(&mut hello);
    let mut raw = vec![hello[0]];
    let mut n = 8u64 << 20;
    while n >= 0x80 {
        raw.push((n as u8) | 0x80);
        n >>= 7;
    }
    raw.push(n as u8);
    raw.extend(std::iter::repeat_n(0u8, 1 << 20));
    let writer = tokio::spawn(async move {
        let _ = tx.write_all(&raw).await;
        tx
    });

    let t0 = std::time::Instant::now();
    let mut errors = Vec::new();
    while errors.len() < 2 {
        let got = tokio::time::timeout(HELLO_TIMEOUT * 3, admitted.recv())
            .await
            .expect("both peers are let go in time")
            .expect("the hub runs");
        errors.push(got.expect_err("neither peer is admitted"));
    }
    assert!(
        errors
            .iter()
            .any(|e| e.contains("buffered message") && e.contains(&HELLO_LIMIT.to_string())),
        "{errors:?}"
    );
    assert!(
        errors.iter().any(|e| e.contains("no Hello within")),
        "{errors:?}"
    );
    assert!(t0.elapsed() >= HELLO_TIMEOUT - Duration::from_secs(1));
    for conn in [silent, big] {
        tokio::time::timeout(Duration::from_secs(5), conn.closed())
            .await
            .expect("the hub closed the connection");
    }
    writer.abort();
}

#[test]
fn identity_files_are_refused_when_wrong() {
    let d = tempfile::tempdir().expect("tempdir");
    let c = d.path().join("c");
    init_cluster(&c, "prod-1", [1; 32]).expect("init");
    // A second init would overwrite the CA: refused.
    assert!(init_cluster(&c, "prod-1", [1; 32]).is_err());
    // Names must be DNS labels; the hub role is not issued.
    assert!(issue(&c, Role::Actor, "Bad_Name", &d.path().join("x")).is_err());
    assert!(issue(&c, Role::Hub, "h", &d.path().join("x")).is_err());
    assert!(
        issue(
            &d.path().join("nope"),
            Role::Actor,
            "a",
            &d.path().join("x")
        )
        .is_err()
    );
    // Secrets are private to their owner.
    use std::os::unix::fs::PermissionsExt;
    for f in ["ca.key", "hub.key", "signing.key"] {
        let mode = std::fs::metadata(c.join(f))
            .expect("stat")
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o600, "{f}");
    }
}

#[test]
fn trainer_tokens_are_checked_without_being_stored() {
    let d = tempfile::tempdir().expect("tempdir");
    let c = d.path().join("c");
    init_cluster(&c, "prod-1", [7; 32]).expect("init");
    let out = d.path().join("t1");
    issue(&c, Role::Trainer, "t1", &out).expect("issue trainer");
    let token = starling_transport::identity::load_trainer_token(&out).expect("token file");
    let seed = starling_transport::identity::hub_signing_seed(&c).expect("seed");
    use starling_transport::identity::verify_trainer_token as verify;
    assert_eq!(verify(&seed, &token).as_deref(), Some("t1"));
    // Another cluster's key, another name, a flipped character, garbage: refused.
    assert_eq!(verify(&[8; 32], &token), None);
    assert_eq!(verify(&seed, &token.replacen("t1", "t2", 1)), None);
    let mut flipped = token.clone().into_bytes();
    let last = flipped.len() - 1;
    flipped[last] = if flipped[last] == b'0' { b'1' } else { b'0' };
    assert_eq!(
        verify(&seed, &String::from_utf8(flipped).expect("ascii")),
        None
    );
    assert_eq!(verify(&seed, "trainer.t1."), None);
    assert_eq!(verify(&seed, ""), None);
    // The token is a secret.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(out.join("token"))
        .expect("stat")
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600);
    // And the certificate carries the trainer role.
    let creds = starling_transport::identity::Credentials::load_peer(&out).expect("load");
    assert_eq!((creds.role, creds.name.as_str()), (Role::Trainer, "t1"));
}

//! QUIC endpoints with mutual TLS against the cluster CA.
//!
//! Both sides present certificates issued by the cluster CA and verify the other's: a client
//! without credentials, or with credentials of another cluster, fails the handshake and never
//! gets to open a stream. After the handshake a server knows *that* the peer belongs to the
//! cluster; [`verify_peer`] then proves the role and name the peer claims (its certificate
//! must carry exactly that identity), before it may subscribe, claim or submit.

use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{ClientConfig, Connection, Endpoint, EndpointConfig, ServerConfig, TokioRuntime};
use rustls::RootCertStore;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use thiserror::Error;

use crate::ALPN;
use crate::ceiling::RateCeiling;
use crate::identity::{Credentials, Role, peer_dns_name};
use crate::link::LinkProfile;

/// UDP socket buffers: default buffers lost ~30% of UDP at 1 Gbit/s on these machines.
const SOCKET_BUFFER: usize = 4 << 20;

/// Why an endpoint could not be set up or a peer was refused.
#[derive(Debug, Error)]
pub enum EndpointError {
    #[error("invalid {what} PEM: {detail}")]
    Pem { what: &'static str, detail: String },
    #[error("TLS configuration")]
    Tls(#[from] rustls::Error),
    #[error("TLS client verifier: {0}")]
    Verifier(String),
    #[error("QUIC configuration: {0}")]
    Quic(String),
    #[error("socket {addr}")]
    Socket {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("connect to {addr}: {detail}")]
    Connect { addr: SocketAddr, detail: String },
    /// The TLS handshake failed because the two sides' credentials come from different cluster
    /// CAs. Retrying cannot help.
    #[error(
        "the peer at {addr} and these credentials do not belong to the same cluster ({detail}): \
         use credentials issued by this hub's cluster (`starling-hub issue --dir CLUSTER`)"
    )]
    ForeignCluster { addr: SocketAddr, detail: String },
    #[error("peer presented no certificate")]
    NoPeerCertificate,
    #[error("peer certificate does not prove identity {claimed}: {detail}")]
    WrongIdentity { claimed: String, detail: String },
}

fn pem_err(what: &'static str) -> impl Fn(rustls::pki_types::pem::Error) -> EndpointError {
    move |e| EndpointError::Pem {
        what,
        detail: e.to_string(),
    }
}

struct TlsParts {
    roots: Arc<RootCertStore>,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
}

fn tls_parts(c: &Credentials) -> Result<TlsParts, EndpointError> {
    let mut roots = RootCertStore::empty();
    for ca in CertificateDer::pem_slice_iter(c.ca_pem.as_bytes()) {
        roots.add(ca.map_err(pem_err("CA certificate"))?)?;
    }
    if roots.is_empty() {
        return Err(EndpointError::Pem {
            what: "CA certificate",
            detail: "no certificate found".into(),
        });
    }
    let chain = CertificateDer::pem_slice_iter(c.cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(pem_err("certificate"))?;
    let key =
        PrivateKeyDer::from_pem_slice(c.key_pem.as_bytes()).map_err(pem_err("private key"))?;
    Ok(TlsParts {
        roots: Arc::new(roots),
        chain,
        key,
    })
}

/// Server configuration: our certificate, and client certificates required from the CA.
pub fn server_config(c: &Credentials, link: &LinkProfile) -> Result<ServerConfig, EndpointError> {
    let p = tls_parts(c)?;
    let verifier = WebPkiClientVerifier::builder(p.roots)
        .build()
        .map_err(|e| EndpointError::Verifier(e.to_string()))?;
    let mut tls = rustls::ServerConfig::builder()
        .with_client_cert_verifier(verifier)
        .with_single_cert(p.chain, p.key)?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let crypto = QuicServerConfig::try_from(tls).map_err(|e| EndpointError::Quic(e.to_string()))?;
    let mut cfg = ServerConfig::with_crypto(Arc::new(crypto));
    cfg.transport_config(Arc::new(link.transport_config()));
    Ok(cfg)
}

/// Accepts `incoming` with a congestion controller of its own whose window cap is the
/// returned handle: set it once the peer is known (`crate::ceiling`). `base` is the server
/// configuration the endpoint was made with.
pub fn accept_capped(
    incoming: quinn::Incoming,
    base: &ServerConfig,
    link: &LinkProfile,
) -> Result<(quinn::Connecting, RateCeiling), quinn::ConnectionError> {
    let ceiling = RateCeiling::none();
    let mut cfg = base.clone();
    cfg.transport_config(Arc::new(link.transport_config_capped(ceiling.clone())));
    Ok((incoming.accept_with(Arc::new(cfg))?, ceiling))
}

/// Client configuration: the CA as the only root, our certificate for client auth.
pub fn client_config(c: &Credentials, link: &LinkProfile) -> Result<ClientConfig, EndpointError> {
    let p = tls_parts(c)?;
    let mut tls = rustls::ClientConfig::builder()
        .with_root_certificates(p.roots)
        .with_client_auth_cert(p.chain, p.key)?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let crypto = QuicClientConfig::try_from(tls).map_err(|e| EndpointError::Quic(e.to_string()))?;
    let mut cfg = ClientConfig::new(Arc::new(crypto));
    cfg.transport_config(Arc::new(link.transport_config()));
    Ok(cfg)
}

/// A UDP socket with buffers large enough for the link rates Starling targets.
fn socket(addr: SocketAddr) -> Result<UdpSocket, EndpointError> {
    let err = |source| EndpointError::Socket { addr, source };
    let domain = if addr.is_ipv4() {
        socket2::Domain::IPV4
    } else {
        socket2::Domain::IPV6
    };
    let s = socket2::Socket::new(domain, socket2::Type::DGRAM, Some(socket2::Protocol::UDP))
        .map_err(err)?;
    // Best effort: the kernel caps these at rmem_max/wmem_max; a smaller buffer still works.
    let _ = s.set_recv_buffer_size(SOCKET_BUFFER);
    let _ = s.set_send_buffer_size(SOCKET_BUFFER);
    s.bind(&addr.into()).map_err(err)?;
    Ok(s.into())
}

/// A server endpoint listening on `addr` (port 0 picks one: see `Endpoint::local_addr`).
/// Must be called inside a tokio runtime.
pub fn server_endpoint(
    c: &Credentials,
    addr: SocketAddr,
    link: &LinkProfile,
) -> Result<Endpoint, EndpointError> {
    Endpoint::new(
        EndpointConfig::default(),
        Some(server_config(c, link)?),
        socket(addr)?,
        Arc::new(TokioRuntime),
    )
    .map_err(|source| EndpointError::Socket { addr, source })
}

/// A client endpoint bound to `bind` (e.g. `127.0.0.1:0`). Must be called inside a tokio runtime.
pub fn client_endpoint(
    c: &Credentials,
    bind: SocketAddr,
    link: &LinkProfile,
) -> Result<Endpoint, EndpointError> {
    let mut e = Endpoint::new(
        EndpointConfig::default(),
        None,
        socket(bind)?,
        Arc::new(TokioRuntime),
    )
    .map_err(|source| EndpointError::Socket { addr: bind, source })?;
    e.set_default_client_config(client_config(c, link)?);
    Ok(e)
}

/// Connects to the server of (`role`, `name`) at `addr` and completes the handshake; the
/// server's certificate must prove that identity. Uses the endpoint's default client
/// configuration.
pub async fn connect(
    endpoint: &Endpoint,
    addr: SocketAddr,
    role: Role,
    name: &str,
) -> Result<Connection, EndpointError> {
    handshake(endpoint.connect(addr, &peer_dns_name(role, name)), addr).await
}

/// [`connect`] with `config` (the transport parameters of the link to this server), so one
/// endpoint serves connections over links of different profiles.
pub async fn connect_with(
    endpoint: &Endpoint,
    config: ClientConfig,
    addr: SocketAddr,
    role: Role,
    name: &str,
) -> Result<Connection, EndpointError> {
    handshake(
        endpoint.connect_with(config, addr, &peer_dns_name(role, name)),
        addr,
    )
    .await
}

async fn handshake(
    connecting: Result<quinn::Connecting, quinn::ConnectError>,
    addr: SocketAddr,
) -> Result<Connection, EndpointError> {
    let connecting = connecting.map_err(|e| EndpointError::Connect {
        addr,
        detail: e.to_string(),
    })?;
    connecting.await.map_err(|e| {
        let detail = e.to_string();
        if is_certificate_failure(&e) {
            EndpointError::ForeignCluster { addr, detail }
        } else {
            EndpointError::Connect { addr, detail }
        }
    })
}

/// Whether a socket bound to `local` can reach `remote`: same address family, and either bound
/// to every address or to the very address the host's routing picks as the source towards
/// `remote`. A socket bound to one interface's address is not: a relay listening on its
/// region's LAN address (or its loopback) would send to the hub with a source address the hub
/// cannot answer, and reaches it from a socket of its own. The route is looked up by
/// connecting an unbound UDP socket, which sends nothing.
pub fn can_reach(local: SocketAddr, remote: SocketAddr) -> bool {
    if local.is_ipv4() != remote.is_ipv4() {
        return false;
    }
    if local.ip().is_unspecified() {
        return true;
    }
    std::net::UdpSocket::bind(any_addr_for(remote))
        .and_then(|probe| {
            probe.connect(remote)?;
            probe.local_addr()
        })
        .is_ok_and(|source| source.ip() == local.ip())
}

/// The address a client endpoint binds to reach `remote`: any address, any port.
pub fn any_addr_for(remote: SocketAddr) -> SocketAddr {
    if remote.is_ipv4() {
        SocketAddr::from(([0, 0, 0, 0], 0))
    } else {
        SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, 0))
    }
}

/// Whether a handshake failed because the two sides' certificates come from different CAs, on
/// either side: a TLS alert (QUIC crypto error 0x100 + alert) of unknown CA (48), or of a
/// signature that does not verify (51: a certificate of another CA with the same issuer name).
/// A certificate of this cluster for another name (42) is not that: the address is wrong.
fn is_certificate_failure(e: &quinn::ConnectionError) -> bool {
    let code = match e {
        quinn::ConnectionError::TransportError(t) => u64::from(t.code),
        quinn::ConnectionError::ConnectionClosed(c) => u64::from(c.error_code),
        _ => return false,
    };
    code & !0xff == 0x100 && matches!(code & 0xff, 48 | 51)
}

/// Proves that the (already CA-verified) peer of `conn` is (`role`, `name`).
pub fn verify_peer(conn: &Connection, role: Role, name: &str) -> Result<(), EndpointError> {
    let claimed = peer_dns_name(role, name);
    let certs = conn
        .peer_identity()
        .and_then(|i| i.downcast::<Vec<CertificateDer<'static>>>().ok())
        .ok_or(EndpointError::NoPeerCertificate)?;
    let leaf = certs.first().ok_or(EndpointError::NoPeerCertificate)?;
    let wrong = |detail: String| EndpointError::WrongIdentity {
        claimed: claimed.clone(),
        detail,
    };
    let ee = webpki::EndEntityCert::try_from(leaf).map_err(|e| wrong(e.to_string()))?;
    let sn = ServerName::try_from(claimed.as_str()).map_err(|e| wrong(e.to_string()))?;
    ee.verify_is_valid_for_subject_name(&sn)
        .map_err(|e| wrong(e.to_string()))?;
    // DNS names match case-insensitively (RFC 6125), so webpki admits `actor.A1.starling` for
    // a certificate of `actor.a1.starling`. A peer's name is an identity (a ledger actor, a
    // connection limit), not a host name: the certificate must carry exactly the name claimed.
    if ee.valid_dns_names().any(|n| n == claimed) {
        Ok(())
    } else {
        Err(wrong(format!(
            "the certificate names {:?}, not exactly {claimed:?} (names are compared byte for byte)",
            ee.valid_dns_names().collect::<Vec<_>>()
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> SocketAddr {
        s.parse().expect("a socket address")
    }

    #[test]
    fn a_socket_reaches_a_peer_only_from_the_source_address_routing_would_pick() {
        // Bound to every address: whatever the route, within one family.
        assert!(can_reach(addr("0.0.0.0:7444"), addr("127.0.0.1:7443")));
        assert!(!can_reach(addr("0.0.0.0:7444"), addr("[::1]:7443")));
        // The address routing picks towards the peer (127.0.0.1 to itself).
        assert!(can_reach(addr("127.0.0.1:7444"), addr("127.0.0.1:7443")));
        // Another address of a local interface is not it: replies to it would not come back
        // the way the peer's routing sends them (the relay that listened on its LAN address
        // and never reached the hub across the WAN namespace).
        assert!(!can_reach(addr("127.0.0.2:7444"), addr("127.0.0.1:7443")));
        // A loopback socket towards another host.
        assert!(!can_reach(addr("127.0.0.1:7444"), addr("192.0.2.1:7443")));
    }
}

//! Admission: the first exchange on every connection a hub or relay accepts.
//!
//! The peer opens the control stream and says `Hello`. It is admitted only if it speaks a
//! protocol version this build admits (`MIN_PEER_PROTOCOL` to `PROTOCOL_VERSION`), its role is one this server serves, its certificate proves the role and
//! name it claims, and it holds the same model; otherwise it gets a `Refuse` whose reason
//! says what to fix. An admitted peer gets `Welcome` with the newest version here.

use quinn::{Connection, SendStream};
use starling_proto::protocol::msg::{
    MAX_MESSAGE_BODY, MIN_PEER_PROTOCOL, Message, PROTOCOL_VERSION, RefuseReason, Role as MsgRole,
};
use thiserror::Error;

use crate::endpoint::verify_peer;
use crate::framed::{FramedError, MessageReader, send};
use crate::identity::Role;
use crate::link::LinkProfile;

/// An admitted peer: its control stream, and who it is.
#[derive(Debug)]
pub struct Admitted {
    pub control: SendStream,
    pub reader: MessageReader,
    pub role: MsgRole,
    pub name: String,
    /// The protocol version the peer speaks (at most ours): what may be sent to it.
    pub protocol: u16,
    /// The region the peer says it is in.
    pub region: String,
    /// The link the peer says it receives over.
    pub link: Option<LinkProfile>,
}

/// Why admission could not even be attempted.
#[derive(Debug, Error)]
pub enum AdmitError {
    #[error("accept control stream")]
    Accept(#[from] quinn::ConnectionError),
    #[error(transparent)]
    Framed(#[from] FramedError),
    #[error("the first message was not Hello")]
    NoHello,
    #[error("no Hello within {} s of the connection", HELLO_TIMEOUT.as_secs())]
    Timeout,
}

/// A peer says `Hello` within this of its connection, or the connection is closed: what it
/// holds open before it is admitted is bounded in time.
pub const HELLO_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// The largest message read before a peer is admitted (a `Hello` is well under 8 KiB); the
/// limit rises to `MAX_MESSAGE_BODY` once it is.
pub const HELLO_LIMIT: usize = 64 << 10;

/// Runs admission on a freshly accepted connection. `Ok(None)` means the peer was refused
/// (and told why).
pub async fn admit(
    conn: &Connection,
    server: &str,
    model_id: &str,
    serves: &[MsgRole],
    latest: u64,
) -> Result<Option<Admitted>, AdmitError> {
    let hello = tokio::time::timeout(HELLO_TIMEOUT, async {
        let (control, rx) = conn.accept_bi().await?;
        let mut reader = MessageReader::with_limit(rx, HELLO_LIMIT);
        let hello = reader.next().await?;
        Ok::<_, AdmitError>((control, reader, hello))
    })
    .await
    .map_err(|_| AdmitError::Timeout)??;
    let (mut control, mut reader, hello) = hello;
    let Some(Message::Hello {
        protocol,
        role,
        name,
        region,
        model_id: theirs,
        link,
        ..
    }) = hello
    else {
        return Err(AdmitError::NoHello);
    };
    // A trainer proves itself with trainer credentials, or (on the hub's own machine) with
    // the hub's.
    let (cert_role, cert_name) = match role {
        MsgRole::Relay => (Role::Relay, name.as_str()),
        MsgRole::Actor => (Role::Actor, name.as_str()),
        MsgRole::Trainer if name == "hub" => (Role::Hub, "hub"),
        MsgRole::Trainer => (Role::Trainer, name.as_str()),
    };
    let refusal = if !(MIN_PEER_PROTOCOL..=PROTOCOL_VERSION).contains(&protocol) {
        let upgrade = if protocol > PROTOCOL_VERSION {
            format!("upgrade {server} first")
        } else {
            "upgrade this peer".to_string()
        };
        Some((
            RefuseReason::ProtocolVersion,
            format!(
                "{server} speaks protocol {PROTOCOL_VERSION} and admits peers of \
                 {MIN_PEER_PROTOCOL} to {PROTOCOL_VERSION}; this peer speaks {protocol}: {upgrade}"
            ),
        ))
    } else if !serves.contains(&role) {
        Some((
            RefuseReason::NotAuthorized,
            format!("{server} does not serve {role:?}s"),
        ))
    } else if let Err(e) = verify_peer(conn, cert_role, cert_name) {
        Some((
            RefuseReason::NotAuthorized,
            starling_process::error_chain(&e),
        ))
    } else if theirs != model_id {
        Some((
            RefuseReason::Protocol,
            format!("{server} serves model {model_id}, peer holds {theirs}"),
        ))
    } else {
        None
    };
    if let Some((reason, detail)) = refusal {
        send(&mut control, &Message::Refuse { reason, detail }).await?;
        let _ = control.finish();
        return Ok(None);
    }
    reader.set_limit(MAX_MESSAGE_BODY);
    send(
        &mut control,
        &Message::Welcome {
            latest_version: latest,
        },
    )
    .await?;
    Ok(Some(Admitted {
        control,
        reader,
        role,
        name,
        protocol,
        region,
        link: link.map(LinkProfile::from_stated),
    }))
}

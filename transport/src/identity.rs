//! Cluster identity: a CA created once per cluster, and leaf credentials it issues.
//!
//! A peer's certificate carries one DNS name that encodes its role and name
//! (`hub.starling`, `relay.<name>.starling`, `actor.<name>.starling`), so a server proves a
//! client's claimed identity with the standard name check of a verified certificate, and a
//! client checks that it reached the hub (or a relay) the same way. Names are restricted to
//! `[a-z0-9-]` so that they are valid DNS labels.
//!
//! Files (all PEM; keys written with mode 0600):
//! ```text
//! cluster dir:  ca.pem ca.key hub.pem hub.key signing.key signing.pub cluster.json
//! peer dir:     ca.pem <role>.pem <role>.key signing.pub identity.json
//! ```
//! `signing.key` is the hub's ed25519 manifest-signing key; peers get only `signing.pub`, so
//! a relay can forward deltas but never forge one.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use serde::{Deserialize, Serialize};
use starling_proto::delta::manifest::TrustPolicy;
use thiserror::Error;

/// What a peer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Hub,
    Relay,
    Actor,
    /// Publishes versions and submits rollout work (QUIC with its certificate, HTTP with
    /// its token).
    Trainer,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Hub => "hub",
            Role::Relay => "relay",
            Role::Actor => "actor",
            Role::Trainer => "trainer",
        }
    }

    pub fn parse(s: &str) -> Result<Self, IdentityError> {
        match s {
            "hub" => Ok(Role::Hub),
            "relay" => Ok(Role::Relay),
            "actor" => Ok(Role::Actor),
            "trainer" => Ok(Role::Trainer),
            other => Err(IdentityError::BadRole(other.to_owned())),
        }
    }
}

/// The DNS name a certificate for (`role`, `name`) carries and a verifier checks.
pub fn peer_dns_name(role: Role, name: &str) -> String {
    match role {
        Role::Hub => "hub.starling".to_owned(),
        r => format!("{}.{name}.starling", r.as_str()),
    }
}

/// Why identity files could not be created or read.
#[derive(Debug, Error)]
pub enum IdentityError {
    #[error("{op} {path}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("certificate generation")]
    Rcgen(#[from] rcgen::Error),
    #[error(
        "invalid peer name {0:?}: use 1–63 characters of a–z, 0–9 and '-', not starting or ending with '-'"
    )]
    BadName(String),
    #[error("unknown role {0:?} (expected hub, relay or actor)")]
    BadRole(String),
    #[error("{path} is not a cluster directory ({detail})")]
    NotACluster { path: PathBuf, detail: String },
    #[error("{0} already exists; refusing to overwrite cluster credentials")]
    Exists(PathBuf),
    #[error("{path} holds {held} credentials, not {wanted}'s")]
    WrongRole {
        path: PathBuf,
        held: &'static str,
        wanted: &'static str,
    },
}

fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> IdentityError + 'a {
    move |source| IdentityError::Io {
        op,
        path: path.to_owned(),
        source,
    }
}

/// Checks a peer name (a DNS label).
pub fn check_name(name: &str) -> Result<(), IdentityError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && !name.starts_with('-')
        && !name.ends_with('-')
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(IdentityError::BadName(name.to_owned()))
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct ClusterFile {
    cluster: String,
}

/// The CA's parameters, reproducible from the cluster name alone, so that the issuer can be
/// rebuilt from `ca.key` to sign new credentials later.
fn ca_params(cluster: &str) -> CertificateParams {
    let mut p = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "Starling");
    dn.push(DnType::CommonName, format!("Starling cluster CA {cluster}"));
    p.distinguished_name = dn;
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    p.not_before = rcgen::date_time_ymd(2024, 1, 1);
    p.not_after = rcgen::date_time_ymd(2124, 1, 1);
    p
}

fn leaf_params(role: Role, name: &str) -> Result<CertificateParams, IdentityError> {
    let dns = peer_dns_name(role, name);
    let mut p = CertificateParams::new(vec![dns.clone()])?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, dns);
    p.distinguished_name = dn;
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    p.extended_key_usages = vec![
        rcgen::ExtendedKeyUsagePurpose::ServerAuth,
        rcgen::ExtendedKeyUsagePurpose::ClientAuth,
    ];
    p.not_before = rcgen::date_time_ymd(2024, 1, 1);
    p.not_after = rcgen::date_time_ymd(2034, 1, 1);
    Ok(p)
}

fn write_secret(path: &Path, text: &str) -> Result<(), IdentityError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| {
            if e.kind() == std::io::ErrorKind::AlreadyExists {
                IdentityError::Exists(path.to_owned())
            } else {
                IdentityError::Io {
                    op: "create",
                    path: path.to_owned(),
                    source: e,
                }
            }
        })?;
    f.write_all(text.as_bytes()).map_err(io("write", path))
}

fn write_public(path: &Path, text: &str) -> Result<(), IdentityError> {
    std::fs::write(path, text).map_err(io("write", path))
}

fn read(path: &Path) -> Result<String, IdentityError> {
    std::fs::read_to_string(path).map_err(io("read", path))
}

/// Creates a cluster in `dir`: CA, hub credentials, manifest-signing key.
/// `signing_seed` is the 32-byte ed25519 seed (the caller draws it from the OS).
pub fn init_cluster(
    dir: &Path,
    cluster: &str,
    signing_seed: [u8; 32],
) -> Result<(), IdentityError> {
    check_name(cluster)?;
    std::fs::create_dir_all(dir).map_err(io("create", dir))?;
    if dir.join("ca.key").exists() {
        return Err(IdentityError::Exists(dir.join("ca.key")));
    }
    let ca_key = KeyPair::generate()?;
    let ca_cert = ca_params(cluster).self_signed(&ca_key)?;
    write_secret(&dir.join("ca.key"), &ca_key.serialize_pem())?;
    write_public(&dir.join("ca.pem"), &ca_cert.pem())?;
    write_public(
        &dir.join("cluster.json"),
        &serde_json::to_string_pretty(&ClusterFile {
            cluster: cluster.to_owned(),
        })
        .unwrap_or_default(),
    )?;
    let signing = starling_proto::delta::manifest::hex(&signing_seed);
    let public = ed25519_public_hex(&signing_seed);
    write_secret(&dir.join("signing.key"), &(signing + "\n"))?;
    write_public(&dir.join("signing.pub"), &(public + "\n"))?;
    let issuer = Issuer::new(ca_params(cluster), ca_key);
    let (cert, key) = issue_leaf(&issuer, Role::Hub, "hub")?;
    write_public(&dir.join("hub.pem"), &cert)?;
    write_secret(&dir.join("hub.key"), &key)?;
    Ok(())
}

fn ed25519_public_hex(seed: &[u8; 32]) -> String {
    // The signing key type lives in proto's manifest module (ed25519-dalek).
    starling_proto::delta::manifest::hex(&starling_proto::delta::manifest::public_key_of(seed))
}

fn issue_leaf(
    issuer: &Issuer<'_, KeyPair>,
    role: Role,
    name: &str,
) -> Result<(String, String), IdentityError> {
    let key = KeyPair::generate()?;
    let cert = leaf_params(role, name)?.signed_by(&key, issuer)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// Domain of the key trainer tokens are derived under (from the hub's signing seed).
const TRAINER_TOKEN_CONTEXT: &str = "starling 2026 trainer token v1";

/// The HTTP token of trainer `name`: `trainer.NAME.HEX`, where HEX is a BLAKE3 keyed hash of
/// the name under a key derived from the hub's signing seed. The hub checks a token by
/// recomputing it, so it stores none.
pub fn trainer_token(signing_seed: &[u8; 32], name: &str) -> String {
    let key = blake3::derive_key(TRAINER_TOKEN_CONTEXT, signing_seed);
    let mac = blake3::keyed_hash(&key, name.as_bytes());
    format!("trainer.{name}.{}", mac.to_hex())
}

/// The trainer a token was issued to, if it is genuine (checked in constant time).
pub fn verify_trainer_token(signing_seed: &[u8; 32], token: &str) -> Option<String> {
    let rest = token.strip_prefix("trainer.")?;
    let (name, mac_hex) = rest.rsplit_once('.')?;
    check_name(name).ok()?;
    let key = blake3::derive_key(TRAINER_TOKEN_CONTEXT, signing_seed);
    let expected = blake3::keyed_hash(&key, name.as_bytes());
    let given = blake3::Hash::from_hex(mac_hex).ok()?;
    // blake3::Hash's equality is constant-time.
    (given == expected).then(|| name.to_owned())
}

fn read_signing_seed(cluster_dir: &Path) -> Result<[u8; 32], IdentityError> {
    let path = cluster_dir.join("signing.key");
    let text = read(&path)?;
    let t = text.trim();
    let bad = || IdentityError::NotACluster {
        path: path.clone(),
        detail: "signing.key must hold 64 hex characters".into(),
    };
    starling_proto::delta::manifest::parse_hex(t).map_err(|_| bad())
}

/// Issues credentials for a relay, actor or trainer from the cluster in `cluster_dir` into
/// `out`. A trainer's also hold its HTTP token (`token`).
pub fn issue(cluster_dir: &Path, role: Role, name: &str, out: &Path) -> Result<(), IdentityError> {
    check_name(name)?;
    if role == Role::Hub {
        return Err(IdentityError::BadRole(
            "hub (hub credentials are made by init)".into(),
        ));
    }
    let cf: ClusterFile =
        serde_json::from_str(&read(&cluster_dir.join("cluster.json"))?).map_err(|e| {
            IdentityError::NotACluster {
                path: cluster_dir.to_owned(),
                detail: format!("cluster.json: {e}"),
            }
        })?;
    let ca_key = KeyPair::from_pem(&read(&cluster_dir.join("ca.key"))?)?;
    let issuer = Issuer::new(ca_params(&cf.cluster), ca_key);
    let (cert, key) = issue_leaf(&issuer, role, name)?;
    std::fs::create_dir_all(out).map_err(io("create", out))?;
    write_public(&out.join("ca.pem"), &read(&cluster_dir.join("ca.pem"))?)?;
    write_public(&out.join(format!("{}.pem", role.as_str())), &cert)?;
    write_secret(&out.join(format!("{}.key", role.as_str())), &key)?;
    write_public(
        &out.join("signing.pub"),
        &read(&cluster_dir.join("signing.pub"))?,
    )?;
    write_public(
        &out.join("identity.json"),
        &serde_json::to_string_pretty(
            &serde_json::json!({"cluster": cf.cluster, "role": role, "name": name}),
        )
        .unwrap_or_default(),
    )?;
    if role == Role::Trainer {
        let seed = read_signing_seed(cluster_dir)?;
        write_secret(&out.join("token"), &(trainer_token(&seed, name) + "\n"))?;
    }
    Ok(())
}

/// The HTTP token in a trainer's credentials directory.
pub fn load_trainer_token(dir: &Path) -> Result<String, IdentityError> {
    Ok(read(&dir.join("token"))?.trim().to_owned())
}

/// The hub's signing seed from its cluster directory (for checking trainer tokens).
pub fn hub_signing_seed(cluster_dir: &Path) -> Result<[u8; 32], IdentityError> {
    read_signing_seed(cluster_dir)
}

/// The hub's manifest-verification key from a credentials or cluster directory
/// (`signing.pub`): the only key whose signatures a relay or actor accepts.
pub fn manifest_key(dir: &Path) -> Result<[u8; 32], IdentityError> {
    let path = dir.join("signing.pub");
    let text = read(&path)?;
    let t = text.trim();
    let bad = || IdentityError::NotACluster {
        path: path.clone(),
        detail: "signing.pub must hold 64 hex characters".into(),
    };
    starling_proto::delta::manifest::parse_hex(t).map_err(|_| bad())
}

/// The trust a relay or actor verifies manifests under: the hub's key from `dir`
/// ([`manifest_key`]) and no other.
pub fn manifest_trust(dir: &Path) -> Result<TrustPolicy, IdentityError> {
    let path = dir.join("signing.pub");
    TrustPolicy::trusting(&manifest_key(dir)?).map_err(|e| IdentityError::NotACluster {
        path,
        detail: format!("not an ed25519 public key: {e}"),
    })
}

/// Credentials loaded from disk: the CA to verify peers against, and our own chain and key.
#[derive(Debug, Clone)]
pub struct Credentials {
    pub role: Role,
    pub name: String,
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
}

impl Credentials {
    /// Loads the hub's credentials from a cluster directory.
    pub fn load_hub(cluster_dir: &Path) -> Result<Self, IdentityError> {
        Ok(Self {
            role: Role::Hub,
            name: "hub".into(),
            ca_pem: read(&cluster_dir.join("ca.pem"))?,
            cert_pem: read(&cluster_dir.join("hub.pem"))?,
            key_pem: read(&cluster_dir.join("hub.key"))?,
        })
    }

    /// [`load_peer`](Self::load_peer), refusing credentials issued for another role (a relay
    /// started with an actor's directory).
    pub fn load_as(dir: &Path, role: Role) -> Result<Self, IdentityError> {
        let creds = Self::load_peer(dir)?;
        if creds.role != role {
            return Err(IdentityError::WrongRole {
                path: dir.to_owned(),
                held: creds.role.as_str(),
                wanted: role.as_str(),
            });
        }
        Ok(creds)
    }

    /// Loads a relay's or actor's credentials from the directory `issue` wrote.
    pub fn load_peer(dir: &Path) -> Result<Self, IdentityError> {
        let v: serde_json::Value = serde_json::from_str(&read(&dir.join("identity.json"))?)
            .map_err(|e| IdentityError::NotACluster {
                path: dir.to_owned(),
                detail: format!("identity.json: {e}"),
            })?;
        let role = Role::parse(v["role"].as_str().unwrap_or(""))?;
        let name = v["name"].as_str().unwrap_or("").to_owned();
        check_name(&name)?;
        Ok(Self {
            role,
            name,
            ca_pem: read(&dir.join("ca.pem"))?,
            cert_pem: read(&dir.join(format!("{}.pem", role.as_str())))?,
            key_pem: read(&dir.join(format!("{}.key", role.as_str())))?,
        })
    }
}

//! Signing keys on disk: a text file holding the 32-byte ed25519 seed in hex (mode 0600),
//! and its public key in hex for `--trust`.

use std::path::Path;

use anyhow::{Context, Result};
use ed25519_dalek::{SigningKey, VerifyingKey};
use starling_proto::delta::manifest::{hex, parse_hex};

fn parse_hex32(text: &str, what: &str) -> Result<[u8; 32]> {
    parse_hex(text.trim()).with_context(|| format!("{what} must be 64 hex digits"))
}

/// Creates a new key; writes the secret to `path` (0600) and `path.pub`.
pub fn generate(path: &Path) -> Result<VerifyingKey> {
    let mut seed = [0u8; 32];
    getrandom::fill(&mut seed).map_err(|e| anyhow::anyhow!("read OS randomness: {e}"))?;
    let key = SigningKey::from_bytes(&seed);
    write_private(path, &hex(&seed))?;
    let public = key.verifying_key();
    std::fs::write(path.with_extension("pub"), hex(public.as_bytes()) + "\n")
        .context("write public key")?;
    Ok(public)
}

fn write_private(path: &Path, text: &str) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("create {} (it must not exist yet)", path.display()))?;
    f.write_all(text.as_bytes())?;
    f.write_all(b"\n")?;
    Ok(())
}

pub fn load_signing(path: &Path) -> Result<SigningKey> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("read signing key {}", path.display()))?;
    Ok(SigningKey::from_bytes(&parse_hex32(&text, "signing key")?))
}

/// A trusted public key: a file holding hex, or the hex itself.
pub fn load_trusted(arg: &str) -> Result<VerifyingKey> {
    let text = if Path::new(arg).exists() {
        std::fs::read_to_string(arg).with_context(|| format!("read trusted key {arg}"))?
    } else {
        arg.to_owned()
    };
    VerifyingKey::from_bytes(&parse_hex32(&text, "trusted public key")?)
        .context("trusted public key is not a valid ed25519 point")
}

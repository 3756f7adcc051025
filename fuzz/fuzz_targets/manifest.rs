//! Manifest frame bodies (manifest bytes + signature block).
#![no_main]
use libfuzzer_sys::fuzz_target;
use starling_proto::delta::manifest::{SignedManifest, TrustPolicy};

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = SignedManifest::decode_body(data) {
        let _ = m.verify(&TrustPolicy::AnySigner);
    }
});

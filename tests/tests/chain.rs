//! A chain of 50 deltas, each encoded against the trainer's previous weights and applied
//! to the *receiver's* reconstructed weights, stays bit-identical to the directly computed
//! weights at every version; the incremental state digest equals a full rehash throughout.

use starling_checkpoint::workload::{ModelSpec, TrainConfig, generate_in_memory};
use starling_proto::delta::apply::{VersionedWeights, full_digest};
use starling_proto::delta::container::read_delta;
use starling_proto::delta::encode::{DeltaHeader, EncoderConfig, encode_in_memory, flat_pairs};
use starling_proto::delta::manifest::TrustPolicy;

#[test]
fn fifty_chained_deltas_stay_bit_identical() {
    let spec = ModelSpec::preset("tiny").expect("preset");
    let versions = generate_in_memory(
        &spec,
        50,
        &TrainConfig {
            seed: 11,
            lr: 1e-5,
            ..TrainConfig::default()
        },
    );
    let names: Vec<String> = versions[0].keys().cloned().collect();
    let d0 = full_digest("tiny", &versions[0], &names);
    let mut receiver = VersionedWeights::new("tiny", versions[0].clone(), 0, d0);
    let cfg = EncoderConfig {
        part_elems: 5000,
        segment_target_bytes: 4000,
        ..EncoderConfig::default()
    };
    let mut total_changes = 0u64;
    for v in 1..versions.len() {
        let (old, new) = (&versions[v - 1], &versions[v]);
        let tensors = flat_pairs(old, new);
        let header = DeltaHeader {
            model_id: "tiny".into(),
            base_version: v as u64 - 1,
            version: v as u64,
            created_unix_ms: v as u64,
            pre_digest: None,
        };
        let (bytes, manifest) = encode_in_memory(header, cfg.clone(), &tensors, None);
        total_changes += manifest.manifest.total_changes();
        let delta = read_delta(&bytes, &TrustPolicy::AnySigner).expect("reads");
        let mut st = receiver.stager();
        for s in &delta.segments {
            let e = &delta.manifest.manifest.segments[s.seq as usize];
            st.stage_segment(s, e.hash, e.frame_len, receiver.weights())
                .expect("stages");
        }
        st.stage_manifest(delta.manifest.clone()).expect("manifest");
        receiver
            .commit(st.seal(&TrustPolicy::AnySigner).expect("seals"))
            .expect("commits");
        assert_eq!(
            receiver.weights(),
            new,
            "version {v} differs from the trainer's"
        );
        assert_eq!(receiver.version(), v as u64);
        assert_eq!(
            receiver.digest(),
            full_digest("tiny", new, &names),
            "digest drift at version {v}"
        );
    }
    assert!(total_changes > 0, "the chain carried changes");
}

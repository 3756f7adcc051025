//! End-to-end properties of the delta container: encode → read → stage → seal → commit.

use std::collections::BTreeMap;

use ed25519_dalek::SigningKey;
use proptest::prelude::*;
use starling_proto::delta::apply::{StageError, VersionedWeights, Weights, full_digest};
use starling_proto::delta::container::{
    AssembleError, FILE_HEADER_LEN, Frame, FrameKind, parse_frame, read_delta,
};
use starling_proto::delta::digest::StateDigest;
use starling_proto::delta::encode::{DeltaHeader, EncoderConfig, encode_in_memory, flat_pairs};
use starling_proto::delta::manifest::TrustPolicy;
use starling_proto::delta::segment::CodecChoice;

type Model = BTreeMap<String, Vec<u16>>;

fn names(m: &Model) -> Vec<String> {
    m.keys().cloned().collect()
}

fn encode(
    old: &Model,
    new: &Model,
    cfg: EncoderConfig,
    key: Option<&SigningKey>,
    base_version: u64,
) -> (Vec<u8>, StateDigest) {
    let pre = full_digest("m", old, &names(old));
    let tensors = flat_pairs(old, new);
    let header = DeltaHeader {
        model_id: "m".into(),
        base_version,
        version: base_version + 1,
        created_unix_ms: 0,
        pre_digest: if base_version.is_multiple_of(2) {
            Some(pre)
        } else {
            None
        },
    };
    let (bytes, _) = encode_in_memory(header, cfg, &tensors, key);
    (bytes, pre)
}

/// Reads, stages, seals and commits `bytes` on `base`.
fn apply(base: &Model, version: u64, bytes: &[u8], trust: &TrustPolicy) -> Result<Model, String> {
    apply_in_batches(base, version, bytes, trust, 1)
}

/// [`apply`], staging the frames `batch` at a time (one: frame by frame).
fn apply_in_batches(
    base: &Model,
    version: u64,
    bytes: &[u8],
    trust: &TrustPolicy,
    batch: usize,
) -> Result<Model, String> {
    let delta = read_delta(bytes, trust).map_err(|e| e.to_string())?;
    let digest = full_digest("m", base, &names(base));
    let mut w = VersionedWeights::new("m", base.clone(), version, digest);
    let mut st = w.stager();
    // Stage segments in reverse order: any order must work.
    let mut pos = FILE_HEADER_LEN;
    let mut frames = Vec::new();
    while pos < bytes.len() {
        let f = parse_frame(&bytes[pos..]).map_err(|e| e.to_string())?;
        pos += f.total_len();
        frames.push(f);
    }
    frames.reverse();
    for chunk in frames.chunks(batch) {
        if let [f] = chunk {
            st.stage_frame(*f, w.weights())
        } else {
            st.stage_frames(chunk, w.weights())
        }
        .map_err(|e| e.to_string())?;
    }
    assert_eq!(
        st.manifest().map(|m| m.manifest.version),
        Some(delta.manifest.manifest.version)
    );
    let sealed = st.seal(trust).map_err(|e| e.to_string())?;
    w.commit(sealed).map_err(|e| e.to_string())?;
    let expected = full_digest("m", w.weights(), &names(base));
    assert_eq!(
        w.digest(),
        expected,
        "incremental digest equals a full rehash"
    );
    Ok(w.into_inner())
}

fn model_strategy() -> impl Strategy<Value = (Model, Model)> {
    let tensor = (1usize..3000, any::<u64>(), 0u8..4);
    proptest::collection::vec(tensor, 1..6).prop_map(|ts| {
        let mut old = Model::new();
        let mut new = Model::new();
        for (i, (len, seed, density)) in ts.into_iter().enumerate() {
            let mut s = seed;
            let mut next = || {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (s >> 33) as u32
            };
            let o: Vec<u16> = (0..len).map(|_| next() as u16).collect();
            let n: Vec<u16> = o
                .iter()
                .map(|&v| {
                    let r = next();
                    let change = match density {
                        0 => false,
                        1 => r % 100 == 0,
                        2 => r % 3 == 0,
                        _ => true,
                    };
                    if !change {
                        v
                    } else if r & 0x100 == 0 {
                        v.wrapping_add(1)
                    } else {
                        (r >> 9) as u16
                    }
                })
                .collect();
            old.insert(format!("layer.{i}.weight"), o);
            new.insert(format!("layer.{i}.weight"), n);
        }
        (old, new)
    })
}

fn small_cfg() -> EncoderConfig {
    EncoderConfig {
        part_elems: 700,
        segment_target_bytes: 300,
        choice: CodecChoice::default(),
    }
}

/// Weight-like models for the base-conditioned codecs: exponents 100..=135 (every class and
/// both clamped ends), either sign, mostly ±1/±2 ULP steps and some arbitrary new bits, at a
/// density per tensor from none through 0.3%, 1%, 5%, 30% to all; tensors of one element up.
fn weight_model_strategy() -> impl Strategy<Value = (Model, Model)> {
    let tensor = (
        prop_oneof![Just(1usize), Just(2), 3usize..5000],
        any::<u64>(),
        0u8..6,
    );
    proptest::collection::vec(tensor, 1..5).prop_map(|ts| {
        let mut old = Model::new();
        let mut new = Model::new();
        for (i, (len, seed, density)) in ts.into_iter().enumerate() {
            let mut s = seed | 1;
            let mut next = || {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                s
            };
            let o: Vec<u16> = (0..len)
                .map(|_| {
                    let r = next();
                    let e = 100 + (r % 36) as u16;
                    ((r >> 8) as u16 & 0x8000) | (e << 7) | ((r >> 24) as u16 & 0x7F)
                })
                .collect();
            let per_mille = [0u64, 3, 10, 50, 300, 1000][density as usize];
            let n: Vec<u16> = o
                .iter()
                .map(|&v| {
                    let r = next();
                    if r % 1000 >= per_mille {
                        return v;
                    }
                    match (r >> 20) % 16 {
                        0..=6 => v.wrapping_add(1),
                        7..=12 => v.wrapping_sub(1),
                        13 => v.wrapping_add(2),
                        14 => v ^ 0x8000,
                        _ => (r >> 40) as u16,
                    }
                })
                .collect();
            old.insert(format!("layer.{i}.weight"), o);
            new.insert(format!("layer.{i}.weight"), n);
        }
        (old, new)
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn base_conditioned_codecs_round_trip_through_stage_and_commit(
        (old, new) in weight_model_strategy(),
        part_elems in prop_oneof![Just(1u64), 7u64..100, 100u64..6000],
    ) {
        use starling_proto::delta::codec::{IndexCodec, ValueCodec};
        for choice in [
            CodecChoice::only(IndexCodec::ExpClassGapsRc, ValueCodec::UlpStepRc),
            CodecChoice::only(IndexCodec::ExpClassGapsRc, ValueCodec::Raw),
            CodecChoice::only(IndexCodec::RiceGaps, ValueCodec::UlpStepRc),
            CodecChoice::only(IndexCodec::ExpClassGapsRans, ValueCodec::UlpStepRans),
            CodecChoice::only(IndexCodec::ExpClassGapsRans, ValueCodec::Raw),
            CodecChoice::only(IndexCodec::RiceGaps, ValueCodec::UlpStepRans),
            CodecChoice::default(),
        ] {
            let cfg = EncoderConfig { part_elems, segment_target_bytes: 500, choice };
            let (bytes, _) = encode(&old, &new, cfg, None, 4);
            let got = apply(&old, 4, &bytes, &TrustPolicy::AnySigner).expect("applies");
            prop_assert_eq!(&got, &new);
        }
    }

    #[test]
    fn random_models_round_trip_bit_exactly((old, new) in model_strategy()) {
        let (bytes, _) = encode(&old, &new, small_cfg(), None, 7);
        let got = apply(&old, 7, &bytes, &TrustPolicy::AnySigner).expect("applies");
        prop_assert_eq!(got, new);
    }

    #[test]
    fn frames_staged_in_batches_give_the_same_weights(
        (old, new) in weight_model_strategy(),
        batch in 2usize..9,
    ) {
        let (bytes, _) = encode(&old, &new, small_cfg(), None, 3);
        let got = apply_in_batches(&old, 3, &bytes, &TrustPolicy::AnySigner, batch)
            .expect("applies");
        prop_assert_eq!(got, new);
    }
}

#[test]
fn a_batch_with_a_conflicting_segment_stages_none_of_its_segments() {
    let (old, new) = sample_pair();
    let cfg = EncoderConfig {
        part_elems: 100,
        segment_target_bytes: 50,
        choice: CodecChoice::default(),
    };
    let (bytes, pre) = encode(&old, &new, cfg, None, 1);
    let w = VersionedWeights::new("m", old.clone(), 1, pre);
    let mut frames = Vec::new();
    let mut pos = FILE_HEADER_LEN;
    while pos < bytes.len() {
        let f = parse_frame(&bytes[pos..]).expect("parses");
        pos += f.total_len();
        if f.kind == FrameKind::Segment {
            frames.push(f);
        }
    }
    assert!(frames.len() >= 3, "{} segments", frames.len());
    let mut st = w.stager();
    // The same segment twice in one batch, and once more later: staged once.
    st.stage_frames(&[frames[0], frames[1], frames[0]], w.weights())
        .expect("stages");
    let staged = st.changes();
    assert!(staged > 0);
    st.stage_frames(&[frames[1]], w.weights())
        .expect("a repeat");
    assert_eq!(st.changes(), staged);
    // A batch naming a staged or batched segment with other bytes is refused whole.
    let forged = Frame {
        hash: [9; 32],
        ..frames[2]
    };
    for batch in [
        vec![frames[2], forged],
        vec![
            frames[2],
            Frame {
                hash: [9; 32],
                ..frames[0]
            },
        ],
    ] {
        let err = st.stage_frames(&batch, w.weights()).expect_err("conflict");
        assert!(
            matches!(err, StageError::ConflictingSegment { .. }),
            "{err}"
        );
        assert_eq!(st.changes(), staged, "nothing of the batch staged");
    }
    // A segment that does not parse, or one of another delta, after a good one: the same.
    let body = frames[3].body;
    let truncated = Frame {
        body: &body[..body.len() - 1],
        ..frames[3]
    };
    let flipped: Model = new
        .iter()
        .map(|(k, v)| (k.clone(), v.iter().map(|x| x ^ 1).collect()))
        .collect();
    let (other, _) = encode(&old, &flipped, small_cfg(), None, 1);
    let foreign = parse_frame(&other[FILE_HEADER_LEN..]).expect("parses");
    assert_eq!(foreign.kind, FrameKind::Segment);
    for batch in [vec![frames[2], truncated], vec![frames[2], foreign]] {
        st.stage_frames(&batch, w.weights()).expect_err("refused");
        assert_eq!(st.changes(), staged, "nothing of the batch staged");
    }
    st.stage_frames(&frames[2..], w.weights())
        .expect("the rest stages");
    assert!(st.changes() > staged);
}

#[test]
fn unchanged_model_gives_an_empty_but_valid_delta() {
    let old: Model = [("a".to_string(), vec![1u16, 2, 3])].into();
    let (bytes, _) = encode(&old, &old, small_cfg(), None, 0);
    let delta = read_delta(&bytes, &TrustPolicy::AnySigner).expect("reads");
    assert!(delta.segments.is_empty());
    assert_eq!(
        apply(&old, 0, &bytes, &TrustPolicy::AnySigner).expect("applies"),
        old
    );
}

fn sample_pair() -> (Model, Model) {
    let mut old = Model::new();
    let mut new = Model::new();
    for t in 0..3 {
        let o: Vec<u16> = (0..2000u32)
            .map(|i| (i.wrapping_mul(2654435761u32) >> 16) as u16)
            .collect();
        let n: Vec<u16> = o
            .iter()
            .enumerate()
            .map(|(i, &v)| if i % 37 == t { v.wrapping_add(1) } else { v })
            .collect();
        old.insert(format!("t{t}"), o);
        new.insert(format!("t{t}"), n);
    }
    (old, new)
}

#[test]
fn every_single_byte_flip_and_truncation_is_refused() {
    let (old, new) = sample_pair();
    let (bytes, _) = encode(&old, &new, small_cfg(), None, 1);
    assert_eq!(
        apply(&old, 1, &bytes, &TrustPolicy::AnySigner).expect("clean applies"),
        new
    );
    for i in 0..bytes.len() {
        let mut b = bytes.clone();
        b[i] ^= 0x40;
        assert!(
            apply(&old, 1, &b, &TrustPolicy::AnySigner).is_err(),
            "flip at byte {i} accepted"
        );
    }
    for cut in 0..bytes.len() {
        assert!(
            read_delta(&bytes[..cut], &TrustPolicy::AnySigner).is_err(),
            "truncation at {cut} accepted"
        );
    }
}

#[test]
fn wrong_base_names_both_versions_and_digests() {
    let (old, new) = sample_pair();
    let (bytes, pre) = encode(&old, &new, small_cfg(), None, 1);
    // Same weights, claimed at another version.
    let err = apply(&old, 2, &bytes, &TrustPolicy::AnySigner).expect_err("wrong version refused");
    assert!(
        err.contains("version 1") && err.contains("version 2"),
        "{err}"
    );
    // Right version, drifted weights.
    let mut drifted = old.clone();
    if let Some(t) = drifted.tensor_mut("t1") {
        t[5] ^= 1;
    }
    let err =
        apply(&drifted, 1, &bytes, &TrustPolicy::AnySigner).expect_err("drifted base refused");
    assert!(err.contains(&pre.to_string()), "{err}");
}

#[test]
fn signatures_are_enforced_when_a_key_is_trusted() {
    let (old, new) = sample_pair();
    let hub = SigningKey::from_bytes(&[1; 32]);
    let rogue = SigningKey::from_bytes(&[2; 32]);
    let trust = TrustPolicy::Keys(vec![hub.verifying_key()]);
    let (signed, _) = encode(&old, &new, small_cfg(), Some(&hub), 1);
    assert_eq!(
        apply(&old, 1, &signed, &trust).expect("signed applies"),
        new
    );
    let (unsigned, _) = encode(&old, &new, small_cfg(), None, 1);
    assert!(matches!(
        read_delta(&unsigned, &trust),
        Err(AssembleError::Signature(_))
    ));
    let (forged, _) = encode(&old, &new, small_cfg(), Some(&rogue), 1);
    assert!(matches!(
        read_delta(&forged, &trust),
        Err(AssembleError::Signature(_))
    ));
}

#[test]
fn commit_refuses_a_sealed_delta_after_the_base_moved() {
    let (old, new) = sample_pair();
    let (bytes, pre) = encode(&old, &new, small_cfg(), None, 1);
    let mut w = VersionedWeights::new("m", old.clone(), 1, pre);
    let mut st = w.stager();
    let delta = read_delta(&bytes, &TrustPolicy::AnySigner).expect("reads");
    for s in &delta.segments {
        let hash = delta.manifest.manifest.segments[s.seq as usize].hash;
        let len = delta.manifest.manifest.segments[s.seq as usize].frame_len;
        st.stage_segment(s, hash, len, w.weights()).expect("stages");
    }
    st.stage_manifest(delta.manifest.clone()).expect("manifest");
    let sealed = st.seal(&TrustPolicy::AnySigner).expect("seals");
    let mut moved = VersionedWeights::new("m", old.clone(), 2, StateDigest(5));
    assert!(matches!(
        moved.commit(sealed),
        Err(StageError::WrongBase {
            expected_version: 1,
            actual_version: 2,
            ..
        })
    ));
    assert_eq!(moved.weights(), &old, "refused commit wrote nothing");
    // Commit and roll back restores exact bits.
    let st = w.stager();
    let undo = stage_and_commit(&mut w, st, &delta);
    assert_eq!(w.weights(), &new);
    assert_eq!(w.version(), 2);
    w.rollback(undo);
    assert_eq!(w.weights(), &old);
    assert_eq!((w.version(), w.digest()), (1, pre));
}

/// Stages every segment of `delta` and its manifest with `st` (a stager on `w`), seals and
/// commits it.
fn stage_and_commit(
    w: &mut VersionedWeights<Model>,
    mut st: starling_proto::delta::apply::Stager,
    delta: &starling_proto::delta::container::Delta,
) -> starling_proto::delta::apply::UndoLog {
    for s in &delta.segments {
        let e = &delta.manifest.manifest.segments[s.seq as usize];
        st.stage_segment(s, e.hash, e.frame_len, w.weights())
            .expect("stages");
    }
    st.stage_manifest(delta.manifest.clone()).expect("manifest");
    w.commit(st.seal(&TrustPolicy::AnySigner).expect("seals"))
        .expect("commits")
}

/// The written changes of an undo log, gathered per tensor in position order.
fn written_by_tensor(
    log: &starling_proto::delta::apply::UndoLog,
) -> BTreeMap<String, Vec<(u64, u16)>> {
    let mut out: BTreeMap<String, Vec<(u64, u16)>> = BTreeMap::new();
    for (tensor, start, positions, new) in log.written() {
        let entry = out.entry(tensor.to_owned()).or_default();
        entry.extend(
            positions
                .iter()
                .map(|&p| start + u64::from(p))
                .zip(new.iter().copied()),
        );
    }
    for changes in out.values_mut() {
        changes.sort_unstable();
    }
    out
}

#[test]
fn a_change_computed_from_two_checkpoints_is_what_a_commit_writes() {
    let (old, new) = sample_pair();
    let (bytes, _) = encode(&old, &new, small_cfg(), None, 4);
    let digest = full_digest("m", &old, &names(&old));
    let mut w = VersionedWeights::new("m", old.clone(), 4, digest);
    let mut st = w.stager();
    let mut pos = FILE_HEADER_LEN;
    while pos < bytes.len() {
        let f = parse_frame(&bytes[pos..]).expect("frame");
        pos += f.total_len();
        st.stage_frame(f, w.weights()).expect("stages");
    }
    let committed = w
        .commit(st.seal(&TrustPolicy::AnySigner).expect("seals"))
        .expect("commits");

    let between = starling_proto::delta::apply::UndoLog::between(4, digest, &old, &new)
        .expect("same tensors");
    assert_eq!(between.base(), (4, digest));
    assert_eq!(between.changes(), committed.changes());
    assert_eq!(written_by_tensor(&between), written_by_tensor(&committed));
    // Scattering what it wrote onto the old weights gives the new ones.
    let mut scattered = old.clone();
    for (tensor, start, positions, bits) in between.written() {
        let t = scattered.get_mut(tensor).expect("tensor");
        for (&i, &b) in positions.iter().zip(bits) {
            t[start as usize + i as usize] = b;
        }
    }
    assert_eq!(scattered, new);

    // Different tensors or lengths: no sparse change to offer.
    let mut renamed = new.clone();
    let t0 = renamed.remove("t0").expect("t0");
    renamed.insert("u0".into(), t0);
    assert!(starling_proto::delta::apply::UndoLog::between(4, digest, &old, &renamed).is_none());
    let mut shorter = new.clone();
    shorter.get_mut("t1").expect("t1").pop();
    assert!(starling_proto::delta::apply::UndoLog::between(4, digest, &old, &shorter).is_none());
    assert_eq!(
        starling_proto::delta::apply::UndoLog::between(4, digest, &old, &old).map(|l| l.changes()),
        Some(0)
    );
}

/// `model` with every element whose index is `step` mod `every` moved by one ULP step.
fn stepped(model: &Model, step: usize, every: usize) -> Model {
    model
        .iter()
        .map(|(name, t)| {
            let t = t
                .iter()
                .enumerate()
                .map(|(i, &v)| {
                    if i % every == step % every {
                        v.wrapping_add(1)
                    } else {
                        v
                    }
                })
                .collect();
            (name.clone(), t)
        })
        .collect()
}

#[test]
fn staging_into_an_earlier_undo_logs_vectors_writes_what_fresh_staging_writes() {
    use starling_proto::delta::apply::StagingBuffers;
    use std::sync::Arc;
    // Versions 1 → 5 at densities that rise and fall, so recycled vectors are sometimes too
    // small (they grow) and sometimes more than needed. One copy of the weights stages into
    // the previous undo log's vectors, another into fresh ones.
    let (m0, _) = sample_pair();
    let mut models = vec![m0];
    let everies = [11usize, 3, 29, 2];
    for (k, every) in everies.into_iter().enumerate() {
        let next = stepped(&models[k], k, every);
        models.push(next);
    }
    let d0 = full_digest("m", &models[0], &names(&models[0]));
    let mut recycled = VersionedWeights::new("m", models[0].clone(), 1, d0);
    let mut fresh = VersionedWeights::new("m", models[0].clone(), 1, d0);
    let buffers = Arc::new(StagingBuffers::new());
    for k in 0..models.len() - 1 {
        let (bytes, _) = encode(&models[k], &models[k + 1], small_cfg(), None, 1 + k as u64);
        let delta = read_delta(&bytes, &TrustPolicy::AnySigner).expect("reads");
        let held = buffers.bytes();
        let mut logs = Vec::new();
        for (w, pool) in [(&mut recycled, Some(&buffers)), (&mut fresh, None)] {
            let mut st = w.stager();
            if let Some(b) = pool {
                st = st.with_buffers(b.clone());
            }
            let log = stage_and_commit(w, st, &delta);
            assert_eq!(w.weights(), &models[k + 1], "version {}", k + 2);
            logs.push(log);
        }
        if k > 0 && everies[k] > everies[k - 1] {
            // Sparser than the version before: its parts fit the held vectors.
            assert!(
                buffers.bytes() < held,
                "staging took the vectors held ({} of {held} bytes left)",
                buffers.bytes()
            );
        }
        assert_eq!(recycled.digest(), fresh.digest());
        assert_eq!(written_by_tensor(&logs[0]), written_by_tensor(&logs[1]));
        let log = logs.swap_remove(0);
        // 8 bytes per change, each part's vectors at most 1.25× what it used (plus rounding):
        // a sparse version after a dense one does not keep the dense one's memory.
        let bound = 10 * log.changes() + 64 * 8;
        buffers.recycle(log);
        assert!(buffers.bytes() > 0, "the undo log's vectors are held");
        assert!(
            buffers.bytes() <= bound,
            "{} bytes held after version {}, at most {bound}",
            buffers.bytes(),
            k + 2
        );
    }
}

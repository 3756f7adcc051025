//! End-to-end tests of the delta tools: the real `starling-hub` binary in real processes,
//! on real files.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use starling_checkpoint::safetensors::Checkpoint;
use starling_checkpoint::workload::{ModelSpec, TrainConfig, generate_to_dir, step_file};
use starling_checkpoint::writer::SafetensorsWriter;

fn hub(args: &[&dyn AsRef<std::ffi::OsStr>]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_starling-hub"));
    for a in args {
        c.arg(a.as_ref());
    }
    c.output().expect("run starling-hub")
}

fn ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "failed: {}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn err(o: &Output) -> String {
    assert!(
        !o.status.success(),
        "unexpectedly succeeded: {}",
        String::from_utf8_lossy(&o.stdout)
    );
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn tiny_steps(dir: &Path, steps: u32) -> Vec<PathBuf> {
    let spec = ModelSpec::preset("tiny").expect("preset");
    generate_to_dir(
        &spec,
        steps,
        &TrainConfig {
            seed: 9,
            lr: 1e-5,
            ..TrainConfig::default()
        },
        dir,
        &|_| {},
    )
    .expect("generate")
}

fn same_tensors(a: &Path, b: &Path) -> bool {
    Checkpoint::open(a)
        .expect("open a")
        .read_all()
        .expect("read a")
        == Checkpoint::open(b)
            .expect("open b")
            .read_all()
            .expect("read b")
}

/// Files in `dir` other than the ones named (temporary leftovers would show up here).
fn leftovers(dir: &Path, expected: &[&Path]) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .expect("list")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| !expected.iter().any(|e| e == p) && p.is_file())
        .collect()
}

#[test]
fn diff_apply_verify_inspect_round_trip_bit_exactly() {
    let d = tempfile::tempdir().expect("tempdir");
    let steps = tiny_steps(d.path(), 2);
    let delta = d.path().join("d.sdc");
    let out = d.path().join("out.safetensors");
    let s = ok(&hub(&[
        &"delta",
        &"diff",
        &steps[1],
        &steps[2],
        &"-o",
        &delta,
        &"--model-id",
        &"tiny",
    ]));
    assert!(s.contains("1 → 2"), "{s}");
    let s = ok(&hub(&[&"delta", &"apply", &steps[1], &delta, &"-o", &out]));
    assert!(s.contains("verified"), "{s}");
    assert!(same_tensors(&out, &steps[2]));
    // The output is a valid safetensors file for the reference implementation too.
    let bytes = std::fs::read(&out).expect("read out");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("valid safetensors");
    assert_eq!(
        st.len(),
        Checkpoint::open(&steps[2]).expect("open").tensors().len()
    );
    ok(&hub(&[&"delta", &"verify", &steps[1], &delta]));
    let j: serde_json::Value =
        serde_json::from_str(&ok(&hub(&[&"delta", &"inspect", &delta, &"--json"]))).expect("json");
    let a = Checkpoint::open(&steps[1])
        .expect("open")
        .read_all()
        .expect("read");
    let b = Checkpoint::open(&steps[2])
        .expect("open")
        .read_all()
        .expect("read");
    let changes: usize = a
        .iter()
        .map(|(n, v)| v.iter().zip(&b[n]).filter(|(x, y)| x != y).count())
        .sum();
    assert_eq!(j["changes"].as_u64(), Some(changes as u64));
    assert_eq!(j["version"].as_u64(), Some(2));
    assert!(
        j["file_bytes"].as_u64().expect("bytes")
            < j["dense_bf16_bytes"].as_u64().expect("dense") / 5
    );
}

#[test]
fn corrupted_or_truncated_deltas_are_refused_and_leave_no_output() {
    let d = tempfile::tempdir().expect("tempdir");
    let steps = tiny_steps(d.path(), 2);
    let delta = d.path().join("d.sdc");
    ok(&hub(&[
        &"delta", &"diff", &steps[1], &steps[2], &"-o", &delta,
    ]));
    let good = std::fs::read(&delta).expect("read");
    let bad = d.path().join("bad.sdc");
    let out = d.path().join("out.safetensors");
    // Flips spread over the whole file (every byte is covered by the library tests).
    let n = good.len();
    let positions: Vec<usize> = (0..24).map(|i| i * (n - 1) / 23).collect();
    for &i in &positions {
        let mut b = good.clone();
        b[i] ^= 0x10;
        std::fs::write(&bad, &b).expect("write");
        let e = err(&hub(&[&"delta", &"apply", &steps[1], &bad, &"-o", &out]));
        assert!(e.contains("error:"), "{e}");
        assert!(!out.exists(), "flip at {i} left an output");
    }
    for cut in [0, 5, 16, 100, n / 2, n - 40, n - 1] {
        std::fs::write(&bad, &good[..cut]).expect("write");
        let e = err(&hub(&[&"delta", &"apply", &steps[1], &bad, &"-o", &out]));
        assert!(
            e.contains("truncated") || e.contains("magic") || e.contains("header"),
            "cut {cut}: {e}"
        );
        assert!(!out.exists());
    }
    let mut expected: Vec<&Path> = steps.iter().map(PathBuf::as_path).collect();
    expected.push(&delta);
    expected.push(&bad);
    assert_eq!(leftovers(d.path(), &expected), Vec::<PathBuf>::new());
}

#[test]
fn a_wrong_base_is_refused_with_both_versions_and_digests_named() {
    let d = tempfile::tempdir().expect("tempdir");
    let steps = tiny_steps(d.path(), 2);
    let delta = d.path().join("d.sdc");
    let out = d.path().join("out.safetensors");
    ok(&hub(&[
        &"delta", &"diff", &steps[1], &steps[2], &"-o", &delta,
    ]));
    let e = err(&hub(&[&"delta", &"apply", &steps[0], &delta, &"-o", &out]));
    assert!(
        e.contains("wrong base") && e.contains("version 1") && e.contains("version 0"),
        "{e}"
    );
    assert!(e.contains("digest"), "{e}");
    assert!(!out.exists());
    // Claiming the right version does not help: the digest of the bits decides.
    let e = err(&hub(&[
        &"delta",
        &"verify",
        &steps[0],
        &delta,
        &"--base-version",
        &"1",
    ]));
    assert!(e.contains("wrong base"), "{e}");
}

#[test]
fn signed_manifests_are_enforced_with_trust() {
    let d = tempfile::tempdir().expect("tempdir");
    let steps = tiny_steps(d.path(), 1);
    let (key, other) = (d.path().join("hub.key"), d.path().join("other.key"));
    ok(&hub(&[&"keygen", &"-o", &key]));
    ok(&hub(&[&"keygen", &"-o", &other]));
    let (signed, unsigned) = (d.path().join("s.sdc"), d.path().join("u.sdc"));
    ok(&hub(&[
        &"delta",
        &"diff",
        &steps[0],
        &steps[1],
        &"-o",
        &signed,
        &"--signing-key",
        &key,
    ]));
    ok(&hub(&[
        &"delta", &"diff", &steps[0], &steps[1], &"-o", &unsigned,
    ]));
    let pubkey = key.with_extension("pub");
    let other_pub = other.with_extension("pub");
    ok(&hub(&[
        &"delta", &"verify", &steps[0], &signed, &"--trust", &pubkey,
    ]));
    let e = err(&hub(&[
        &"delta", &"verify", &steps[0], &signed, &"--trust", &other_pub,
    ]));
    assert!(e.contains("not a trusted key"), "{e}");
    let e = err(&hub(&[
        &"delta", &"verify", &steps[0], &unsigned, &"--trust", &pubkey,
    ]));
    assert!(e.contains("unsigned"), "{e}");
    // Without --trust, an unsigned delta is accepted and says so.
    assert!(ok(&hub(&[&"delta", &"inspect", &unsigned])).contains("UNSIGNED"));
}

#[test]
fn sharded_and_f32_checkpoints_are_read_and_cast_like_torch() {
    let d = tempfile::tempdir().expect("tempdir");
    // F32 old/new with values that exercise round-to-nearest-even and NaN.
    let old_f: Vec<f32> = vec![1.0, 1.0 + 2f32.powi(-8), -0.0, f32::NAN, 3.5, 1e-40];
    let new_f: Vec<f32> = vec![1.0, 1.0 + 3.0 * 2f32.powi(-8), 0.0, f32::NAN, 3.5, 2e-40];
    let write_f32 = |path: &Path, v: &[f32]| {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![v.len()], &bytes)
                .expect("view");
        safetensors::serialize_to_file([("w", view)], None, path).expect("write f32");
    };
    // Sharded BF16 companion tensor, split over two files with an index.
    let shard_dir = |name: &str, a: &[u16], f: &[f32]| -> PathBuf {
        let dir = d.path().join(name);
        std::fs::create_dir_all(&dir).expect("mkdir");
        write_f32(&dir.join("model-00001-of-00002.safetensors"), f);
        let mut w = SafetensorsWriter::create(
            &dir.join("model-00002-of-00002.safetensors"),
            &[("z".to_string(), vec![a.len() as u64])],
            None,
        )
        .expect("create");
        w.write(a).expect("write");
        w.finish().expect("finish");
        std::fs::write(
            dir.join("model.safetensors.index.json"),
            r#"{"metadata": {}, "weight_map": {"w": "model-00001-of-00002.safetensors", "z": "model-00002-of-00002.safetensors"}}"#,
        )
        .expect("index");
        dir
    };
    let old = shard_dir("old", &[1, 2, 3, 4], &old_f);
    let new = shard_dir("new", &[1, 2, 9, 4], &new_f);
    let delta = d.path().join("d.sdc");
    let out = d.path().join("out.safetensors");
    ok(&hub(&[&"delta", &"diff", &old, &new, &"-o", &delta]));
    ok(&hub(&[&"delta", &"apply", &old, &delta, &"-o", &out]));
    let got = Checkpoint::open(&out)
        .expect("open")
        .read_all()
        .expect("read");
    // torch: 1+2^-8 → 0x3F80 (tie to even), 1+3·2^-8 → 0x3F82, NaN → 0x7FC0, 2e-40 subnormal.
    assert_eq!(
        got["w"],
        vec![
            0x3F80,
            0x3F82,
            0x0000,
            0x7FC0,
            0x4060,
            starling_proto::delta::bf16::f32_to_bf16(2e-40)
        ]
    );
    assert_eq!(got["z"], vec![1, 2, 9, 4]);
    assert_eq!(
        step_file(d.path(), 3).file_name().and_then(|n| n.to_str()),
        Some("step-0003.safetensors")
    );
}

#[test]
fn bad_arguments_and_missing_files_get_clear_errors() {
    let d = tempfile::tempdir().expect("tempdir");
    let e = err(&hub(&[&"delta", &"inspect", &d.path().join("nope.sdc")]));
    assert!(e.contains("nope.sdc"), "{e}");
    let notsdc = d.path().join("x.sdc");
    std::fs::write(&notsdc, b"hello, this is not a delta checkpoint").expect("write");
    let e = err(&hub(&[&"delta", &"inspect", &notsdc]));
    assert!(e.contains("magic"), "{e}");
    let e = err(&hub(&[
        &"bench",
        &"gen",
        &"--model",
        &"huge",
        &"-o",
        &d.path(),
    ]));
    assert!(e.contains("unknown model preset"), "{e}");
}

#[test]
fn init_and_issue_create_cluster_credentials() {
    let d = tempfile::tempdir().expect("tempdir");
    let cluster = d.path().join("cluster");
    ok(&hub(&[&"init", &"--dir", &cluster, &"--name", &"test"]));
    for f in [
        "ca.pem",
        "ca.key",
        "hub.pem",
        "hub.key",
        "signing.key",
        "signing.pub",
    ] {
        assert!(cluster.join(f).exists(), "{f}");
    }
    let e = err(&hub(&[&"init", &"--dir", &cluster]));
    assert!(e.contains("already exists"), "{e}");
    let a = d.path().join("a1");
    ok(&hub(&[
        &"issue", &"--dir", &cluster, &"--role", &"actor", &"--name", &"a1", &"-o", &a,
    ]));
    let creds = starling_transport::identity::Credentials::load_peer(&a).expect("load");
    assert_eq!(creds.name, "a1");
    let e = err(&hub(&[
        &"issue", &"--dir", &cluster, &"--role", &"pilot", &"--name", &"x", &"-o", &a,
    ]));
    assert!(e.contains("unknown role"), "{e}");
    // The manifest key from init signs deltas that peers can verify with signing.pub.
    let steps = tiny_steps(d.path(), 1);
    let delta = d.path().join("d.sdc");
    ok(&hub(&[
        &"delta",
        &"diff",
        &steps[0],
        &steps[1],
        &"-o",
        &delta,
        &"--signing-key",
        &cluster.join("signing.key"),
    ]));
    ok(&hub(&[
        &"delta",
        &"verify",
        &steps[0],
        &delta,
        &"--trust",
        &a.join("signing.pub"),
    ]));
}

//! What a publish must pass, through a real hub with a subscribed actor (issue 23, findings 5
//! and 9): NaN/±Inf weights, a missing or an extra tensor, a directory of several
//! checkpoints, a checkpoint identical to the latest version, a step going backwards, a path
//! outside `--publish-dir` (with the same answer whether the file exists or not) and a FIFO
//! are each refused by name with their code — and none of them sends anything: the hub
//! emits no segment, the actor sees no version, and the next good publish gets the next
//! number and arrives without a refetch. Concurrent publishes each answer their own
//! version's digest. A handed-over checkpoint (`"handover": true`) is taken from the trainer's
//! directory when accepted, given back byte for byte when refused, and copied when another
//! hard link could still write it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::{Value, json};
use starling_checkpoint::safetensors::Checkpoint;
use starling_checkpoint::writer::SafetensorsWriter;
use starling_tests::{Testbed, http_request, next_event, wait_for};

fn token(tb: &Testbed) -> String {
    starling_transport::identity::load_trainer_token(&tb.root.join("t1")).expect("trainer token")
}

fn post_version(tb: &Testbed, body: &Value) -> (u16, Value) {
    post_to(&tb.hub_http, &token(tb), body)
}

fn post_to(http: &str, token: &str, body: &Value) -> (u16, Value) {
    let (status, text) = http_request(
        http,
        "POST",
        "/v1/versions",
        Some(token),
        Some(&body.to_string()),
    );
    let v = serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON: {text}"));
    (status, v)
}

/// Writes `tensors` (name → BF16 bits, shapes from `like`) as a safetensors file.
fn write(path: &Path, like: &Checkpoint, tensors: &BTreeMap<String, Vec<u16>>) {
    let layout: Vec<(String, Vec<u64>)> = tensors
        .keys()
        .map(|n| {
            let shape = like
                .tensor(n)
                .map(|t| t.shape.clone())
                .unwrap_or_else(|| vec![tensors[n].len() as u64]);
            (n.clone(), shape)
        })
        .collect();
    let mut w = SafetensorsWriter::create(path, &layout, None).expect("create");
    for bits in tensors.values() {
        w.write(bits).expect("write");
    }
    w.finish().expect("finish");
}

/// Asserts that the hub emitted no segment since the last look (no `first-segment` line).
fn nothing_sent(hub_out: &mpsc::Receiver<String>, what: &Value) {
    while let Ok(line) = hub_out.recv_timeout(Duration::from_millis(200)) {
        assert!(
            !line.starts_with("first-segment"),
            "the hub started streaming a refused version ({what}): {line}"
        );
    }
}

fn refused(tb: &Testbed, body: Value, status: u16, code: &str) -> String {
    let (s, v) = post_version(tb, &body);
    assert_eq!((s, v["code"].as_str()), (status, Some(code)), "{body}: {v}");
    nothing_sent(&tb.hub_out, &body);
    v["message"].as_str().expect("message").to_owned()
}

#[test]
fn refused_publishes_are_named_and_send_nothing() {
    let mut tb = Testbed::new(3, 21, &[("actor", "a1"), ("trainer", "t1")], &[]);
    let dl = tb.deadline;
    let a1 = tb.actor("a1", &[]);
    wait_for(&a1, "active 0 ", dl);
    let dir: PathBuf = tb.steps[0].parent().expect("ckpt dir").to_owned();
    let one = Checkpoint::open(&tb.steps[1]).expect("open");
    let weights = one.read_all().expect("read");
    let victim = weights.keys().nth(1).expect("a tensor").clone();

    // NaN and ±Inf, named with their counts.
    let mut bad = weights.clone();
    let t = bad.get_mut(&victim).expect("tensor");
    t[0] = 0x7fc0; // NaN
    t[1] = 0xffc1; // NaN, other sign and payload
    t[2] = 0xff80; // -Inf
    let nan_path = dir.join("nan.safetensors");
    write(&nan_path, &one, &bad);
    let m = refused(
        &tb,
        json!({"path": nan_path, "step": 1}),
        422,
        "nonfinite_weights",
    );
    assert!(m.contains(&format!("{victim} (2 NaN, 1 ±Inf)")), "{m}");

    // A tensor missing, and one too many: each named.
    let mut missing = weights.clone();
    missing.remove(&victim);
    let p = dir.join("missing.safetensors");
    write(&p, &one, &missing);
    let m = refused(&tb, json!({"path": p}), 409, "layout_mismatch");
    assert!(
        m.contains("1 tensor of the model missing") && m.contains(&victim),
        "{m}"
    );
    let mut extra = weights.clone();
    extra.insert("zz.extra.weight".into(), vec![0x3f80; 4]);
    let p = dir.join("extra.safetensors");
    write(&p, &one, &extra);
    let m = refused(&tb, json!({"path": p}), 409, "layout_mismatch");
    assert!(m.contains("not in the model: zz.extra.weight"), "{m}");

    // A directory of several checkpoints is not one model with every tensor twice.
    let several = dir.join("several");
    std::fs::create_dir_all(&several).expect("mkdir");
    std::fs::copy(&tb.steps[1], several.join("step-1.safetensors")).expect("copy");
    std::fs::copy(&tb.steps[2], several.join("step-2.safetensors")).expect("copy");
    let m = refused(&tb, json!({"path": several}), 422, "unreadable_checkpoint");
    assert!(
        m.contains("holds 2 checkpoint files") && m.contains("model.safetensors.index.json"),
        "{m}"
    );

    // The latest version again (a retried publish that already succeeded): refused.
    let m = refused(&tb, json!({"path": tb.steps[0]}), 409, "unchanged");
    assert!(m.contains("version 0"), "{m}");

    // Outside the publish directories: the cluster's signing key, and a file that does not
    // exist, get the same answer, which tells nothing of either.
    let key = tb.cluster.join("signing.key");
    let size = std::fs::metadata(&key).expect("key").len().to_string();
    let a = refused(&tb, json!({"path": key}), 403, "path_not_allowed");
    let b = refused(
        &tb,
        json!({"path": tb.cluster.join("nothing-here")}),
        403,
        "path_not_allowed",
    );
    assert_eq!(
        a.replace(&key.display().to_string(), "P"),
        b.replace(&tb.cluster.join("nothing-here").display().to_string(), "P")
    );
    assert!(!a.contains(&size) && !a.contains("bytes"), "{a}");
    // A link inside a publish directory that leads out of it, and `..`.
    let link = dir.join("key-link.safetensors");
    std::os::unix::fs::symlink(&key, &link).expect("symlink");
    refused(&tb, json!({"path": link}), 403, "path_not_allowed");
    refused(
        &tb,
        json!({"path": dir.join("../cluster/signing.key")}),
        403,
        "path_not_allowed",
    );
    // A FIFO inside one: refused at once (not waited on).
    let fifo = dir.join("fifo.safetensors");
    assert!(
        std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .expect("mkfifo")
            .success()
    );
    let t0 = std::time::Instant::now();
    let m = refused(&tb, json!({"path": fifo}), 422, "unreadable_checkpoint");
    assert!(m.contains("not a regular file"), "{m}");
    assert!(t0.elapsed() < Duration::from_secs(30));

    // None of it reached the actor; the next good publish is version 1, delivered at once.
    let (s, v) = post_version(&tb, &json!({"path": tb.steps[1], "step": 5}));
    assert_eq!(s, 201, "{v}");
    assert_eq!(v["version"], 1);
    assert_eq!(
        next_event(&a1, dl),
        tb.active_line(1),
        "no refetch, no other version"
    );
    // What the hub printed for version 1 (its first segment) is not a refused version's.
    while tb.hub_out.recv_timeout(Duration::from_millis(200)).is_ok() {}

    // A step going backwards is refused unless allowed.
    let m = refused(
        &tb,
        json!({"path": tb.steps[2], "step": 4}),
        409,
        "step_backwards",
    );
    assert!(m.contains("step 4 is before step 5"), "{m}");
    let (s, v) = post_version(
        &tb,
        &json!({"path": tb.steps[2], "step": 4, "allow": ["step_backwards"]}),
    );
    assert_eq!((s, v["version"].as_u64()), (201, Some(2)), "{v}");
    assert_eq!(next_event(&a1, dl), tb.active_line(2));

    // NaN weights the trainer means to publish: allowed explicitly.
    let (s, v) = post_version(&tb, &json!({"path": nan_path, "allow": ["nonfinite"]}));
    assert_eq!((s, v["version"].as_u64()), (201, Some(3)), "{v}");
}

#[test]
fn concurrent_publishes_each_answer_their_own_versions_digest() {
    let tb = Testbed::new(4, 22, &[("trainer", "t1")], &[]);
    let (http, token) = (tb.hub_http.clone(), token(&tb));
    let handles: Vec<_> = (1..=4)
        .map(|k| {
            let (http, token, path) = (http.clone(), token.clone(), tb.steps[k].clone());
            std::thread::spawn(move || post_to(&http, &token, &json!({"path": path})))
        })
        .collect();
    let answers: Vec<(u16, Value)> = handles
        .into_iter()
        .map(|h| h.join().expect("publisher"))
        .collect();
    let (_, listed) = http_request(&tb.hub_http, "GET", "/v1/versions", None, None);
    let listed: Value = serde_json::from_str(&listed).expect("JSON");
    let digest_of = |v: u64| -> String {
        listed["versions"]
            .as_array()
            .expect("versions")
            .iter()
            .find(|x| x["version"] == v)
            .and_then(|x| x["digest"].as_str())
            .expect("listed")
            .to_owned()
    };
    let mut versions = Vec::new();
    for (s, v) in &answers {
        assert_eq!(*s, 201, "{v}");
        let version = v["version"].as_u64().expect("version");
        assert_eq!(
            v["digest"].as_str(),
            Some(digest_of(version).as_str()),
            "version {version}'s answer carries another version's digest"
        );
        versions.push(version);
    }
    versions.sort_unstable();
    assert_eq!(versions, vec![1, 2, 3, 4]);
}

#[test]
fn a_handed_over_checkpoint_is_taken_and_a_refused_one_given_back() {
    let mut tb = Testbed::new(2, 23, &[("actor", "a1"), ("trainer", "t1")], &[]);
    let dl = tb.deadline;
    let a1 = tb.actor("a1", &[]);
    wait_for(&a1, "active 0 ", dl);
    let dir: PathBuf = tb.steps[0].parent().expect("ckpt dir").to_owned();
    let one = Checkpoint::open(&tb.steps[1]).expect("open");
    let mut bad = one.read_all().expect("read");
    bad.values_mut().next().expect("a tensor")[0] = 0x7fc0; // NaN

    // Refused: the file goes back to its name, byte for byte, and nothing is sent.
    let nan_path = dir.join("nan.safetensors");
    write(&nan_path, &one, &bad);
    let nan_bytes = std::fs::read(&nan_path).expect("read");
    refused(
        &tb,
        json!({"path": nan_path, "handover": true}),
        422,
        "nonfinite_weights",
    );
    assert_eq!(std::fs::read(&nan_path).expect("given back"), nan_bytes);

    // Accepted: taken (the trainer's name is gone), and it reaches the actor bit for bit.
    let line1 = tb.active_line(1);
    let (s, v) = post_version(&tb, &json!({"path": tb.steps[1], "handover": true}));
    assert_eq!((s, v["handed_over"].as_bool()), (201, Some(true)), "{v}");
    assert!(!tb.steps[1].exists(), "the hub took the file");
    assert_eq!(next_event(&a1, dl), line1);

    // Another hard link to it: copied, not taken; without "handover", always copied.
    let twin = dir.join("twin.safetensors");
    std::fs::hard_link(&tb.steps[2], &twin).expect("link");
    let (s, v) = post_version(&tb, &json!({"path": tb.steps[2], "handover": true}));
    assert_eq!((s, v["handed_over"].as_bool()), (201, Some(false)), "{v}");
    assert!(tb.steps[2].exists() && twin.exists());
    assert_eq!(next_event(&a1, dl), tb.active_line(2));
    let (s, v) = post_version(&tb, &json!({"path": nan_path, "allow": ["nonfinite"]}));
    assert_eq!((s, v["handed_over"].as_bool()), (201, Some(false)), "{v}");
    assert!(nan_path.exists());
}

/// `/v1/status`'s `newest_version_finite`: whether the next publish checks only its changed
/// elements for NaN and ±Inf.
fn newest_finite(tb: &Testbed) -> bool {
    let (_, text) = http_request(&tb.hub_http, "GET", "/v1/status", None, None);
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON: {text}"));
    v["newest_version_finite"]
        .as_bool()
        .unwrap_or_else(|| panic!("no newest_version_finite: {v}"))
}

/// Waits for `newest_version_finite` to read `want` (the status is rebuilt at most twice a
/// second).
fn wait_newest_finite(tb: &Testbed, want: bool) {
    let t0 = std::time::Instant::now();
    while newest_finite(tb) != want {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "newest_version_finite never became {want}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_nan_step_on_a_finite_version_is_refused_by_the_diff_and_never_committed() {
    let mut tb = Testbed::new(3, 24, &[("actor", "a1"), ("trainer", "t1")], &[]);
    let dl = tb.deadline;
    let a1 = tb.actor("a1", &[]);
    wait_for(&a1, "active 0 ", dl);
    // After a start the hub scans its newest version in the background; once that is done
    // (the status says so) a publish checks only the elements it changes.
    wait_newest_finite(&tb, true);
    let (s, v) = post_version(&tb, &json!({"path": tb.steps[1]}));
    assert_eq!((s, v["version"].as_u64()), (201, Some(1)), "{v}");
    assert_eq!(v["nonfinite_check"], "changed_elements", "{v}");
    assert_eq!(next_event(&a1, dl), tb.active_line(1));

    let dir: PathBuf = tb.steps[0].parent().expect("ckpt dir").to_owned();
    let two = Checkpoint::open(&tb.steps[2]).expect("open");
    let mut bad = two.read_all().expect("read");
    let victim = bad.keys().last().expect("a tensor").clone();
    let t = bad.get_mut(&victim).expect("tensor");
    let n = t.len();
    t[n - 1] = 0x7fc0; // NaN
    t[n - 2] = 0xffc1; // NaN, other sign and payload
    t[0] = 0x7f80; // +Inf
    let nan_path = dir.join("nan-2.safetensors");
    write(&nan_path, &two, &bad);
    let (s, v) = post_version(&tb, &json!({"path": nan_path, "handover": true}));
    assert_eq!(
        (s, v["code"].as_str()),
        (422, Some("nonfinite_weights")),
        "{v}"
    );
    let m = v["message"].as_str().expect("message");
    assert!(m.contains(&format!("{victim} (2 NaN, 1 ±Inf)")), "{m}");
    assert!(nan_path.exists(), "a refused handover is given back");
    assert!(
        newest_finite(&tb),
        "version 1 is still the newest, and finite"
    );

    // Whatever of it went out was dropped: the actor's next version is the good step 2,
    // numbered 2, with its own digest. An actor that had staged some of the refused one's
    // segments drops them when version 2 comes with another delta id (`refetch 2`).
    let (s, v) = post_version(&tb, &json!({"path": tb.steps[2]}));
    assert_eq!((s, v["version"].as_u64()), (201, Some(2)), "{v}");
    assert_eq!(v["nonfinite_check"], "changed_elements", "{v}");
    let mut line = next_event(&a1, dl);
    if line == "refetch 2" {
        line = next_event(&a1, dl);
    }
    assert_eq!(
        line,
        tb.active_line(2),
        "the refused version was never committed"
    );
    // A NaN step allowed on purpose makes the newest version unknown: the next NaN step is
    // found by the scan of every element, before anything is sent, and the next good one is
    // scanned whole.
    let (s, v) = post_version(&tb, &json!({"path": nan_path, "allow": ["nonfinite"]}));
    assert_eq!((s, v["version"].as_u64()), (201, Some(3)), "{v}");
    assert_eq!(v["nonfinite_check"], "allowed", "{v}");
    wait_newest_finite(&tb, false);
    wait_for(&a1, "active 3 ", dl);
    while tb.hub_out.recv_timeout(Duration::from_millis(200)).is_ok() {}
    let mut worse = bad.clone();
    worse.get_mut(&victim).expect("tensor")[1] = 0x7fc0;
    let worse_path = dir.join("nan-3.safetensors");
    write(&worse_path, &two, &worse);
    let m = refused(&tb, json!({"path": worse_path}), 422, "nonfinite_weights");
    assert!(m.contains(&format!("{victim} (3 NaN, 1 ±Inf)")), "{m}");
    let (s, v) = post_version(&tb, &json!({"path": tb.steps[1]}));
    assert_eq!((s, v["version"].as_u64()), (201, Some(4)), "{v}");
    assert_eq!(v["nonfinite_check"], "every_element", "{v}");
    wait_newest_finite(&tb, true);
}

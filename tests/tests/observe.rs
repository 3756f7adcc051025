//! Watching a run from outside, with real processes: a hub, a region with a relay and two
//! actors on the built-in engine, a trainer. What the hub's `/v1/status` says is checked
//! against what a real headless Chromium shows on the dashboard (driven over WebDriver by
//! `chromedriver`), live as a new version propagates; every binary's `/metrics` passes
//! `promtool check metrics`; the hub's JSON logs parse line by line; the HTTP
//! listeners answer bad input with JSON errors, and idle event-stream clients hold nothing up.
//!
//! Chromium, chromedriver and promtool are Debian packages that `scripts/test.sh` installs
//! (as root) and then requires (`STARLING_REQUIRE_BROWSER=1`, `STARLING_REQUIRE_PROMTOOL=1`):
//! run alone without them, those parts are skipped with the reason printed.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use base64::Engine as _;
use serde_json::{Value, json};
use starling_telemetry::http_client::{self, Limits};
use starling_tests::{Testbed, http_get, http_request, metric, wait_for};

/// The cluster: hub (JSON logs), relay `eu` (HTTP), actors `eu-a1`, `eu-a2`
/// (built-in engine, HTTP), trainer `t1`.
struct Cluster {
    tb: Testbed,
    relay_http: String,
    actor_http: Vec<(String, String)>,
    /// Each actor's stdout, kept open (an actor whose stdout closes dies writing to it).
    _actors: Vec<mpsc::Receiver<String>>,
    _relay_out: mpsc::Receiver<String>,
}

fn cluster() -> Cluster {
    let peers = [
        ("relay", "eu"),
        ("actor", "eu-a1"),
        ("actor", "eu-a2"),
        ("trainer", "t1"),
    ];
    let hub_args = ["--log-format", "json"];
    let mut tb = Testbed::with_model("tiny", 1e-4, 4, 5, &peers, &[], &hub_args);
    let (addr, relay_out) = tb.relay_with("eu", &["--http", "127.0.0.1:0"]);
    let relay_http = tb.relay_http["eu"].clone();
    let mut actors = Vec::new();
    let mut actor_http = Vec::new();
    for name in ["eu-a1", "eu-a2"] {
        let rx = tb.actor_with(
            name,
            &[format!("eu@{addr}")],
            &[
                "--engine",
                "builtin",
                "--region",
                "eu",
                "--http",
                "127.0.0.1:0",
            ],
        );
        let http = wait_for(&rx, "http on ", tb.deadline)["http on ".len()..].to_owned();
        actor_http.push((name.to_owned(), http));
        actors.push(rx);
    }
    Cluster {
        tb,
        relay_http,
        actor_http,
        _actors: actors,
        _relay_out: relay_out,
    }
}

/// Polls the hub's status until `pred` holds; returns that status.
fn status_until(tb: &Testbed, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
    loop {
        let s = tb.hub_status();
        if pred(&s) {
            return s;
        }
        assert!(Instant::now() < tb.deadline, "{what}; last status: {s}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Whether every actor in `status` is active at `version`.
fn all_active(status: &Value, version: u64, actors: usize) -> bool {
    let a = status["actors"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    a.len() == actors && a.iter().all(|a| a["active_version"] == version)
}

#[test]
fn the_dashboard_shows_what_the_status_says_and_every_exporter_is_valid() {
    let c = cluster();
    let tb = &c.tb;
    tb.publish(1);
    let status = status_until(tb, "both actors active at 1", |s| all_active(s, 1, 2));

    // The status, from outside: the region, its relay and actors, the version's propagation.
    assert_eq!(status["role"], "hub");
    assert_eq!(status["version"], 1);
    // The seed's full-checkpoint anchor, written in the background after the start.
    status_until(tb, "the seed's anchor", |s| s["newest_anchor"] == 0);
    let regions = status["regions"].as_array().expect("regions");
    assert_eq!(regions.len(), 1, "{status}");
    assert_eq!(regions[0]["region"], "eu");
    assert_eq!(regions[0]["relays"][0]["name"], "eu");
    assert_eq!(regions[0]["relays"][0]["connected"], true);
    assert_eq!(regions[0]["actors"], json!(["eu-a1", "eu-a2"]));
    let v1 = &status["versions"][0];
    assert_eq!(v1["version"], 1);
    assert!(v1["bytes"].as_u64().is_some_and(|b| b > 0), "{v1}");
    assert!(v1["ratio"].as_f64().is_some_and(|r| r > 1.0), "{v1}");
    for a in v1["actors"].as_array().expect("actors") {
        assert!(a["active_at_ms"].is_u64(), "{a}");
    }
    // Which codec set version 1 was encoded with, and why (the default policy is auto).
    let codecs = &status["codecs"];
    assert_eq!(codecs["policy"], "auto", "{codecs}");
    assert_eq!(codecs["version"], 1, "{codecs}");
    assert!(
        codecs["chosen"] == "small" || codecs["chosen"] == "fast",
        "{codecs}"
    );
    assert!(
        codecs["why"]
            .as_str()
            .is_some_and(|w| w.starts_with("auto: ")),
        "{codecs}"
    );
    assert_eq!(
        codecs["estimates"].as_array().map(Vec::len),
        Some(2),
        "{codecs}"
    );
    for a in status["actors"].as_array().expect("actors") {
        assert_eq!(a["connected"], true, "{a}");
        assert_eq!(a["behind"], 0, "{a}");
        assert_eq!(a["source"], "relay", "{a}");
    }
    // The relay's and actors' own status agree.
    let relay: Value = serde_json::from_str(&http_get(&c.relay_http, "/v1/status")).expect("json");
    assert_eq!(
        (relay["role"].clone(), relay["version"].clone()),
        (json!("relay"), json!(1))
    );
    assert_eq!(relay["hub"]["connected"], true);
    // Each process stamps the moment it cached, staged or activated a version itself, so a
    // benchmark need not poll fast to time it: the stamps fall within this test's run.
    let within_run = |v: &Value, at: &Value| {
        let (at, now) = (at.as_u64(), v["now_ms"].as_u64());
        assert!(
            at.zip(now)
                .is_some_and(|(at, now)| at <= now && now - at < 600_000),
            "{v}"
        );
    };
    assert_eq!(relay["cached_version"], 1, "{relay}");
    within_run(&relay, &relay["cached_at_ms"]);
    // Received whole, then verified and cached.
    assert_eq!(relay["received_version"], 1, "{relay}");
    within_run(&relay, &relay["received_at_ms"]);
    assert!(
        relay["received_at_ms"].as_u64() <= relay["cached_at_ms"].as_u64(),
        "{relay}"
    );
    for (name, http) in &c.actor_http {
        let a: Value = serde_json::from_str(&http_get(http, "/v1/status")).expect("json");
        assert_eq!(a["name"], name.as_str());
        assert_eq!(a["active_version"], 1, "{a}");
        within_run(&a, &a["active_at_ms"]);
        assert_eq!(a["staged_version"], Value::Null, "{a}");
        assert_eq!(a["newest_staged_version"], 1, "{a}");
        within_run(&a, &a["newest_staged_at_ms"]);
        assert_eq!(a["source"]["kind"], "relay", "{a}");
        assert_eq!(a["worker_connected"], true, "{a}");
        // How long staging version 1 took here, which the actor reports to the hub.
        let st = &a["staging"];
        assert_eq!(st["version"], 1, "{a}");
        assert!(st["changes"].as_u64().is_some_and(|c| c > 0), "{a}");
        assert!(st["busy_ms"].as_f64().is_some_and(|b| b > 0.0), "{a}");
        assert!(st["ns_per_change"].as_f64().is_some_and(|n| n > 0.0), "{a}");
    }

    each_component_counts_what_it_did(&c);
    promtool_checks_every_exporter(&c);
    dashboard_follows_the_status(tb);
    the_codec_choice_stages_as_the_slowest_actor_reported(&c);
    hub_logs_are_json_lines(tb);
}

/// Each actor reports how long its staging of a version took (`StagingTime`); the next
/// version's codec choice predicts staging from the slowest actor's report, and says whose.
fn the_codec_choice_stages_as_the_slowest_actor_reported(c: &Cluster) {
    let tb = &c.tb;
    let current = tb.hub_status()["version"].as_u64().expect("version");
    // The slower actor's figure for the version they all hold, as each reports it itself.
    let reported: Vec<(String, f64)> = c
        .actor_http
        .iter()
        .map(|(name, http)| {
            let a: Value = serde_json::from_str(&http_get(http, "/v1/status")).expect("json");
            assert_eq!(a["staging"]["version"], current, "{a}");
            (
                name.clone(),
                a["staging"]["ns_per_change"]
                    .as_f64()
                    .expect("ns per change"),
            )
        })
        .collect();
    let (slowest, ns) = reported
        .iter()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .cloned()
        .expect("actors");
    let next = current as usize + 1;
    assert!(next < tb.steps.len(), "the test bed holds version {next}");
    tb.publish(next);
    let status = status_until(tb, "the next version active everywhere", |s| {
        all_active(s, next as u64, 2)
    });
    let codecs = &status["codecs"];
    let from = &codecs["staging_from"];
    assert_eq!(
        from["actor"],
        slowest.as_str(),
        "{codecs}; reported {reported:?}"
    );
    assert_eq!(from["version"], current, "{codecs}");
    let set = from["set"].as_str().expect("set");
    let hub_ns = from["ns_per_change"][set].as_f64().expect("ns per change");
    assert!(
        (hub_ns - ns).abs() <= 0.1,
        "{codecs}; reported {reported:?}"
    );
    assert!(
        codecs["why"]
            .as_str()
            .is_some_and(|w| w.contains(&format!("slowest actor, {slowest}, reported it"))),
        "{codecs}"
    );
}

/// With version 1 active everywhere, each component's `/metrics` counts what it did itself:
/// the relay staged version 1 once (counted when it verified it, not by its actors), each
/// actor staged and applied it once, the hub sent it to the relay, and the relay and the actors
/// measured their control round trips.
fn each_component_counts_what_it_did(c: &Cluster) {
    let tb = &c.tb;
    // The value of `series` in the `/metrics` of `http` once `pred` holds of it.
    let once = |http: &str, series: &str, pred: &dyn Fn(f64) -> bool| loop {
        let text = http_get(http, "/metrics");
        let v = metric(&text, series);
        if let Some(v) = v.filter(|&v| pred(v)) {
            return v;
        }
        assert!(
            Instant::now() < tb.deadline,
            "{series} = {v:?} at {http}:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let positive = |v: f64| v > 0.0;
    let relay = c.relay_http.as_str();
    // The relay reports `Staged` to the hub after counting it, and actors may be active first.
    let staged = once(relay, "starling_relay_versions_staged_total", &positive);
    assert_eq!(staged, 1.0, "the relay staged version 1 once");
    assert_eq!(once(relay, "starling_relay_newest_version", &positive), 1.0);
    assert_eq!(
        once(relay, "starling_relay_transfer_seconds_count", &positive),
        1.0
    );
    once(relay, "starling_relay_upstream_connected", &positive);
    once(relay, "starling_relay_control_rtt_seconds_count", &positive);
    once(
        relay,
        "starling_relay_delta_received_segments_total{peer=\"hub\"}",
        &positive,
    );
    for (name, http) in &c.actor_http {
        let sent = format!("starling_relay_delta_sent_segments_total{{peer=\"{name}\"}}");
        once(relay, &sent, &positive);
        for (series, want) in [
            ("starling_actor_versions_staged_total", 1.0),
            ("starling_actor_apply_seconds_count", 1.0),
            ("starling_actor_active_version", 1.0),
            ("starling_actor_worker_connected", 1.0),
        ] {
            assert_eq!(once(http, series, &positive), want, "{name}: {series}");
        }
        once(http, "starling_actor_control_rtt_seconds_count", &positive);
        let from_relay = "starling_actor_delta_received_segments_total{peer=\"eu\"}";
        once(http, from_relay, &positive);
    }
    let hub = tb.hub_http.as_str();
    assert_eq!(once(hub, "starling_hub_published_version", &positive), 1.0);
    once(
        hub,
        "starling_hub_delta_sent_segments_total{peer=\"eu\"}",
        &positive,
    );
    once(
        hub,
        "starling_hub_connected_peers{role=\"relay\"}",
        &positive,
    );
}

/// `promtool check metrics` on the live `/metrics` of the hub, the relay and each actor.
fn promtool_checks_every_exporter(c: &Cluster) {
    let Some(promtool) = required_tool("promtool", "STARLING_REQUIRE_PROMTOOL") else {
        return;
    };
    let mut targets = vec![
        ("hub", c.tb.hub_http.clone()),
        ("relay", c.relay_http.clone()),
    ];
    targets.extend(c.actor_http.iter().map(|(_, h)| ("actor", h.clone())));
    for (component, http) in targets {
        let text = http_get(&http, "/metrics");
        assert!(
            text.contains(&format!("starling_{component}_")),
            "{component}'s families carry its prefix:\n{text}"
        );
        let mut child = Command::new(&promtool)
            .args(["check", "metrics"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run promtool");
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(text.as_bytes())
            .expect("feed promtool");
        let out = child.wait_with_output().expect("promtool finishes");
        assert!(
            out.status.success(),
            "promtool check metrics on the {component} at {http}: {}{}\n{text}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// The dashboard in a real headless Chromium: each actor's version and the region as the
/// status has them, then the page follows a new version live (no reload); a screenshot is
/// saved (`STARLING_DASHBOARD_SCREENSHOT`, else the test's temporary directory).
fn dashboard_follows_the_status(tb: &Testbed) {
    let Some(driver) = required_tool("chromedriver", "STARLING_REQUIRE_BROWSER") else {
        return;
    };
    let browser = Browser::start(&driver, tb.deadline);
    browser.open(&format!("http://{}/", tb.hub_http));
    let page = browser.wait_for_page(tb, 1);
    assert_eq!(page["regions"], json!(["eu"]), "{page}");

    // Live: a new version reaches the actors and the open page shows it.
    tb.publish(2);
    status_until(tb, "both actors active at 2", |s| all_active(s, 2, 2));
    let page = browser.wait_for_page(tb, 2);
    assert_eq!(page["hub"], "2", "{page}");
    // The codec set the status names, with the policy.
    let codecs = &tb.hub_status()["codecs"];
    assert_eq!(
        page["codecs"],
        format!("{} (auto)", codecs["chosen"].as_str().unwrap_or("?")),
        "{page} {codecs}"
    );

    let shot = std::env::var_os("STARLING_DASHBOARD_SCREENSHOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| tb.root.join("dashboard.png"));
    let png = browser.screenshot();
    assert_eq!(&png[1..4], b"PNG", "a PNG screenshot");
    std::fs::write(&shot, &png).expect("write the screenshot");
    println!("dashboard screenshot: {}", shot.display());
}

/// Every line the hub logged (stderr, `--log-format json`) is a JSON object with a level and
/// a message; the publishes (of versions 1 to 3) are there, inside their `publish` spans.
fn hub_logs_are_json_lines(tb: &Testbed) {
    let lines: Vec<String> = tb.hub_log.try_iter().collect();
    assert!(!lines.is_empty(), "the hub logged nothing");
    let mut published = false;
    for line in &lines {
        let v: Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("a log line that is not JSON ({e}): {line}"));
        assert!(
            v["level"].is_string() && v["timestamp"].is_string(),
            "{line}"
        );
        assert!(v["fields"]["message"].is_string(), "{line}");
        if v["fields"]["message"] == "published" && v["span"]["name"] == "publish" {
            assert!(
                v["span"]["version"]
                    .as_u64()
                    .is_some_and(|v| (1..=3).contains(&v)),
                "{line}"
            );
            assert!(v["fields"]["bytes"].is_u64(), "{line}");
            published = true;
        }
    }
    assert!(published, "no `published` event in:\n{}", lines.join("\n"));
}

/// The tool's path, or `None` (skipped, saying why) when it is missing and not required.
fn required_tool(name: &str, require_var: &str) -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    });
    if found.is_none() {
        assert!(
            std::env::var_os(require_var).is_none(),
            "{name} is required ({require_var} is set) but not on PATH"
        );
        eprintln!("SKIPPED: {name} is not installed (scripts/test.sh installs it as root)");
    }
    found
}

/// A headless Chromium under `chromedriver`, spoken to over WebDriver (plain HTTP + JSON).
struct Browser {
    driver: Child,
    addr: String,
    session: String,
}

impl Browser {
    fn start(driver: &Path, deadline: Instant) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let child = Command::new(driver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver");
        let addr = format!("127.0.0.1:{port}");
        while TcpStream::connect(&addr).is_err() {
            assert!(Instant::now() < deadline, "chromedriver did not listen");
            std::thread::sleep(Duration::from_millis(50));
        }
        let mut b = Browser {
            driver: child,
            addr,
            session: String::new(),
        };
        let caps = json!({"capabilities": {"alwaysMatch": {"goog:chromeOptions": {
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", "--window-size=1440,1400"]
        }}}});
        let v = b.call("POST", "/session", Some(&caps));
        b.session = v["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no WebDriver session: {v}"))
            .to_owned();
        b
    }

    /// One WebDriver command.
    fn call(&self, method: &str, path: &str, body: Option<&Value>) -> Value {
        let body = body.map(Value::to_string);
        let r = http_client::request(
            &self.addr,
            method,
            path,
            &[],
            body.as_deref(),
            Limits::timeout(Duration::from_secs(120)),
        )
        .unwrap_or_else(|e| {
            panic!(
                "WebDriver {method} {path}: {}",
                starling_process::error_chain(&e)
            )
        });
        let v: Value = serde_json::from_str(&r.body).unwrap_or(Value::String(r.body));
        assert!(r.status == 200, "WebDriver {method} {path}: {v}");
        v
    }

    fn open(&self, url: &str) {
        self.call(
            "POST",
            &format!("/session/{}/url", self.session),
            Some(&json!({"url": url})),
        );
    }

    /// What the page shows: `hub` version, `regions`, and each actor's active version.
    fn page(&self) -> Value {
        let script = "const t = e => e ? e.textContent.trim() : null;\
            return {hub: t(document.querySelector('#hub-version')),\
              codecs: t(document.querySelector('#codecs')),\
              regions: [...document.querySelectorAll('[data-region]')].map(e => e.dataset.region),\
              actors: Object.fromEntries([...document.querySelectorAll('[data-actor]')]\
                .map(e => [e.dataset.actor, t(e.querySelector('[data-field=active_version]'))]))};";
        let v = self.call(
            "POST",
            &format!("/session/{}/execute/sync", self.session),
            Some(&json!({"script": script, "args": []})),
        );
        v["value"].clone()
    }

    /// Polls the page until it shows what the hub's status says, with every actor at
    /// `version`; returns the page.
    fn wait_for_page(&self, tb: &Testbed, version: u64) -> Value {
        loop {
            let status = tb.hub_status();
            let want: serde_json::Map<String, Value> = status["actors"]
                .as_array()
                .expect("actors")
                .iter()
                .map(|a| {
                    let name = a["name"].as_str().expect("name").to_owned();
                    (name, json!(a["active_version"].to_string()))
                })
                .collect();
            let page = self.page();
            let matches = page["actors"] == Value::Object(want.clone())
                && want.values().all(|v| *v == json!(version.to_string()));
            if matches {
                return page;
            }
            assert!(
                Instant::now() < tb.deadline,
                "the page shows {page}, the status says {want:?}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn screenshot(&self) -> Vec<u8> {
        let v = self.call(
            "GET",
            &format!("/session/{}/screenshot", self.session),
            None,
        );
        base64::engine::general_purpose::STANDARD
            .decode(v["value"].as_str().expect("base64 PNG"))
            .expect("decode the screenshot")
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if !self.session.is_empty() {
            // Closes the browser; a failure here leaves only processes killed just below.
            let path = format!("/session/{}", self.session);
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.call("DELETE", &path, None)
            }));
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

/// Sends `raw` as the whole request and returns the status code and body (for requests the
/// helpers cannot make: a declared body far over the limit). Bytes by hand on purpose, like
/// the event-stream clients below: these test the server against what no well-behaved client
/// sends (a length it never delivers, a stream it never reads).
fn raw_request(addr: &str, raw: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    s.write_all(raw.as_bytes()).expect("send");
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let out = String::from_utf8_lossy(&out).into_owned();
    let (head, body) = out.split_once("\r\n\r\n").expect("an HTTP answer");
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("status code");
    (status, body.to_owned())
}

#[test]
fn bad_http_input_gets_json_errors_and_idle_event_clients_hold_nothing_up() {
    let peers = [("trainer", "t1")];
    let tb = Testbed::with_model("tiny", 1e-4, 2, 9, &peers, &[], &[]);
    let http = &tb.hub_http;
    let token = starling_transport::identity::load_trainer_token(&tb.root.join("t1"))
        .expect("trainer token");
    let json_error = |(status, body): (u16, String), want_status: u16, want_code: &str| {
        let v: Value =
            serde_json::from_str(&body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"));
        assert_eq!(
            (status, v["code"].as_str()),
            (want_status, Some(want_code)),
            "{v}"
        );
        assert!(v["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    };
    json_error(
        http_request(http, "GET", "/nope", None, None),
        404,
        "not_found",
    );
    json_error(
        http_request(http, "DELETE", "/v1/status", None, None),
        405,
        "method_not_allowed",
    );
    json_error(
        http_request(http, "GET", "/v1/status?versions=many", None, None),
        400,
        "bad_request",
    );
    json_error(
        http_request(http, "GET", "/v1/status?version=1", None, None),
        400,
        "bad_request",
    );
    json_error(
        http_request(
            http,
            "GET",
            "/v1/batches/1/results?limit=-3",
            Some(&token),
            None,
        ),
        400,
        "bad_request",
    );
    // A body declared far over the limit is refused before it is read.
    let huge = format!(
        "POST /v1/batches HTTP/1.1\r\nHost: {http}\r\nAuthorization: Bearer {token}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{{",
        1u64 << 30
    );
    json_error(raw_request(http, &huge), 413, "too_large");

    // Clients that open the event stream and never read: the hub keeps serving everyone.
    // One stream short of the hub's bound on open event streams (32, docs/api.md "Bounds").
    let idle: Vec<TcpStream> = (0..EVENT_STREAMS - 1)
        .map(|_| {
            let mut s = TcpStream::connect(http).expect("connect");
            write!(s, "GET /v1/events HTTP/1.1\r\nHost: {http}\r\n\r\n").expect("send");
            s
        })
        .collect();
    tb.publish(1);
    tb.publish(2);
    let started = Instant::now();
    let status = status_until(&tb, "version 2 published", |s| s["version"] == 2);
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "status took {:?}",
        started.elapsed()
    );
    assert_eq!(status["versions"].as_array().map(Vec::len), Some(2));
    // A new client still gets the stream: `hello`, then the events as they happen.
    let mut s = TcpStream::connect(http).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    write!(s, "GET /v1/events HTTP/1.1\r\nHost: {http}\r\n\r\n").expect("send");
    let mut got = String::new();
    let mut buf = [0u8; 4096];
    while !got.contains("event: hello") {
        let n = s.read(&mut buf).expect("read the event stream");
        assert!(n > 0, "the stream ended: {got}");
        got.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    assert!(got.contains("content-type: text/event-stream"), "{got}");
    assert!(got.contains("\"version\":2"), "{got}");
    // One stream more than the bound is refused, saying why, and the streams do not take the
    // connection slots the trainer's requests need: the token-checked API still answers.
    json_error(
        http_request(http, "GET", "/v1/events", None, None),
        503,
        "too_many_streams",
    );
    let (code, body) = http_request(http, "GET", "/v1/batches/1", Some(&token), None);
    assert!(code == 200 || code == 404, "{code} {body}");
    drop(idle);
}

/// The hub's bound on `/v1/events` streams open at once (`hub/src/status.rs`).
const EVENT_STREAMS: usize = 32;

//! Runs the `starling-netem` binary: `--help`, a relayed echo on
//! 127.0.0.1, and a graceful stop on SIGTERM that prints the counters.

use std::io::{BufRead, BufReader, Read};
use std::net::{SocketAddr, UdpSocket};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_starling-netem");

/// Kills the child on drop unless it already exited, so no test leaks it.
struct Reaper(Child);

impl Drop for Reaper {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

#[test]
fn help_teaches_flags_units_and_limits() {
    let out = Command::new(BIN)
        .arg("--help")
        .output()
        .expect("run --help");
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "--rate",
        "--down-delay",
        "100mbit",
        "0.1%",
        "64KiB",
        "tc tbf",
        "SIGTERM",
    ] {
        assert!(help.contains(needle), "--help lacks {needle:?}:\n{help}");
    }
}

#[test]
fn bad_units_fail_with_a_hint() {
    let out = Command::new(BIN)
        .args(["--listen", "127.0.0.1:0", "--upstream", "127.0.0.1:9"])
        .args(["--rate", "100mbps"])
        .output()
        .expect("run");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("ambiguous"));
}

#[test]
fn relays_and_stops_gracefully_on_sigterm() {
    let upstream = UdpSocket::bind("127.0.0.1:0").expect("bind upstream");
    upstream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let upstream_addr = upstream.local_addr().expect("addr");
    let child = Command::new(BIN)
        .args(["--listen", "127.0.0.1:0", "--upstream"])
        .arg(upstream_addr.to_string())
        .args(["--delay", "5ms", "--rate", "10mbit", "--loss", "0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn starling-netem");
    let mut child = Reaper(child);
    let mut stdout = BufReader::new(child.0.stdout.take().expect("stdout"));
    let mut first = String::new();
    stdout.read_line(&mut first).expect("first line");
    let listen: SocketAddr = first
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {first:?}"))
        .parse()
        .expect("address");

    let client = UdpSocket::bind("127.0.0.1:0").expect("bind client");
    client
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut buf = [0u8; 64];
    for i in 0..3u8 {
        client.send_to(&[i; 10], listen).expect("send");
        let (n, peer) = upstream.recv_from(&mut buf).expect("relayed within 5 s");
        assert_eq!(&buf[..n], &[i; 10]);
        upstream.send_to(&buf[..n], peer).expect("reply");
        let (n, from) = client.recv_from(&mut buf).expect("reply within 5 s");
        assert_eq!((from, &buf[..n]), (listen, &[i; 10][..]));
    }

    let status = Command::new("kill")
        .args(["-TERM", &child.0.id().to_string()])
        .status()
        .expect("run kill");
    assert!(status.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    let exit = loop {
        if let Some(exit) = child.0.try_wait().expect("try_wait") {
            break exit;
        }
        assert!(Instant::now() < deadline, "no exit within 10 s of SIGTERM");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(exit.success(), "exit status {exit}");
    let mut rest = String::new();
    stdout.read_to_string(&mut rest).expect("rest of stdout");
    assert!(rest.contains("final counters"), "{rest}");
    assert!(
        rest.contains("in 3 pkts (30B), delivered 3 pkts (30B)"),
        "{rest}"
    );
    assert!(rest.contains("clients: 1"), "{rest}");
    UdpSocket::bind(listen).expect("port released after exit");
}

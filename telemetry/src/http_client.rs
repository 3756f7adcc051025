//! A small blocking HTTP/1.1 client for the local JSON APIs Starling's processes call: the
//! trainer calling its hub's API, an actor driving the vLLM server beside it.
//!
//! One TCP connection per request (`Connection: close`): these callers make a handful of
//! requests per step, so connection reuse would save nothing measurable, and a dependency-free
//! client keeps the builds small. Bodies with `Content-Length`, read to EOF, or chunked are
//! all read; the caller interprets status and body.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// Why a request got no HTTP answer.
#[derive(Debug, thiserror::Error)]
pub enum HttpClientError {
    #[error("cannot reach {addr}")]
    Unreachable {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("malformed HTTP answer from {addr}: {detail}")]
    Malformed { addr: String, detail: String },
}

/// A response: its status and body (as text; the APIs called here answer JSON).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub body: String,
}

impl Response {
    pub fn ok(&self) -> bool {
        (200..300).contains(&self.status)
    }
}

/// Sends `method path` to `addr` (`host:port`) with `headers` and a JSON `body`, and waits up
/// to `timeout` for each read of the answer.
pub fn request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
    timeout: Duration,
) -> Result<Response, HttpClientError> {
    let io = |source| HttpClientError::Unreachable {
        addr: addr.to_owned(),
        source,
    };
    let mut s = TcpStream::connect(addr).map_err(io)?;
    s.set_read_timeout(Some(timeout)).map_err(io)?;
    s.set_write_timeout(Some(timeout)).map_err(io)?;
    let payload = body.unwrap_or_default();
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n",
        payload.len()
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).map_err(io)?;
    s.write_all(payload.as_bytes()).map_err(io)?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).map_err(io)?;
    parse_response(&raw).map_err(|detail| HttpClientError::Malformed {
        addr: addr.to_owned(),
        detail,
    })
}

/// Status and body of a complete `Connection: close` response (`Content-Length` or read to EOF;
/// chunked bodies are decoded).
fn parse_response(raw: &[u8]) -> Result<Response, String> {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("no header terminator")?;
    let head = String::from_utf8_lossy(&raw[..split]);
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or_else(|| format!("status line of {head:?}"))?;
    let chunked = lines.any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    let body = &raw[split + 4..];
    let body = if chunked {
        dechunk(body)?
    } else {
        body.to_vec()
    };
    Ok(Response {
        status,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

fn dechunk(mut b: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        let eol = b
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or("chunk size line")?;
        let size_text = String::from_utf8_lossy(&b[..eol]);
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
            .map_err(|_| format!("chunk size {size_text:?}"))?;
        b = &b[eol + 2..];
        if size == 0 {
            return Ok(out);
        }
        if b.len() < size + 2 {
            return Err("truncated chunk".into());
        }
        out.extend_from_slice(&b[..size]);
        b = &b[size + 2..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_plain_and_chunked_responses() {
        let r =
            parse_response(b"HTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\n{}").expect("plain");
        assert_eq!((r.status, r.body.as_str()), (201, "{}"));
        let r = parse_response(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{\"a\r\n3\r\n\":1\r\n1\r\n}\r\n0\r\n\r\n",
        )
        .expect("chunked");
        assert_eq!((r.status, r.body.as_str()), (200, "{\"a\":1}"));
        assert!(parse_response(b"garbage").is_err());
        assert!(
            parse_response(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n9\r\nab")
                .is_err()
        );
    }
}

//! Control messages over QUIC streams: length-delimited by the message framing itself
//! (`starling_proto::msg`), read with a bounded buffer.

use quinn::{RecvStream, SendStream};
use starling_proto::DecodeError;
use starling_proto::msg::{MAX_MESSAGE_BODY, Message, check};
use thiserror::Error;

/// Why a message could not be sent or received.
#[derive(Debug, Error)]
pub enum FramedError {
    #[error("stream write")]
    Write(#[from] quinn::WriteError),
    #[error("stream read")]
    Read(#[from] quinn::ReadError),
    #[error("malformed message")]
    Decode(#[from] DecodeError),
    #[error("stream ended inside a message")]
    Truncated,
}

/// Sends one message.
pub async fn send(stream: &mut SendStream, m: &Message) -> Result<(), FramedError> {
    let mut buf = Vec::with_capacity(m.encoded_len());
    m.encode(&mut buf);
    stream.write_all(&buf).await?;
    Ok(())
}

/// Reads messages from one stream.
#[derive(Debug)]
pub struct MessageReader {
    recv: RecvStream,
    buf: Vec<u8>,
}

impl MessageReader {
    pub fn new(recv: RecvStream) -> Self {
        Self {
            recv,
            buf: Vec::new(),
        }
    }

    /// The next message, or `None` when the peer finished the stream between messages.
    pub async fn next(&mut self) -> Result<Option<Message>, FramedError> {
        loop {
            if let Some(total) = check(&self.buf)? {
                let (m, n) = Message::decode(&self.buf[..total])?;
                self.buf.drain(..n);
                return Ok(Some(m));
            }
            let mut chunk = [0u8; 16 * 1024];
            match self.recv.read(&mut chunk).await? {
                Some(n) => {
                    self.buf.extend_from_slice(&chunk[..n]);
                    // check() bounds the declared length; this bounds what is buffered.
                    if self.buf.len() > MAX_MESSAGE_BODY + 16 {
                        return Err(FramedError::Decode(DecodeError::TooLarge {
                            what: "buffered message",
                            value: self.buf.len() as u64,
                            limit: MAX_MESSAGE_BODY as u64,
                        }));
                    }
                }
                None if self.buf.is_empty() => return Ok(None),
                None => return Err(FramedError::Truncated),
            }
        }
    }
}

/// A verified delta frame read from a stream, kept as its wire bytes (so a relay forwards
/// it without re-encoding or re-hashing).
#[derive(Debug, Clone)]
pub struct StreamFrame {
    pub kind: starling_proto::container::FrameKind,
    /// The whole frame: header, body, hash.
    pub bytes: Vec<u8>,
    pub hash: [u8; 32],
}

impl StreamFrame {
    pub fn body(&self) -> &[u8] {
        use starling_proto::container::{FRAME_HASH_LEN, FRAME_HEADER_LEN};
        &self.bytes[FRAME_HEADER_LEN..self.bytes.len() - FRAME_HASH_LEN]
    }

    pub fn as_frame(&self) -> starling_proto::container::Frame<'_> {
        starling_proto::container::Frame {
            kind: self.kind,
            body: self.body(),
            hash: self.hash,
        }
    }
}

/// Reads one control message and then delta frames from a data stream (a version's
/// stream starts with an `Announce` and carries that version's `.sdc` frames).
#[derive(Debug)]
pub struct DataStreamReader {
    recv: RecvStream,
    buf: Vec<u8>,
}

impl DataStreamReader {
    pub fn new(recv: RecvStream) -> Self {
        Self {
            recv,
            buf: Vec::new(),
        }
    }

    /// Reads more bytes; `false` at the end of the stream.
    async fn fill(&mut self) -> Result<bool, FramedError> {
        let mut chunk = [0u8; 64 * 1024];
        match self.recv.read(&mut chunk).await? {
            Some(n) => {
                self.buf.extend_from_slice(&chunk[..n]);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// The next raw bytes after what was parsed (for a stream that carries a file after
    /// its leading message); `None` at the end of the stream.
    pub async fn chunk(&mut self) -> Result<Option<Vec<u8>>, FramedError> {
        if !self.buf.is_empty() {
            return Ok(Some(std::mem::take(&mut self.buf)));
        }
        if self.fill().await? {
            Ok(Some(std::mem::take(&mut self.buf)))
        } else {
            Ok(None)
        }
    }

    /// The leading control message.
    pub async fn message(&mut self) -> Result<Message, FramedError> {
        loop {
            if let Some(total) = check(&self.buf)? {
                let (m, n) = Message::decode(&self.buf[..total])?;
                self.buf.drain(..n);
                return Ok(m);
            }
            if !self.fill().await? {
                return Err(FramedError::Truncated);
            }
        }
    }

    /// The next verified frame, or `None` at a clean end of the stream.
    pub async fn frame(&mut self) -> Result<Option<StreamFrame>, FramedError> {
        use starling_proto::container::{
            FRAME_HASH_LEN, FRAME_HEADER_LEN, frame_hash, parse_frame_header,
        };
        loop {
            if self.buf.len() >= FRAME_HEADER_LEN {
                let mut h = [0u8; FRAME_HEADER_LEN];
                h.copy_from_slice(&self.buf[..FRAME_HEADER_LEN]);
                let (kind, total) = parse_frame_header(&h)?;
                if self.buf.len() >= total {
                    let rest = self.buf.split_off(total);
                    let bytes = std::mem::replace(&mut self.buf, rest);
                    let mut hash = [0u8; 32];
                    hash.copy_from_slice(&bytes[total - FRAME_HASH_LEN..]);
                    if frame_hash(kind, &bytes[FRAME_HEADER_LEN..total - FRAME_HASH_LEN]) != hash {
                        return Err(FramedError::Decode(DecodeError::HashMismatch {
                            what: "streamed frame",
                        }));
                    }
                    return Ok(Some(StreamFrame { kind, bytes, hash }));
                }
            }
            if !self.fill().await? {
                return if self.buf.is_empty() {
                    Ok(None)
                } else {
                    Err(FramedError::Truncated)
                };
            }
        }
    }
}

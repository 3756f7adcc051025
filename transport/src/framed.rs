//! Control messages over QUIC streams: length-delimited by the message framing itself
//! (`starling_proto::protocol::msg`), read with a bounded buffer.

use quinn::{RecvStream, SendStream};
use starling_proto::DecodeError;
use starling_proto::protocol::msg::{MAX_MESSAGE_BODY, Message, check};
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
    /// The most bytes one message may take here (at most [`MAX_MESSAGE_BODY`]).
    limit: usize,
}

impl MessageReader {
    pub fn new(recv: RecvStream) -> Self {
        Self::with_limit(recv, MAX_MESSAGE_BODY)
    }

    /// A reader that refuses any message over `limit` bytes before buffering more than that
    /// (a server reads a peer's `Hello` this way, before it knows who the peer is).
    pub fn with_limit(recv: RecvStream, limit: usize) -> Self {
        Self {
            recv,
            buf: Vec::new(),
            limit: limit.min(MAX_MESSAGE_BODY),
        }
    }

    /// Raises or lowers the limit of [`MessageReader::with_limit`] for the messages after.
    pub fn set_limit(&mut self, limit: usize) {
        self.limit = limit.min(MAX_MESSAGE_BODY);
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
                    if self.buf.len() > self.limit + 16 {
                        return Err(FramedError::Decode(DecodeError::TooLarge {
                            what: "buffered message",
                            value: self.buf.len() as u64,
                            limit: self.limit as u64,
                        }));
                    }
                }
                None if self.buf.is_empty() => return Ok(None),
                None => return Err(FramedError::Truncated),
            }
        }
    }
}

/// What [`MessageReader::next_or_oversized`] reads.
#[derive(Debug)]
pub enum Incoming {
    /// A message within the limit.
    Message(Message),
    /// A message that declared a body over [`MAX_MESSAGE_BODY`]: its type, its declared length
    /// and the first bytes of its body (at most [`OVERSIZED_HEAD`]); the rest was read and
    /// dropped, never buffered, so the stream stays in step.
    Oversized { kind: u8, len: u64, head: Vec<u8> },
}

/// How much of an oversized message's body [`MessageReader::next_or_oversized`] keeps.
pub const OVERSIZED_HEAD: usize = 64;

impl MessageReader {
    /// As [`MessageReader::next`], but a message whose declared body is over the limit and
    /// at most `max_skip` bytes is not an error: its first bytes are kept, the rest is read
    /// and dropped in chunks, and the stream goes on with the next message (for a peer that
    /// must be told which of its messages could not be read). Longer ones, and anything
    /// malformed, are errors as with `next`.
    pub async fn next_or_oversized(
        &mut self,
        max_skip: u64,
    ) -> Result<Option<Incoming>, FramedError> {
        loop {
            if let Some((kind, len, at)) = oversized_header(&self.buf)? {
                if len > max_skip {
                    return Err(FramedError::Decode(DecodeError::TooLarge {
                        what: "message length",
                        value: len,
                        limit: max_skip,
                    }));
                }
                return self.skip_body(kind, len, at).await.map(Some);
            }
            if let Some(total) = check(&self.buf)? {
                let (m, n) = Message::decode(&self.buf[..total])?;
                self.buf.drain(..n);
                return Ok(Some(Incoming::Message(m)));
            }
            let mut chunk = [0u8; 16 * 1024];
            match self.recv.read(&mut chunk).await? {
                Some(n) => {
                    self.buf.extend_from_slice(&chunk[..n]);
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

    /// Keeps the first bytes of a body of `len` bytes starting at `at` in the buffer, and
    /// drops the rest as it arrives.
    async fn skip_body(&mut self, kind: u8, len: u64, at: usize) -> Result<Incoming, FramedError> {
        let keep = OVERSIZED_HEAD.min(usize::try_from(len).unwrap_or(usize::MAX));
        let mut chunk = [0u8; 64 * 1024];
        while self.buf.len() < at + keep {
            match self.recv.read(&mut chunk).await? {
                Some(n) => self.buf.extend_from_slice(&chunk[..n]),
                None => return Err(FramedError::Truncated),
            }
        }
        let head = self.buf[at..at + keep].to_vec();
        // Bytes of the body still to drop, after what is buffered.
        let buffered = (self.buf.len() - at) as u64;
        if buffered >= len {
            let end = at + usize::try_from(len).unwrap_or(usize::MAX);
            self.buf.drain(..end);
        } else {
            let mut left = len - buffered;
            self.buf.clear();
            while left > 0 {
                let want = chunk.len().min(usize::try_from(left).unwrap_or(usize::MAX));
                match self.recv.read(&mut chunk[..want]).await? {
                    Some(n) => left -= n as u64,
                    None => return Err(FramedError::Truncated),
                }
            }
        }
        Ok(Incoming::Oversized { kind, len, head })
    }
}

/// The type, declared body length and body offset of a message at the start of `buf` whose
/// declared length is over [`MAX_MESSAGE_BODY`]; `None` for a message within the limit or a
/// header not yet complete. An unknown type is an error, as in `check`.
fn oversized_header(buf: &[u8]) -> Result<Option<(u8, u64, usize)>, FramedError> {
    let Some(&kind) = buf.first() else {
        return Ok(None);
    };
    // The type alone: known types need more bytes, unknown ones are refused.
    check(&buf[..1])?;
    let mut r = starling_proto::wire::Reader::new(&buf[1..]);
    match r.varint("message length") {
        Ok(len) if len > MAX_MESSAGE_BODY as u64 => Ok(Some((kind, len, 1 + r.position()))),
        Ok(_) | Err(DecodeError::Truncated { .. }) => Ok(None),
        Err(e) => Err(FramedError::Decode(e)),
    }
}

/// A verified delta frame read from a stream, kept as its wire bytes (so a relay forwards
/// it without re-encoding or re-hashing).
#[derive(Debug, Clone)]
pub struct StreamFrame {
    pub kind: starling_proto::delta::container::FrameKind,
    /// The whole frame: header, body, hash.
    pub bytes: Vec<u8>,
    pub hash: [u8; 32],
}

impl StreamFrame {
    pub fn body(&self) -> &[u8] {
        use starling_proto::delta::container::{FRAME_HASH_LEN, FRAME_HEADER_LEN};
        &self.bytes[FRAME_HEADER_LEN..self.bytes.len() - FRAME_HASH_LEN]
    }

    pub fn as_frame(&self) -> starling_proto::delta::container::Frame<'_> {
        starling_proto::delta::container::Frame {
            kind: self.kind,
            body: self.body(),
            hash: self.hash,
        }
    }
}

/// The bytes of delta frames a receiver holds before its core has them, shared by every data
/// stream of one subscription. A frame takes its whole size from the budget as soon as its
/// header says how large it is, before its body is read, and gives it back when the core
/// has the frame (whose own bound on what it holds then takes over). A stream whose frame
/// does not fit waits unread, so QUIC's flow control holds its sender back: a source that
/// opens hundreds of streams, each with a frame declared large and never finished, pins at
/// most this much, not hundreds of frames' worth.
#[derive(Debug, Clone)]
pub struct ReadBudget {
    bytes: std::sync::Arc<tokio::sync::Semaphore>,
    capacity: u32,
}

/// Bytes of one frame taken from a [`ReadBudget`]; given back when dropped.
#[derive(Debug)]
pub struct BudgetHeld(#[allow(dead_code)] tokio::sync::OwnedSemaphorePermit);

impl ReadBudget {
    /// The budget of a subscription: twice the largest frame, so that the largest one fits
    /// beside the segments of the other stripes.
    pub const DEFAULT_BYTES: usize = 2 * MAX_FRAME_BYTES;

    /// A budget of `bytes` (at most 4 GiB). A frame larger than the whole budget takes all
    /// of it, so that it can still be read.
    pub fn new(bytes: usize) -> Self {
        let capacity = u32::try_from(bytes.max(1)).unwrap_or(u32::MAX);
        Self {
            bytes: std::sync::Arc::new(tokio::sync::Semaphore::new(capacity as usize)),
            capacity,
        }
    }

    /// Bytes not taken now.
    pub fn available(&self) -> usize {
        self.bytes.available_permits()
    }

    async fn take(&self, bytes: usize) -> BudgetHeld {
        let n = u32::try_from(bytes).unwrap_or(u32::MAX).min(self.capacity);
        match self.bytes.clone().acquire_many_owned(n).await {
            Ok(p) => BudgetHeld(p),
            // The semaphore is never closed, only dropped with the last handle.
            Err(_) => unreachable!("a read budget is never closed"),
        }
    }
}

/// The largest frame a stream may carry, header and hash included.
const MAX_FRAME_BYTES: usize = starling_proto::delta::container::MAX_MANIFEST_BODY + 1024;

/// Reads one control message and then delta frames from a data stream (a version's
/// stream starts with an `Announce` and carries that version's `.sdc` frames).
#[derive(Debug)]
pub struct DataStreamReader {
    recv: RecvStream,
    buf: Vec<u8>,
    budget: Option<ReadBudget>,
    /// What the frame being read took from `budget`.
    held: Option<BudgetHeld>,
}

impl DataStreamReader {
    pub fn new(recv: RecvStream) -> Self {
        Self {
            recv,
            buf: Vec::new(),
            budget: None,
            held: None,
        }
    }

    /// A reader whose frames take their bytes from `budget` before their bodies are read
    /// ([`DataStreamReader::budgeted_frame`]).
    pub fn within(recv: RecvStream, budget: ReadBudget) -> Self {
        Self {
            budget: Some(budget),
            ..Self::new(recv)
        }
    }

    /// Bytes read from the stream and not yet handed out.
    pub fn buffered(&self) -> usize {
        self.buf.len()
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

    /// Reads the rest of a frame of `total` bytes whose start is buffered, straight into a
    /// buffer of the frame's size and no further: each byte of the rest is copied once,
    /// from the stream's packets, where reading through [`DataStreamReader::fill`] (which
    /// still reads the header and the frame's first bytes, at most 64 KiB) copied it into a
    /// chunk, then into a buffer that grew by doubling (more copies and fresh pages), then
    /// split the next frame's start off. The frame's size is reserved, not touched: its
    /// pages are written only as its bytes arrive, after the header passed its bound and the
    /// budget ([`DataStreamReader::within`]) was taken. On a truncated stream the buffer holds
    /// what came.
    async fn read_rest(&mut self, total: usize) -> Result<(), FramedError> {
        if self.buf.capacity() < total {
            let mut frame = Vec::with_capacity(total);
            frame.append(&mut self.buf);
            self.buf = frame;
        }
        while self.buf.len() < total {
            match self.recv.read_chunk(total - self.buf.len(), true).await? {
                Some(chunk) => self.buf.extend_from_slice(&chunk.bytes),
                None => return Ok(()),
            }
        }
        Ok(())
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
        Ok(self.budgeted_frame().await?.map(|(frame, _)| frame))
    }

    /// As [`DataStreamReader::frame`], with what the frame took from the reader's budget
    /// (none for a reader without one): keep it until the frame is counted elsewhere.
    pub async fn budgeted_frame(
        &mut self,
    ) -> Result<Option<(StreamFrame, Option<BudgetHeld>)>, FramedError> {
        use starling_proto::delta::container::{
            FRAME_HASH_LEN, FRAME_HEADER_LEN, frame_hash, parse_frame_header,
        };
        loop {
            if self.buf.len() >= FRAME_HEADER_LEN {
                let mut h = [0u8; FRAME_HEADER_LEN];
                h.copy_from_slice(&self.buf[..FRAME_HEADER_LEN]);
                let (kind, total) = parse_frame_header(&h)?;
                if self.held.is_none()
                    && let Some(budget) = &self.budget
                {
                    // Before the body is read: a frame that does not fit leaves its stream
                    // unread until earlier frames are handed on.
                    self.held = Some(budget.take(total).await);
                }
                if self.buf.len() < total {
                    self.read_rest(total).await?;
                }
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
                    return Ok(Some((StreamFrame { kind, bytes, hash }, self.held.take())));
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

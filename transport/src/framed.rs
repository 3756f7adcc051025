//! Control messages over QUIC streams: length-delimited by the message framing itself
//! (`starling_proto::msg`), read with a bounded buffer.

use quinn::{RecvStream, SendStream};
use starling_proto::DecodeError;
use starling_proto::msg::{MAX_MESSAGE_BODY, Message, check};
use thiserror::Error;

/// Why a message could not be sent or received.
#[derive(Debug, Error)]
pub enum FramedError {
    #[error("stream write: {0}")]
    Write(#[from] quinn::WriteError),
    #[error("stream read: {0}")]
    Read(#[from] quinn::ReadError),
    #[error("malformed message: {0}")]
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

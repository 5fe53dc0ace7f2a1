//! Length-prefixed frames with a JSON header and a raw body.

use serde::{de::DeserializeOwned, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Largest header accepted (1 MiB): headers are small control messages.
pub const MAX_HEADER: usize = 1 << 20;
/// Largest body accepted in one frame (8 MiB). Larger payloads are chunked.
pub const MAX_BODY: usize = 8 << 20;

/// One protocol frame: a typed header and an opaque body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame<T> {
    /// The message.
    pub header: T,
    /// Raw bytes that belong to the message (output chunk, file contents, stdin).
    pub body: Vec<u8>,
}

impl<T> Frame<T> {
    /// A frame with an empty body.
    pub fn new(header: T) -> Self {
        Self {
            header,
            body: Vec::new(),
        }
    }

    /// A frame with a body.
    pub fn with_body(header: T, body: Vec<u8>) -> Self {
        Self { header, body }
    }
}

/// Errors reading or writing frames.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    /// The underlying stream failed.
    #[error("The agent connection failed.")]
    Io(#[from] std::io::Error),
    /// A frame announced a size beyond the protocol limits.
    #[error("A frame of {header} header bytes and {body} body bytes exceeds the protocol limits ({} header bytes, {} body bytes).", MAX_HEADER, MAX_BODY)]
    TooLarge {
        /// Announced header length.
        header: usize,
        /// Announced body length.
        body: usize,
    },
    /// The header was not a valid message.
    #[error("A frame header could not be decoded.")]
    BadHeader(#[source] serde_json::Error),
    /// The header could not be encoded.
    #[error("A frame header could not be encoded.")]
    Encode(#[source] serde_json::Error),
    /// The frame lengths are inconsistent.
    #[error("A frame's header length ({header}) is larger than the frame ({total}).")]
    Malformed {
        /// Announced header length.
        header: usize,
        /// Announced total length.
        total: usize,
    },
}

/// Reads one frame. Returns `Ok(None)` on a clean end of stream between frames.
pub async fn read_frame<T, R>(reader: &mut R) -> Result<Option<Frame<T>>, CodecError>
where
    T: DeserializeOwned,
    R: AsyncRead + Unpin,
{
    let mut len = [0u8; 4];
    match reader.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let total = u32::from_be_bytes(len) as usize;
    reader.read_exact(&mut len).await?;
    let header_len = u32::from_be_bytes(len) as usize;
    if total < 4 + header_len {
        return Err(CodecError::Malformed {
            header: header_len,
            total,
        });
    }
    let body_len = total - 4 - header_len;
    if header_len > MAX_HEADER || body_len > MAX_BODY {
        return Err(CodecError::TooLarge {
            header: header_len,
            body: body_len,
        });
    }
    let mut header = vec![0u8; header_len];
    reader.read_exact(&mut header).await?;
    let mut body = vec![0u8; body_len];
    reader.read_exact(&mut body).await?;
    let header = serde_json::from_slice(&header).map_err(CodecError::BadHeader)?;
    Ok(Some(Frame { header, body }))
}

/// Writes one frame and flushes it.
pub async fn write_frame<T, W>(writer: &mut W, frame: &Frame<T>) -> Result<(), CodecError>
where
    T: Serialize,
    W: AsyncWrite + Unpin,
{
    let header = serde_json::to_vec(&frame.header).map_err(CodecError::Encode)?;
    if header.len() > MAX_HEADER || frame.body.len() > MAX_BODY {
        return Err(CodecError::TooLarge {
            header: header.len(),
            body: frame.body.len(),
        });
    }
    // Both lengths were checked against MAX_HEADER and MAX_BODY above.
    let too_large = || CodecError::TooLarge {
        header: header.len(),
        body: frame.body.len(),
    };
    let total = u32::try_from(4 + header.len() + frame.body.len()).map_err(|_| too_large())?;
    let header_len = u32::try_from(header.len()).map_err(|_| too_large())?;
    let mut prefix = [0u8; 8];
    prefix[..4].copy_from_slice(&total.to_be_bytes());
    prefix[4..].copy_from_slice(&header_len.to_be_bytes());
    if frame.body.len() <= COALESCE_BODY {
        // One write: a reader waiting on the socket wakes once for the
        // whole frame, not once per part (most frames are a request, an
        // event or a chunk of output, and their parts are small).
        let mut whole = Vec::with_capacity(8 + header.len() + frame.body.len());
        whole.extend_from_slice(&prefix);
        whole.extend_from_slice(&header);
        whole.extend_from_slice(&frame.body);
        writer.write_all(&whole).await?;
    } else {
        writer.write_all(&prefix).await?;
        writer.write_all(&header).await?;
        writer.write_all(&frame.body).await?;
    }
    writer.flush().await?;
    Ok(())
}

/// The largest body [`write_frame`] copies to send its frame in one write;
/// a larger one (a file's contents) goes in a write of its own.
const COALESCE_BODY: usize = 64 << 10;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Event, ServerMessage};

    #[tokio::test]
    async fn round_trips_header_and_binary_body() {
        let frame = Frame::with_body(
            ServerMessage {
                id: 7,
                event: Event::Stdout,
            },
            // Output that looks like a frame prefix and JSON must stay opaque body bytes.
            b"\x00\x00\x00\x10\x00\x00\x00\x02{}{\"id\":1}\xff".to_vec(),
        );
        let mut buf = Vec::new();
        write_frame(&mut buf, &frame).await.unwrap();
        let mut rd = &buf[..];
        let back: Frame<ServerMessage> = read_frame(&mut rd).await.unwrap().unwrap();
        assert_eq!(back, frame);
        assert!(read_frame::<ServerMessage, _>(&mut rd)
            .await
            .unwrap()
            .is_none());
    }

    /// Counts the writes a frame takes.
    struct Writes(Vec<Vec<u8>>);

    impl tokio::io::AsyncWrite for Writes {
        fn poll_write(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            buf: &[u8],
        ) -> std::task::Poll<std::io::Result<usize>> {
            self.0.push(buf.to_vec());
            std::task::Poll::Ready(Ok(buf.len()))
        }
        fn poll_flush(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::task::Poll::Ready(Ok(()))
        }
        fn poll_shutdown(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::task::Poll::Ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn a_small_frame_is_one_write_and_a_large_body_its_own() {
        for (body_len, writes) in [(0, 1), (100, 1), (COALESCE_BODY, 1), (COALESCE_BODY + 1, 3)] {
            let frame = Frame::with_body(
                ServerMessage {
                    id: 3,
                    event: Event::Stdout,
                },
                (0..body_len)
                    .map(|i| u8::try_from(i % 251).unwrap())
                    .collect(),
            );
            let mut out = Writes(Vec::new());
            write_frame(&mut out, &frame).await.unwrap();
            assert_eq!(out.0.len(), writes, "a body of {body_len} bytes");
            let bytes = out.0.concat();
            let back: Frame<ServerMessage> = read_frame(&mut &bytes[..]).await.unwrap().unwrap();
            assert_eq!(back, frame, "a body of {body_len} bytes");
        }
    }

    #[tokio::test]
    async fn rejects_oversized_and_malformed_frames() {
        let mut buf = Vec::new();
        buf.extend_from_slice(&u32::try_from(MAX_BODY + 100).unwrap().to_be_bytes());
        buf.extend_from_slice(&2u32.to_be_bytes());
        let err = read_frame::<ServerMessage, _>(&mut &buf[..])
            .await
            .unwrap_err();
        assert!(matches!(err, CodecError::TooLarge { .. }), "{err}");

        let mut buf = Vec::new();
        buf.extend_from_slice(&4u32.to_be_bytes());
        buf.extend_from_slice(&9u32.to_be_bytes());
        let err = read_frame::<ServerMessage, _>(&mut &buf[..])
            .await
            .unwrap_err();
        assert!(matches!(err, CodecError::Malformed { .. }), "{err}");
    }

    #[tokio::test]
    async fn truncated_frame_is_an_error_not_a_message() {
        let frame = Frame::with_body(
            ServerMessage {
                id: 1,
                event: Event::Stdout,
            },
            vec![1; 100],
        );
        let mut buf = Vec::new();
        write_frame(&mut buf, &frame).await.unwrap();
        buf.truncate(buf.len() - 10);
        assert!(read_frame::<ServerMessage, _>(&mut &buf[..]).await.is_err());
    }

    /// Reads every frame `bytes` hold, as the agent and the daemon do.
    fn read_all(bytes: &[u8]) -> Result<Vec<Frame<serde_json::Value>>, CodecError> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(async {
            let mut rd = bytes;
            let mut out = Vec::new();
            while let Some(f) = read_frame(&mut rd).await? {
                out.push(f);
            }
            Ok(out)
        })
    }

    fn write(frame: &Frame<(u64, String)>) -> (Result<(), CodecError>, Vec<u8>) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let mut buf = Vec::new();
        let r = rt.block_on(write_frame(&mut buf, frame));
        (r, buf)
    }

    /// Bytes that are mostly well-formed frames, with their lengths and
    /// headers changed at random.
    fn framed_noise() -> impl proptest::strategy::Strategy<Value = Vec<u8>> {
        use proptest::prelude::*;
        (
            any::<u32>(),
            any::<u32>(),
            prop::collection::vec(any::<u8>(), 0..64),
        )
            .prop_map(|(total, header, rest)| {
                let mut v = (total % 4096).to_be_bytes().to_vec();
                v.extend_from_slice(&(header % 4096).to_be_bytes());
                v.extend_from_slice(&rest);
                v
            })
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 256, ..Default::default() })]

        /// Whatever comes over the socket, reading answers frames or an
        /// error; it never panics.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..256)) {
            let _ = read_all(&bytes);
        }

        #[test]
        fn mangled_frames_never_panic(bytes in framed_noise()) {
            let _ = read_all(&bytes);
        }

        /// Any header and body within the limits comes back unchanged,
        /// also when several frames follow each other.
        #[test]
        fn frames_round_trip(
            frames in proptest::collection::vec(
                (proptest::prelude::any::<u64>(), "\\PC{0,40}|[\\x00-\\x7f]{0,40}", proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512)),
                1..4,
            )
        ) {
            let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
            let frames: Vec<Frame<(u64, String)>> = frames
                .into_iter()
                .map(|(id, text, body)| Frame::with_body((id, text), body))
                .collect();
            let mut buf = Vec::new();
            for f in &frames {
                rt.block_on(write_frame(&mut buf, f)).unwrap();
            }
            let back = rt.block_on(async {
                let mut rd = &buf[..];
                let mut out = Vec::new();
                while let Some(f) = read_frame::<(u64, String), _>(&mut rd).await.unwrap() {
                    out.push(f);
                }
                out
            });
            proptest::prop_assert_eq!(back, frames);
        }
    }

    /// A frame over the limits is refused before anything is written, so
    /// the connection stays usable.
    #[test]
    fn oversized_frames_write_nothing() {
        for frame in [
            Frame::new((1, "x".repeat(MAX_HEADER))),
            Frame::new((1, "\u{1}".repeat(MAX_HEADER / 6 + 1))),
            Frame::with_body((1, String::new()), vec![0; MAX_BODY + 1]),
        ] {
            let (r, buf) = write(&frame);
            assert!(matches!(r, Err(CodecError::TooLarge { .. })), "{r:?}");
            assert!(buf.is_empty());
        }
        let (r, _) = write(&Frame::with_body((1, String::new()), vec![0; MAX_BODY]));
        assert!(r.is_ok(), "{r:?}");
    }
}

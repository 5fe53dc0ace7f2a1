//! The wire protocol between the runcell host (CLI or daemon) and `runcell-agent`,
//! the process that runs as PID 1 inside every sandbox.
//!
//! # Framing
//!
//! Every message is one frame:
//!
//! ```text
//! +----------------+----------------+------------------+--------------+
//! | total_len: u32 | header_len: u32| header: JSON     | body: bytes  |
//! +----------------+----------------+------------------+--------------+
//! ```
//!
//! Both lengths are big-endian; `total_len` counts everything after itself.
//! The header is a small JSON object (the message); the body carries raw bytes
//! (program output, file contents, stdin) so binary data never needs escaping.
//!
//! Output that sandboxed code prints is only ever carried inside a frame body,
//! whose length the agent sets, so nothing the code prints can be read as a frame.
//! The socket itself lives outside the sandbox's filesystem and network namespace;
//! code in the sandbox cannot reach it.
//!
//! # Versioning
//!
//! On connect the agent sends [`Event::Hello`] with [`PROTOCOL_VERSION`]. A host
//! refuses to talk to an agent whose major version differs.

mod codec;
mod language;
mod messages;
pub mod mux;
pub mod text;
pub mod units;

pub use codec::{read_frame, write_frame, CodecError, Frame, MAX_BODY, MAX_HEADER};
pub use language::{Language, UnknownLanguage};
pub use messages::*;

/// The protocol version spoken by this build. Bumped on any incompatible change.
pub const PROTOCOL_VERSION: u32 = 1;

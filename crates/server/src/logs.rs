//! Each sandbox's log: the output of its execs, bounded in memory, with live
//! followers.
//!
//! The log stores the bytes as they came (chunks tagged with their stream, in
//! a ring of at most [`KEEP_BYTES`]) and splits them into lines only when
//! read, so appending costs O(1) amortized per byte whatever the line length,
//! and memory is bounded per sandbox whatever the program prints. Followers
//! keep a cursor into the ring (an absolute byte offset) and are woken
//! through a watch channel; a follower that falls behind the ring is told how
//! many bytes it missed.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use runcell_core::Output;
use tokio::sync::watch;

/// Bytes of log kept per sandbox (the oldest are dropped first).
const KEEP_BYTES: usize = 256 << 10;
/// Chunks kept per sandbox, so that tiny appends cannot pile up overhead.
const KEEP_CHUNKS: usize = 4096;
/// A small chunk is extended by the next append of the same stream.
const MERGE_BELOW: usize = 16 << 10;
/// A runaway line is cut (with a newline added) at this length.
const MAX_LINE: usize = 64 << 10;

/// One line of output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Line {
    /// Which stream it came from.
    pub stream: Output,
    /// The text, with its newline.
    pub text: String,
}

#[derive(Debug)]
struct Chunk {
    stream: Output,
    /// Absolute offset of `data[0]`.
    start: u64,
    data: Vec<u8>,
}

#[derive(Debug, Default)]
struct Inner {
    chunks: VecDeque<Chunk>,
    /// Bytes of the front chunk already dropped.
    skip: usize,
    /// Bytes held (excluding `skip`).
    bytes: usize,
    /// Absolute offset of the next byte appended.
    end: u64,
}

impl Inner {
    /// The absolute offset of the oldest byte kept.
    fn start(&self) -> u64 {
        self.chunks
            .front()
            .map_or(self.end, |c| c.start + self.skip as u64)
    }

    fn trim(&mut self) {
        while self.bytes > KEEP_BYTES || self.chunks.len() > KEEP_CHUNKS {
            let Some(front) = self.chunks.front() else {
                break;
            };
            let held = front.data.len() - self.skip;
            let over = self.bytes.saturating_sub(KEEP_BYTES);
            if self.chunks.len() <= KEEP_CHUNKS && over < held {
                // Drop part of the front chunk without moving its bytes.
                self.skip += over;
                self.bytes -= over;
            } else {
                self.chunks.pop_front();
                self.skip = 0;
                self.bytes -= held;
            }
        }
    }

    /// Copies the bytes from absolute offset `from` on, with their streams.
    fn since(&self, from: u64) -> Vec<(Output, Vec<u8>)> {
        let mut out: Vec<(Output, Vec<u8>)> = Vec::new();
        for (i, c) in self.chunks.iter().enumerate() {
            let first = if i == 0 { self.skip } else { 0 };
            let c_end = c.start + c.data.len() as u64;
            if c_end <= from {
                continue;
            }
            let begin =
                first.max(usize::try_from(from.saturating_sub(c.start)).unwrap_or(usize::MAX));
            match out.last_mut() {
                Some((s, buf)) if *s == c.stream => buf.extend_from_slice(&c.data[begin..]),
                _ => out.push((c.stream, c.data[begin..].to_vec())),
            }
        }
        out
    }
}

/// A sandbox's log.
#[derive(Debug)]
pub struct SandboxLog {
    inner: Arc<Mutex<Inner>>,
    /// The end offset, for followers.
    tx: watch::Sender<u64>,
}

impl Default for SandboxLog {
    fn default() -> Self {
        Self {
            inner: Arc::default(),
            tx: watch::channel(0).0,
        }
    }
}

/// Splits bytes of two interleaved streams into lines, keeping each stream's
/// unfinished line until its newline comes (or it grows past [`MAX_LINE`]).
#[derive(Debug, Default)]
pub struct LineSplitter {
    partial_out: Vec<u8>,
    partial_err: Vec<u8>,
}

impl LineSplitter {
    /// Bytes held for lines not yet ended.
    pub fn pending(&self) -> u64 {
        u64::try_from(self.partial_out.len() + self.partial_err.len()).unwrap_or(u64::MAX)
    }

    /// Feeds bytes of `stream`, calling `line` for each complete line.
    pub fn feed(&mut self, stream: Output, mut bytes: &[u8], line: &mut impl FnMut(Line)) {
        let partial = match stream {
            Output::Stdout => &mut self.partial_out,
            Output::Stderr => &mut self.partial_err,
        };
        while !bytes.is_empty() {
            let room = MAX_LINE - partial.len();
            match bytes.iter().take(room).position(|&b| b == b'\n') {
                Some(i) => {
                    partial.extend_from_slice(&bytes[..=i]);
                    bytes = &bytes[i + 1..];
                }
                None if bytes.len() < room => {
                    partial.extend_from_slice(bytes);
                    return;
                }
                None => {
                    partial.extend_from_slice(&bytes[..room]);
                    partial.push(b'\n');
                    bytes = &bytes[room..];
                }
            }
            let text = String::from_utf8_lossy(partial).into_owned();
            partial.clear();
            line(Line { stream, text });
        }
    }
}

impl SandboxLog {
    /// Appends output.
    pub fn append(&self, stream: Output, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        let end = {
            let mut inner = self
                .inner
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let end = inner.end;
            let only_front = inner.chunks.len() == 1;
            match inner.chunks.back_mut() {
                // Never extend the partly dropped front chunk past its size,
                // so `skip` stays cheap to reason about.
                Some(c) if c.stream == stream && c.data.len() < MERGE_BELOW && !only_front => {
                    c.data.extend_from_slice(bytes)
                }
                _ => inner.chunks.push_back(Chunk {
                    stream,
                    start: end,
                    data: bytes.to_vec(),
                }),
            }
            inner.bytes += bytes.len();
            inner.end += bytes.len() as u64;
            inner.trim();
            inner.end
        };
        self.tx.send_replace(end);
    }

    /// The kept lines of the chosen streams (the first may be the tail of a
    /// longer line; an unfinished last line is included).
    pub fn snapshot(&self, want: impl Fn(Output) -> bool) -> Vec<Line> {
        let parts = {
            let inner = self
                .inner
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            inner.since(0)
        };
        let mut lines = Vec::new();
        let mut split = LineSplitter::default();
        for (s, b) in &parts {
            if want(*s) {
                split.feed(*s, b, &mut |l| lines.push(l));
            }
        }
        for (stream, rest) in [
            (Output::Stdout, split.partial_out),
            (Output::Stderr, split.partial_err),
        ] {
            if !rest.is_empty() {
                lines.push(Line {
                    stream,
                    text: String::from_utf8_lossy(&rest).into_owned(),
                });
            }
        }
        lines
    }

    /// A follower that sees every byte kept so far and every byte appended
    /// later (unless it falls behind the ring).
    pub fn follow(&self) -> Follower {
        Follower {
            inner: self.inner.clone(),
            rx: self.tx.subscribe(),
            cursor: 0,
            split: LineSplitter::default(),
        }
    }
}

/// What a follower gets next.
#[derive(Debug, PartialEq, Eq)]
pub enum Followed {
    /// New complete lines.
    Lines(Vec<Line>),
    /// This many bytes were dropped from the log before the follower read them.
    Missed(u64),
}

/// A live reader of a sandbox's log.
#[derive(Debug)]
pub struct Follower {
    inner: Arc<Mutex<Inner>>,
    rx: watch::Receiver<u64>,
    cursor: u64,
    split: LineSplitter,
}

impl Follower {
    /// Waits for new output; `None` once the sandbox's log is gone.
    pub async fn next(&mut self) -> Option<Followed> {
        loop {
            let (start, parts, end) = {
                let inner = self
                    .inner
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                let start = inner.start();
                (start, inner.since(self.cursor.max(start)), inner.end)
            };
            if start > self.cursor {
                // The unended line it held is lost with the gap: counted.
                let missed = start - self.cursor + self.split.pending();
                self.cursor = start;
                self.split = LineSplitter::default();
                return Some(Followed::Missed(missed));
            }
            self.cursor = end;
            let mut lines = Vec::new();
            for (s, b) in &parts {
                self.split.feed(*s, b, &mut |l| lines.push(l));
            }
            if !lines.is_empty() {
                return Some(Followed::Lines(lines));
            }
            self.rx.borrow_and_update();
            if self.cursor >= *self.rx.borrow() && self.rx.changed().await.is_err() {
                return None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn texts(lines: Vec<Line>) -> Vec<String> {
        lines.into_iter().map(|l| l.text).collect()
    }

    #[test]
    fn keeps_whole_lines_within_the_bound() {
        let log = SandboxLog::default();
        log.append(Output::Stdout, b"a\nb");
        log.append(Output::Stderr, b"err\n");
        log.append(Output::Stdout, b"c\n");
        assert_eq!(texts(log.snapshot(|_| true)), vec!["a\n", "err\n", "bc\n"]);
        assert_eq!(log.snapshot(|s| s == Output::Stdout).len(), 2);
        let big = "x".repeat(1000) + "\n";
        for _ in 0..1000 {
            log.append(Output::Stdout, big.as_bytes());
        }
        let kept = log.snapshot(|_| true);
        assert!(kept.iter().map(|l| l.text.len()).sum::<usize>() <= KEEP_BYTES);
        assert_eq!(kept.last().unwrap().text, big);
    }

    #[test]
    fn short_lines_cost_linear_time_and_bounded_memory() {
        let log = SandboxLog::default();
        let chunk = "y\n".repeat(32 << 10);
        let started = std::time::Instant::now();
        // 64 MB of two-byte lines.
        for _ in 0..1024 {
            log.append(Output::Stdout, chunk.as_bytes());
        }
        for _ in 0..200_000 {
            log.append(Output::Stderr, b"e");
            log.append(Output::Stdout, b"o\n");
        }
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
        let inner = log.inner.lock().unwrap();
        assert!(inner.bytes <= KEEP_BYTES && inner.chunks.len() <= KEEP_CHUNKS);
        let held: usize = inner.chunks.iter().map(|c| c.data.capacity()).sum();
        assert!(held < 4 * KEEP_BYTES, "{held}");
    }

    #[test]
    fn runaway_lines_are_cut() {
        let log = SandboxLog::default();
        log.append(Output::Stdout, &vec![b'x'; MAX_LINE * 2 + 5]);
        let lines = texts(log.snapshot(|_| true));
        assert_eq!(lines.len(), 3);
        assert_eq!(lines[0].len(), MAX_LINE + 1);
        assert_eq!(lines[2], "xxxxx");
    }

    #[tokio::test]
    async fn followers_see_everything_or_are_told_what_they_missed() {
        let log = SandboxLog::default();
        log.append(Output::Stdout, b"one\ntw");
        let mut f = log.follow();
        assert_eq!(
            f.next().await,
            Some(Followed::Lines(vec![Line {
                stream: Output::Stdout,
                text: "one\n".into()
            }]))
        );
        log.append(Output::Stdout, b"o\n");
        match f.next().await {
            Some(Followed::Lines(l)) => assert_eq!(texts(l), vec!["two\n"]),
            other => panic!("{other:?}"),
        }
        for _ in 0..100 {
            log.append(Output::Stdout, &[b'z'; 10_000]);
        }
        assert!(matches!(f.next().await, Some(Followed::Missed(n)) if n > 0));
        drop(log);
        // What is still kept is delivered, then the end.
        while let Some(x) = f.next().await {
            assert!(matches!(x, Followed::Lines(_)));
        }
    }

    #[tokio::test]
    async fn a_gap_counts_the_unended_line_it_takes() {
        let log = SandboxLog::default();
        log.append(Output::Stdout, b"one\npart");
        let mut f = log.follow();
        assert!(matches!(f.next().await, Some(Followed::Lines(l)) if l.len() == 1));
        // "part" is held, waiting for its end; then far more than is kept.
        let line = "z".repeat(999) + "\n";
        for _ in 0..1000 {
            log.append(Output::Stdout, line.as_bytes());
        }
        drop(log);
        let (mut missed, mut delivered) = (0, 0);
        while let Some(x) = f.next().await {
            match x {
                Followed::Missed(n) => missed += n,
                Followed::Lines(l) => {
                    delivered += l.iter().map(|l| l.text.len() as u64).sum::<u64>()
                }
            }
        }
        // Every byte after "one\n" is either delivered or counted missed.
        assert_eq!(missed + delivered, 4 + 1000 * 1000);
    }
}

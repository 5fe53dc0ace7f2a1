//! Each sandbox's log: the output of its execs, line by line, bounded in
//! memory, with live followers.

use std::collections::VecDeque;
use std::sync::Mutex;

use runcell_core::Output;
use tokio::sync::broadcast;

/// Bytes of log kept per sandbox (oldest lines are dropped first).
const KEEP_BYTES: usize = 256 << 10;

/// One line of output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Line {
    /// Which stream it came from.
    pub stream: Output,
    /// The text, with its newline.
    pub text: String,
}

#[derive(Debug, Default)]
struct Inner {
    lines: VecDeque<Line>,
    bytes: usize,
    partial_out: String,
    partial_err: String,
}

/// A sandbox's log.
#[derive(Debug)]
pub struct SandboxLog {
    inner: Mutex<Inner>,
    tx: broadcast::Sender<Line>,
}

impl Default for SandboxLog {
    fn default() -> Self {
        Self {
            inner: Mutex::default(),
            tx: broadcast::channel(1024).0,
        }
    }
}

impl SandboxLog {
    /// Appends output; complete lines are stored and sent to followers.
    pub fn append(&self, stream: Output, text: &str) {
        let mut inner = self.inner.lock().expect("log lock");
        let partial = match stream {
            Output::Stdout => &mut inner.partial_out,
            Output::Stderr => &mut inner.partial_err,
        };
        partial.push_str(text);
        let mut complete = Vec::new();
        while let Some(i) = partial.find('\n') {
            let rest = partial.split_off(i + 1);
            complete.push(std::mem::replace(partial, rest));
        }
        // A runaway line is cut rather than held forever.
        if partial.len() > 64 << 10 {
            complete.push(std::mem::take(partial) + "\n");
        }
        for text in complete {
            let line = Line { stream, text };
            inner.bytes += line.text.len();
            inner.lines.push_back(line.clone());
            let _ = self.tx.send(line);
        }
        while inner.bytes > KEEP_BYTES {
            match inner.lines.pop_front() {
                Some(l) => inner.bytes -= l.text.len(),
                None => break,
            }
        }
    }

    /// The kept lines of the chosen streams.
    pub fn snapshot(&self, want: impl Fn(Output) -> bool) -> Vec<Line> {
        let inner = self.inner.lock().expect("log lock");
        inner
            .lines
            .iter()
            .filter(|l| want(l.stream))
            .cloned()
            .collect()
    }

    /// A receiver of new lines, plus the lines kept so far (taken atomically,
    /// so nothing falls between the two).
    pub fn follow(&self) -> (Vec<Line>, broadcast::Receiver<Line>) {
        let inner = self.inner.lock().expect("log lock");
        (inner.lines.iter().cloned().collect(), self.tx.subscribe())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_whole_lines_within_the_bound() {
        let log = SandboxLog::default();
        log.append(Output::Stdout, "a\nb");
        log.append(Output::Stderr, "err\n");
        log.append(Output::Stdout, "c\n");
        let all: Vec<String> = log.snapshot(|_| true).into_iter().map(|l| l.text).collect();
        assert_eq!(all, vec!["a\n", "err\n", "bc\n"]);
        let out = log.snapshot(|s| s == Output::Stdout);
        assert_eq!(out.len(), 2);
        let big = "x".repeat(1000) + "\n";
        for _ in 0..1000 {
            log.append(Output::Stdout, &big);
        }
        assert!(
            log.snapshot(|_| true)
                .iter()
                .map(|l| l.text.len())
                .sum::<usize>()
                <= KEEP_BYTES
        );
    }
}

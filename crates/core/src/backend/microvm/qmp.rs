//! A minimal client of QEMU's machine protocol (QMP): one connection per
//! call, JSON lines, events skipped. Enough to stop and continue a guest,
//! ask its run state, switch its writable disk to a new overlay and
//! migrate its memory to a file.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};

use super::MicrovmError;

/// How long one command may take to answer (a migration is polled, not
/// waited for).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

/// An open QMP session with capabilities negotiated.
pub struct Qmp {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

fn failed(what: &str) -> impl FnOnce(std::io::Error) -> MicrovmError + '_ {
    move |e| MicrovmError::Vmm(format!("{what}: {e}"))
}

impl Qmp {
    /// Connects to the QMP socket at `path` and leaves negotiation mode.
    pub fn connect(path: &Path) -> Result<Self, MicrovmError> {
        let short = runcell_jail::socket::SocketPath::new(path)
            .map_err(failed("reaching the VMM's control socket"))?;
        let stream = UnixStream::connect(short.path())
            .map_err(failed("connecting to the VMM's control socket"))?;
        stream
            .set_read_timeout(Some(ANSWER_TIMEOUT))
            .map_err(failed("setting a timeout"))?;
        let writer = stream
            .try_clone()
            .map_err(failed("duplicating the control socket"))?;
        let mut qmp = Self {
            reader: BufReader::new(stream),
            writer,
        };
        // The greeting, then capabilities.
        let greeting = qmp.line()?;
        if greeting.get("QMP").is_none() {
            return Err(MicrovmError::Vmm(format!(
                "the VMM greeted with {greeting} instead of QMP"
            )));
        }
        qmp.execute("qmp_capabilities", None)?;
        Ok(qmp)
    }

    fn line(&mut self) -> Result<Value, MicrovmError> {
        let mut line = String::new();
        let n = self
            .reader
            .read_line(&mut line)
            .map_err(failed("reading the VMM's answer"))?;
        if n == 0 {
            return Err(MicrovmError::Vmm(
                "the VMM closed its control socket".into(),
            ));
        }
        serde_json::from_str(&line)
            .map_err(|e| MicrovmError::Vmm(format!("the VMM answered {line:?}: {e}")))
    }

    /// Runs `command` with `arguments`; its `return` value, or the VMM's
    /// error description.
    pub fn execute(
        &mut self,
        command: &str,
        arguments: Option<Value>,
    ) -> Result<Value, MicrovmError> {
        let mut msg = json!({ "execute": command });
        if let Some(a) = arguments {
            msg["arguments"] = a;
        }
        let mut bytes = serde_json::to_vec(&msg).unwrap_or_default();
        bytes.push(b'\n');
        self.writer
            .write_all(&bytes)
            .map_err(failed("sending a command to the VMM"))?;
        loop {
            let v = self.line()?;
            if v.get("event").is_some() {
                continue;
            }
            if let Some(r) = v.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = v.get("error") {
                let desc = e["desc"].as_str().unwrap_or("unknown error");
                return Err(MicrovmError::Vmm(format!("{command}: {desc}")));
            }
        }
    }

    /// The guest's run state (`running`, `paused`, `inmigrate`,
    /// `postmigrate`, …).
    pub fn status(&mut self) -> Result<String, MicrovmError> {
        let r = self.execute("query-status", None)?;
        Ok(r["status"].as_str().unwrap_or("unknown").to_string())
    }
}

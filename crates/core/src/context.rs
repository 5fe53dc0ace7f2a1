//! Code contexts: long-lived interpreters in a sandbox whose variables,
//! imports and working directory persist from one cell to the next.

use std::collections::BTreeMap;
use std::time::Duration;

use runcell_protocol::{CellOutcome, ContextCreateRequest, ContextInfo, Event, Language, Request};

use crate::client::ClientError;
use crate::sandbox::{Output, Sandbox};
use crate::Error;

/// A rich result: MIME type to content (binary types base64-encoded).
pub type MimeBundle = BTreeMap<String, String>;

/// Options for a new context.
#[derive(Debug, Clone)]
pub struct ContextOptions {
    /// The interpreter's language.
    pub language: Language,
    /// Working directory (the user's home when absent).
    pub cwd: Option<String>,
    /// Extra environment variables.
    pub env: BTreeMap<String, String>,
    /// Python modules imported before the context is ready.
    pub preload: Vec<String>,
}

impl ContextOptions {
    /// A context of `language` with defaults.
    pub fn new(language: Language) -> Self {
        Self {
            language,
            cwd: None,
            env: BTreeMap::new(),
            preload: Vec::new(),
        }
    }
}

/// Something a running cell produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CellEvent<'a> {
    /// Output on stdout or stderr.
    Output(Output, &'a [u8]),
    /// A rich result.
    Result(MimeBundle),
}

/// A finished cell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CellReport {
    /// How it ended.
    pub outcome: CellOutcome,
    /// The timeout that applied.
    pub timeout: Duration,
    /// A process of the sandbox was killed for exceeding the memory limit
    /// during the cell.
    pub oom_killed: bool,
}

/// A finished cell with everything it produced collected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CellRun {
    /// How it ended.
    pub report: CellReport,
    /// Stdout, at most the output limit.
    pub stdout: Vec<u8>,
    /// Stderr, at most the output limit.
    pub stderr: Vec<u8>,
    /// Rich results in the order they were produced.
    pub results: Vec<MimeBundle>,
}

fn unexpected(event: Event) -> Error {
    ClientError::Unexpected(Box::new(event)).into()
}

impl Sandbox {
    /// Starts a context and waits until its interpreter is ready.
    pub async fn create_context(&self, opts: ContextOptions) -> Result<ContextInfo, Error> {
        let req = Request::ContextCreate(ContextCreateRequest {
            language: opts.language,
            cwd: opts.cwd,
            env: opts.env,
            preload: opts.preload,
        });
        match self.talk(self.agent().call(req, Vec::new())).await? {
            (Event::Context { context: info }, _) => Ok(info),
            (other, _) => Err(unexpected(other)),
        }
    }

    /// Every context of the sandbox, oldest first.
    pub async fn list_contexts(&self) -> Result<Vec<ContextInfo>, Error> {
        match self
            .talk(self.agent().call(Request::ContextList, Vec::new()))
            .await?
        {
            (Event::Contexts { contexts }, _) => Ok(contexts),
            (other, _) => Err(unexpected(other)),
        }
    }

    /// Stops a context.
    pub async fn delete_context(&self, context_id: &str) -> Result<(), Error> {
        let req = Request::ContextDelete {
            context_id: context_id.into(),
        };
        match self.talk(self.agent().call(req, Vec::new())).await? {
            (Event::Done, _) => Ok(()),
            (other, _) => Err(unexpected(other)),
        }
    }

    /// Replaces a context's interpreter with a fresh one; its state is lost.
    pub async fn restart_context(&self, context_id: &str) -> Result<ContextInfo, Error> {
        let req = Request::ContextRestart {
            context_id: context_id.into(),
        };
        match self.talk(self.agent().call(req, Vec::new())).await? {
            (Event::Context { context: info }, _) => Ok(info),
            (other, _) => Err(unexpected(other)),
        }
    }

    /// Runs a cell, calling `on_event` for output and results as they arrive.
    /// `timeout` defaults to the sandbox's.
    pub async fn run_cell_streaming(
        &self,
        context_id: &str,
        code: &str,
        timeout: Option<Duration>,
        mut on_event: impl FnMut(CellEvent<'_>),
    ) -> Result<CellReport, Error> {
        let timeout = timeout.unwrap_or(self.limits().timeout);
        let req = Request::ContextRun {
            context_id: context_id.into(),
            timeout_ms: runcell_protocol::units::millis(timeout),
            output_limit: self.limits().output_bytes,
        };
        let before = self.kills();
        // The agent enforces the timeout and the interrupt grace; this is a
        // backstop should it stall.
        let backstop = timeout + Duration::from_secs(90);
        let outcome = self
            .talk(async {
                let mut replies = self.agent().request(req, code.as_bytes().to_vec()).await?;
                tokio::time::timeout(backstop, async {
                    loop {
                        match replies.next().await? {
                            (Event::Stdout, body) => {
                                on_event(CellEvent::Output(Output::Stdout, &body))
                            }
                            (Event::Stderr, body) => {
                                on_event(CellEvent::Output(Output::Stderr, &body))
                            }
                            (Event::Result, body) => match serde_json::from_slice(&body) {
                                Ok(bundle) => on_event(CellEvent::Result(bundle)),
                                Err(e) => tracing::warn!("dropping a malformed result: {e}"),
                            },
                            (Event::CellDone(outcome), _) => return Ok(outcome),
                            (Event::Error { kind, message }, _) => {
                                return Err(ClientError::Agent { kind, message })
                            }
                            (other, _) => return Err(ClientError::Unexpected(Box::new(other))),
                        }
                    }
                })
                .await
                .map_err(|_| ClientError::Closed)?
            })
            .await?;
        let after = self.kills();
        // The host's counters, or a microVM guest's as the agent read them.
        let oom_killed = after.oom_kills > before.oom_kills || outcome.oom_killed;
        Ok(CellReport {
            outcome,
            timeout,
            oom_killed,
        })
    }

    /// Runs a cell and collects its output and results.
    pub async fn run_cell(
        &self,
        context_id: &str,
        code: &str,
        timeout: Option<Duration>,
    ) -> Result<CellRun, Error> {
        let (mut stdout, mut stderr, mut results) = (Vec::new(), Vec::new(), Vec::new());
        let report = self
            .run_cell_streaming(context_id, code, timeout, |ev| match ev {
                CellEvent::Output(Output::Stdout, b) => stdout.extend_from_slice(b),
                CellEvent::Output(Output::Stderr, b) => stderr.extend_from_slice(b),
                CellEvent::Result(r) => results.push(r),
            })
            .await?;
        Ok(CellRun {
            report,
            stdout,
            stderr,
            results,
        })
    }
}

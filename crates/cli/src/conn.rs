//! How the commands that talk to a daemon reach it.

use clap::Args;
use runcell_client::Client;

use crate::report;

/// How to reach the daemon, shared by every remote command.
#[derive(Debug, Args)]
pub struct Conn {
    /// The daemon [default: $RUNCELL_URL, else http://127.0.0.1:7070].
    #[arg(long, global = true)]
    pub url: Option<String>,
    /// API key [default: $RUNCELL_API_KEY, else the key file runcell serve wrote].
    #[arg(long, global = true)]
    pub api_key: Option<String>,
    /// Print JSON instead of text.
    #[arg(long, global = true)]
    pub json: bool,
}

impl Conn {
    /// A client, or the exit status after reporting why there is none.
    pub fn client(&self) -> Result<Client, u8> {
        Client::from_env(self.url.clone(), self.api_key.clone()).map_err(|e| {
            report(&e);
            2
        })
    }
}

//! Network egress for sandboxes: the policy (`none`, `allowlist`, `open`),
//! the classification of addresses no sandbox may reach, and the proxy that
//! enforces both.
//!
//! Sandboxes keep their own network namespace with only loopback. The agent
//! forwards `127.0.0.1:3128` inside the sandbox to a unix socket bound on the
//! host (`<state>/<id>/egress/sock`), where [`proxy`] checks every request
//! by host name, resolves it on the host, refuses private, loopback and
//! link-local addresses, and splices the bytes.

pub mod addr;
pub mod policy;
pub mod proxy;

pub use addr::{classify, AddrClass, ExceptionError, PrivateException};
pub use policy::{HostRule, NetworkMode, NetworkPolicy, PolicyError, PRESETS};
pub use proxy::{Egress, EgressConfig, EgressReport, EgressTotals};

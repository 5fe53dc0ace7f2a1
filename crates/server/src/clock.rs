//! The wall clock, as the registry and the API count time.

use std::time::{SystemTime, UNIX_EPOCH};

/// Now, unix milliseconds.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as i64
}

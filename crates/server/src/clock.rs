//! The wall clock, as the registry and the API count time.

use std::time::{SystemTime, UNIX_EPOCH};

/// Now, unix milliseconds.
pub fn now_ms() -> i64 {
    let ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis();
    i64::try_from(ms).unwrap_or(i64::MAX)
}

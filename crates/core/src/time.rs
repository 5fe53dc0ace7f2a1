//! UTC timestamps as the API shows them (through `jiff`).

use jiff::Timestamp;

/// The timestamp of unix seconds, clamped to the range `jiff` represents
/// (about years -9999 to 9999), so that any stored value prints as a date.
pub fn timestamp(unix: i64) -> Timestamp {
    let unix = unix.clamp(Timestamp::MIN.as_second(), Timestamp::MAX.as_second());
    Timestamp::from_second(unix).unwrap_or(Timestamp::UNIX_EPOCH)
}

/// `YYYY-MM-DDTHH:MM:SSZ` for unix seconds (RFC 3339, UTC).
pub fn rfc3339(unix: i64) -> String {
    timestamp(unix).strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_rfc3339() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(1_795_941_814), "2026-11-29T08:43:34Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(-1), "1969-12-31T23:59:59Z");
        // Out of the representable range: clamped to its ends, never a panic.
        assert_eq!(rfc3339(i64::MAX), "9999-12-30T22:00:00Z");
        assert_eq!(rfc3339(i64::MIN), "-9999-01-02T01:59:59Z");
    }
}

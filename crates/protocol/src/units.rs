//! Durations as the whole numbers the protocol and the API carry.

use std::time::Duration;

/// Whole milliseconds in `d`, saturating (at 585 million years).
pub fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Whole microseconds in `d`, saturating.
pub fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// Milliseconds since the Unix epoch at `t` (0 before the epoch).
pub fn unix_millis(t: std::time::SystemTime) -> u64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .map(millis)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversions_saturate_instead_of_wrapping() {
        assert_eq!(millis(Duration::from_millis(1500)), 1500);
        assert_eq!(micros(Duration::from_micros(7)), 7);
        assert_eq!(millis(Duration::MAX), u64::MAX);
        assert_eq!(micros(Duration::MAX), u64::MAX);
        assert_eq!(unix_millis(std::time::UNIX_EPOCH), 0);
    }
}

/// `v` as a whole number, cut toward zero and saturating (NaN and
/// negatives are 0, anything past `u64::MAX` is `u64::MAX`): what `as`
/// does, named, so that every such conversion is a visible decision.
#[allow(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    reason = "saturating toward zero is the documented intent"
)]
pub fn saturating_u64(v: f64) -> u64 {
    v as u64
}

/// CPU cores as the millicores a cgroup gets: rounded, at least 10.
pub fn cpu_millis(cores: f64) -> u64 {
    saturating_u64((cores * 1000.0).round()).max(10)
}

#[cfg(test)]
mod float_tests {
    use super::*;

    #[test]
    fn floats_saturate_and_cpu_rounds_with_a_floor() {
        assert_eq!(saturating_u64(f64::NAN), 0);
        assert_eq!(saturating_u64(-3.0), 0);
        assert_eq!(saturating_u64(1e30), u64::MAX);
        assert_eq!(saturating_u64(2.9), 2);
        assert_eq!(cpu_millis(0.5), 500);
        assert_eq!(cpu_millis(0.0004), 10);
        assert_eq!(cpu_millis(1.2345), 1235);
    }
}

//! Per-sandbox limits and human-readable sizes.

use std::time::Duration;

use runcell_jail::Limits;
use serde::{Deserialize, Serialize};

/// Everything a sandbox is limited by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxLimits {
    /// Memory, including the writable layer (which lives in memory), bytes.
    pub memory_bytes: u64,
    /// Processes and threads.
    pub pids: u64,
    /// CPU in thousandths of a core.
    pub cpu_millis: u64,
    /// Writable layer size, bytes.
    pub disk_bytes: u64,
    /// Default wall-clock limit of one run.
    pub timeout: Duration,
    /// Bytes of each of stdout and stderr kept per run; the rest is counted.
    pub output_bytes: u64,
}

impl Default for SandboxLimits {
    fn default() -> Self {
        let jail = Limits::default();
        Self {
            memory_bytes: jail.memory_bytes,
            pids: jail.pids,
            cpu_millis: jail.cpu_millis,
            disk_bytes: jail.disk_bytes,
            timeout: Duration::from_secs(60),
            output_bytes: 1 << 20,
        }
    }
}

impl SandboxLimits {
    /// The part the jail enforces.
    pub fn jail(&self) -> Limits {
        Limits {
            memory_bytes: self.memory_bytes,
            pids: self.pids,
            cpu_millis: self.cpu_millis,
            disk_bytes: self.disk_bytes,
        }
    }
}

/// A size that could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("\"{0}\" is not a size; use a number of bytes with an optional K, M, G or T suffix (e.g. 256M).")]
pub struct SizeError(pub String);

/// Parses `1024`, `512k`, `256M`, `256MiB`, `1G`, `1.5G` (binary units).
pub fn parse_size(s: &str) -> Result<u64, SizeError> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => return Err(SizeError(s.into())),
    };
    let value: f64 = num.parse().map_err(|_| SizeError(s.into()))?;
    if !value.is_finite() || value < 0.0 {
        return Err(SizeError(s.into()));
    }
    Ok((value * mult as f64).round() as u64)
}

/// Formats seconds for people: `5`, `1.5`.
pub fn format_secs(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s.fract() == 0.0 {
        format!("{s:.0}")
    } else {
        format!("{s}")
    }
}

/// Formats bytes for people: `1.0 GiB`, `512 KiB`, `17 B`.
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < UNITS.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{bytes} B")
    } else if v.fract() == 0.0 {
        format!("{v:.0} {}", UNITS[i])
    } else {
        format!("{v:.1} {}", UNITS[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sizes() {
        assert_eq!(parse_size("1024").unwrap(), 1024);
        assert_eq!(parse_size("256M").unwrap(), 256 << 20);
        assert_eq!(parse_size("256MiB").unwrap(), 256 << 20);
        assert_eq!(parse_size("1g").unwrap(), 1 << 30);
        assert_eq!(parse_size("1.5G").unwrap(), 3 << 29);
        assert!(parse_size("lots").is_err());
        assert!(parse_size("12X").is_err());
        assert!(parse_size("").is_err());
    }

    #[test]
    fn formats_sizes() {
        assert_eq!(format_size(17), "17 B");
        assert_eq!(format_size(1 << 30), "1 GiB");
        assert_eq!(format_size(1536 << 10), "1.5 MiB");
    }
}

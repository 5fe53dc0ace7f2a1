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

/// The most bytes one command may have: the kernel's limit for one
/// argument (`MAX_ARG_STRLEN`, 32 pages, less the terminating NUL). A
/// command runs as `bash -c CMD`, so a longer one could never start.
pub const MAX_COMMAND_BYTES: usize = (128 << 10) - 1;
/// The most bytes one environment variable (`NAME=value`) may have; the
/// kernel's limit, as for a command.
pub const MAX_ENV_VAR_BYTES: usize = (128 << 10) - 1;
/// The most bytes all of a request's environment variables may have.
pub const MAX_ENV_BYTES: usize = 256 << 10;
/// The most bytes a path (a working directory, a file) may have: `PATH_MAX`
/// less the terminating NUL.
pub const MAX_PATH_BYTES: usize = 4095;
/// The most bytes one cell's source code may have: it travels in one
/// protocol frame body.
pub const MAX_CODE_BYTES: usize = runcell_protocol::MAX_BODY;
/// The most bytes the text fields of one request (command, environment,
/// working directory) may take once encoded for the agent: a frame header
/// holds at most [`runcell_protocol::MAX_HEADER`], and the rest of the
/// message needs a little room.
pub const MAX_ENCODED_FIELDS: usize = runcell_protocol::MAX_HEADER - (16 << 10);
/// The most keys a sandbox's metadata may have (the caller's; the server
/// adds `workspace`).
pub const MAX_METADATA_KEYS: usize = 64;
/// The most bytes one metadata key may have.
pub const MAX_METADATA_KEY_BYTES: usize = 256;
/// The most bytes one metadata value may have.
pub const MAX_METADATA_VALUE_BYTES: usize = 4 << 10;
/// The most bytes a sandbox's metadata may have, keys and values together.
/// It is kept with the sandbox, returned by every list, and kept in its
/// tombstone for the retention after it ends.
pub const MAX_METADATA_BYTES: usize = 16 << 10;
/// Most processes a sandbox may be given (the kernel's default `pid_max`).
pub const MAX_PIDS: u64 = 32768;
/// Fewest processes: a shell and a pipeline need a few.
pub const MIN_PIDS: u64 = 8;
/// Least memory, MiB.
pub const MIN_MEMORY_MB: u64 = 16;
/// Least CPU, cores: one hundredth, so it never rounds to nothing.
pub const MIN_CPU: f64 = 0.01;
/// Shortest timeout, seconds (one millisecond).
pub const MIN_TIMEOUT_SECS: f64 = 0.001;
/// Default ceiling of `output_bytes` when the operator sets none.
pub const DEFAULT_MAX_OUTPUT_BYTES: u64 = 64 << 20;

/// A value of a request that is outside what is allowed. Every message names
/// the field and what it accepts.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RequestError {
    /// A number outside its range (or not a whole number where one is needed).
    #[error("{field} must be {kind} between {min} and {max}{unit}, not {got}.")]
    OutOfRange {
        /// The field, as the request names it (`limits.memory_mb`).
        field: &'static str,
        /// "a number" or "a whole number".
        kind: &'static str,
        /// Smallest accepted value.
        min: String,
        /// Largest accepted value.
        max: String,
        /// The unit and where the maximum comes from, e.g. " (MiB; this host's memory)".
        unit: &'static str,
        /// The value given.
        got: String,
    },
    /// An environment variable that no process could be given.
    #[error("{field} has an invalid variable {name:?}: {why}.")]
    BadEnv {
        /// The field (`env`).
        field: &'static str,
        /// The variable's name (control characters escaped).
        name: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// A text field with a character no process could be given.
    #[error("{field} must not contain a NUL character.")]
    Nul {
        /// The field.
        field: &'static str,
    },
    /// A text field longer than its limit.
    #[error("{field} is {got} bytes; the most it may be is {max} bytes ({human}{why}).")]
    TooLong {
        /// The field.
        field: String,
        /// Its length.
        got: usize,
        /// Its limit.
        max: usize,
        /// The limit for people.
        human: String,
        /// Where the limit comes from.
        why: &'static str,
    },
    /// The fields of one request do not fit one protocol frame once encoded.
    #[error("{fields} take {got} bytes once encoded for the sandbox agent; one request may carry at most {max} bytes ({human}). Control characters take six bytes each; put large data in a file (PUT /fs) instead.")]
    TooLargeEncoded {
        /// The fields counted.
        fields: &'static str,
        /// Their encoded size.
        got: usize,
        /// The limit.
        max: usize,
        /// The limit for people.
        human: String,
    },
}

impl RequestError {
    /// Whether the request is refused for its size (HTTP 413) rather than
    /// its content (HTTP 400).
    pub fn is_too_large(&self) -> bool {
        matches!(self, Self::TooLong { .. } | Self::TooLargeEncoded { .. })
    }
}

/// A number as a person would write it: `120`, `0.5`, `1e20`.
fn show(v: f64) -> String {
    if v.is_finite() && v.abs() >= 1e16 {
        format!("{v:e}")
    } else {
        format!("{v}")
    }
}

/// A whole number in `min..=max` (`max` at most 2^53, so every value in
/// range is exact as a float).
pub fn whole_in(
    field: &'static str,
    v: f64,
    min: u64,
    max: u64,
    unit: &'static str,
) -> Result<u64, RequestError> {
    debug_assert!(max <= 1 << 53);
    if v.is_finite() && v.fract() == 0.0 && v >= min as f64 && v <= max as f64 {
        // In range and whole: the conversion is exact.
        Ok(runcell_protocol::units::saturating_u64(v))
    } else {
        Err(RequestError::OutOfRange {
            field,
            kind: "a whole number",
            min: min.to_string(),
            max: max.to_string(),
            unit,
            got: show(v),
        })
    }
}

/// A number in `min..=max`.
pub fn number_in(
    field: &'static str,
    v: f64,
    min: f64,
    max: f64,
    unit: &'static str,
) -> Result<f64, RequestError> {
    if v.is_finite() && v >= min && v <= max {
        Ok(v)
    } else {
        Err(RequestError::OutOfRange {
            field,
            kind: "a number",
            min: show(min),
            max: show(max),
            unit,
            got: show(v),
        })
    }
}

/// Seconds in `min..=max` as a duration.
pub fn seconds_in(
    field: &'static str,
    v: f64,
    min: Duration,
    max: Duration,
    unit: &'static str,
) -> Result<Duration, RequestError> {
    let secs = number_in(field, v, min.as_secs_f64(), max.as_secs_f64(), unit)?;
    // In range, so finite, non-negative and far from overflowing.
    Ok(Duration::try_from_secs_f64(secs).unwrap_or(max).min(max))
}

/// What a request may ask of a sandbox's limits: the ranges, from the host
/// and the operator's settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LimitBounds {
    /// Most memory, MiB (the host's memory, or the operator's default if larger).
    pub max_memory_mb: u64,
    /// Most CPU, cores.
    pub max_cpu: f64,
    /// Most processes.
    pub max_pids: u64,
    /// Largest writable layer, MiB (it lives in memory).
    pub max_disk_mb: u64,
    /// Longest timeout of one run (`--max-exec-timeout`).
    pub max_timeout: Duration,
    /// Most output bytes kept per stream and run.
    pub max_output_bytes: u64,
    /// Longest idle TTL (the maximum lifetime).
    pub max_ttl: Duration,
}

/// Memory of this host, MiB (0 if unknown).
fn host_memory_mb() -> u64 {
    nix::sys::sysinfo::sysinfo()
        .map(|i| i.ram_total() >> 20)
        .unwrap_or(0)
}

impl LimitBounds {
    /// The ranges on this host, given the operator's longest run and
    /// lifetime and default limits (the defaults are always allowed).
    pub fn for_host(
        max_timeout: Duration,
        max_lifetime: Duration,
        defaults: &SandboxLimits,
    ) -> Self {
        let host_mb = host_memory_mb().max(MIN_MEMORY_MB);
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        Self {
            max_memory_mb: host_mb.max(defaults.memory_bytes >> 20),
            max_cpu: cpus.max(defaults.cpu_millis as f64 / 1000.0),
            max_pids: MAX_PIDS.max(defaults.pids.min(1 << 53)),
            max_disk_mb: host_mb.max(defaults.disk_bytes >> 20),
            max_timeout: max_timeout.max(Duration::from_millis(1)),
            max_output_bytes: DEFAULT_MAX_OUTPUT_BYTES.max(defaults.output_bytes),
            max_ttl: max_lifetime,
        }
    }

    /// `base` with what a request asks for, every value checked against
    /// its range first.
    pub fn apply(
        &self,
        mut l: SandboxLimits,
        req: &LimitsRequest,
    ) -> Result<SandboxLimits, RequestError> {
        let cap = |v: u64| v.min(1 << 53);
        if let Some(m) = req.memory_mb {
            let mb = whole_in(
                "limits.memory_mb",
                m,
                MIN_MEMORY_MB,
                cap(self.max_memory_mb),
                " (MiB; the maximum is this host's memory)",
            )?;
            l.memory_bytes = mb.saturating_mul(1 << 20);
        }
        if let Some(c) = req.cpu {
            let c = number_in(
                "limits.cpu",
                c,
                MIN_CPU,
                self.max_cpu,
                " (cores; the maximum is this host's)",
            )?;
            l.cpu_millis = runcell_protocol::units::cpu_millis(c);
        }
        if let Some(p) = req.pids {
            l.pids = whole_in("limits.pids", p, MIN_PIDS, cap(self.max_pids), "")?;
        }
        if let Some(d) = req.disk_mb {
            let mb = whole_in(
                "limits.disk_mb",
                d,
                1,
                cap(self.max_disk_mb),
                " (MiB; the writable layer lives in memory, so the maximum is this host's memory)",
            )?;
            l.disk_bytes = mb.saturating_mul(1 << 20);
        }
        if let Some(t) = req.timeout_seconds {
            l.timeout = self.timeout("limits.timeout_seconds", t)?;
        }
        if let Some(o) = req.output_bytes {
            l.output_bytes = whole_in("limits.output_bytes", o, 0, cap(self.max_output_bytes), "")?;
        }
        Ok(l)
    }

    /// A run's timeout in seconds, up to the operator's maximum.
    pub fn timeout(&self, field: &'static str, secs: f64) -> Result<Duration, RequestError> {
        seconds_in(
            field,
            secs,
            Duration::from_millis(1),
            self.max_timeout,
            " seconds (the maximum is the daemon's --max-exec-timeout)",
        )
    }

    /// A run's timeout in milliseconds, up to the operator's maximum.
    pub fn timeout_ms(&self, field: &'static str, ms: f64) -> Result<Duration, RequestError> {
        let max = cap_u64(self.max_timeout.as_millis());
        let ms = whole_in(
            field,
            ms,
            1,
            max,
            " milliseconds (the maximum is the daemon's --max-exec-timeout)",
        )?;
        Ok(Duration::from_millis(ms))
    }

    /// An idle TTL in seconds, up to the maximum lifetime.
    pub fn ttl(&self, field: &'static str, secs: f64) -> Result<u64, RequestError> {
        whole_in(
            field,
            secs,
            0,
            self.max_ttl.as_secs().min(1 << 53),
            " seconds (the maximum is the daemon's --max-lifetime)",
        )
    }
}

fn cap_u64(v: u128) -> u64 {
    u64::try_from(v).unwrap_or(u64::MAX).min(1 << 53)
}

/// The limits a create request asks for, as the numbers it sent.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LimitsRequest {
    /// MiB.
    pub memory_mb: Option<f64>,
    /// Cores.
    pub cpu: Option<f64>,
    /// Processes.
    pub pids: Option<f64>,
    /// MiB.
    pub disk_mb: Option<f64>,
    /// Seconds.
    pub timeout_seconds: Option<f64>,
    /// Bytes per stream and run.
    pub output_bytes: Option<f64>,
}

/// A text field no longer than `max` bytes.
pub fn check_len(field: &str, s: &str, max: usize, why: &'static str) -> Result<(), RequestError> {
    if s.len() > max {
        return Err(RequestError::TooLong {
            field: field.into(),
            got: s.len(),
            max,
            human: format_size(max as u64 + 1),
            why,
        });
    }
    Ok(())
}

/// A shell command: no NUL, no longer than one argument may be.
pub fn check_command(field: &'static str, cmd: &str) -> Result<(), RequestError> {
    check_len(field, cmd, MAX_COMMAND_BYTES, " less one, the kernel's limit for one argument; write a longer script to a file and run that")?;
    if cmd.contains('\0') {
        return Err(RequestError::Nul { field });
    }
    Ok(())
}

/// A path: no NUL, at most `PATH_MAX`.
pub fn check_path(field: &'static str, path: &str) -> Result<(), RequestError> {
    if path.len() > MAX_PATH_BYTES {
        // A path is a 400, not a 413: no path can be this long.
        return Err(RequestError::OutOfRange {
            field,
            kind: "a path",
            min: "1".into(),
            max: MAX_PATH_BYTES.to_string(),
            unit: " bytes long",
            got: format!("{} bytes", path.len()),
        });
    }
    if path.contains('\0') {
        return Err(RequestError::Nul { field });
    }
    Ok(())
}

/// Environment variables a process can be given: names not empty, without
/// `=` or NUL; values without NUL; each and all within the kernel's limits.
pub fn check_env(
    field: &'static str,
    env: &std::collections::BTreeMap<String, String>,
) -> Result<(), RequestError> {
    let bad = |name: &str, why| RequestError::BadEnv {
        field,
        name: shown_key(name),
        why,
    };
    let mut total = 0usize;
    for (k, v) in env {
        if k.is_empty() {
            return Err(bad(k, "a name must not be empty"));
        }
        if k.contains('\0') {
            return Err(bad(k, "a name must not contain a NUL character"));
        }
        if k.contains('=') {
            return Err(bad(k, "a name must not contain '='"));
        }
        if v.contains('\0') {
            return Err(bad(k, "a value must not contain a NUL character"));
        }
        let len = k.len() + 1 + v.len();
        if len > MAX_ENV_VAR_BYTES {
            return Err(RequestError::TooLong {
                field: format!("{field}.{}", shown_key(k)),
                got: len,
                max: MAX_ENV_VAR_BYTES,
                human: format_size(MAX_ENV_VAR_BYTES as u64 + 1),
                why: " less one as NAME=value, the kernel's limit for one variable",
            });
        }
        total = total.saturating_add(len + 1);
    }
    if total > MAX_ENV_BYTES {
        return Err(RequestError::TooLong {
            field: field.into(),
            got: total,
            max: MAX_ENV_BYTES,
            human: format_size(MAX_ENV_BYTES as u64),
            why: " for all variables together",
        });
    }
    Ok(())
}

/// A sandbox's metadata: each key and value within its limit (checked
/// first, so the error names the one), at most [`MAX_METADATA_KEYS`] keys,
/// all of them within [`MAX_METADATA_BYTES`]. Keys
/// in `uncounted` (the server's own) are not counted in the number of keys
/// or the total, but each is held to the limits of one key and one value.
/// An error names the key, cut short if it is itself too long.
pub fn check_metadata(
    field: &'static str,
    metadata: &std::collections::BTreeMap<String, String>,
    uncounted: &[&str],
) -> Result<(), RequestError> {
    let counted = |k: &String| !uncounted.contains(&k.as_str());
    let too_long =
        |field: String, got: usize, max: usize, why: &'static str| RequestError::TooLong {
            field,
            got,
            max,
            human: format_size(max as u64),
            why,
        };
    let mut total = 0usize;
    for (k, v) in metadata {
        let shown = shown_key(k);
        if k.len() > MAX_METADATA_KEY_BYTES {
            return Err(too_long(
                format!("{field} key \"{shown}\""),
                k.len(),
                MAX_METADATA_KEY_BYTES,
                " for one key",
            ));
        }
        if v.len() > MAX_METADATA_VALUE_BYTES {
            return Err(too_long(
                format!("{field}.{shown}"),
                v.len(),
                MAX_METADATA_VALUE_BYTES,
                " for one value",
            ));
        }
        if counted(k) {
            total = total.saturating_add(k.len() + v.len());
        }
    }
    let keys = metadata.keys().filter(|k| counted(k)).count();
    if keys > MAX_METADATA_KEYS {
        return Err(RequestError::OutOfRange {
            field,
            kind: "a number of keys",
            min: "0".into(),
            max: MAX_METADATA_KEYS.to_string(),
            unit: "",
            got: keys.to_string(),
        });
    }
    if total > MAX_METADATA_BYTES {
        return Err(too_long(
            field.into(),
            total,
            MAX_METADATA_BYTES,
            " for all keys and values together",
        ));
    }
    Ok(())
}

/// A key (a variable's name, a metadata key) as an error names it: escaped,
/// and cut after its first 64 bytes (with its size).
fn shown_key(k: &str) -> String {
    runcell_protocol::text::clip(k, 64)
        .escape_debug()
        .to_string()
}

/// Bytes `s` takes as a JSON string.
pub fn encoded_len(s: &str) -> usize {
    // Quotes, plus the escapes serde_json writes.
    2 + s
        .bytes()
        .map(|b| match b {
            b'"' | b'\\' | b'\n' | b'\r' | b'\t' | 0x08 | 0x0c => 2,
            0..=0x1f => 6,
            _ => 1,
        })
        .sum::<usize>()
}

/// A run's command, environment and working directory (`fields` names the
/// ones the request gave) fit one protocol frame once encoded.
pub fn check_encoded(
    fields: &'static str,
    cmd: &str,
    env: &std::collections::BTreeMap<String, String>,
    cwd: Option<&str>,
) -> Result<(), RequestError> {
    let got = encoded_len(cmd)
        + env
            .iter()
            .map(|(k, v)| encoded_len(k) + encoded_len(v) + 2)
            .sum::<usize>()
        + cwd.map_or(0, encoded_len);
    if got > MAX_ENCODED_FIELDS {
        return Err(RequestError::TooLargeEncoded {
            fields,
            got,
            max: MAX_ENCODED_FIELDS,
            human: format_size(MAX_ENCODED_FIELDS as u64),
        });
    }
    Ok(())
}

/// A size that could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("\"{0}\" is not a size; use a number of bytes with an optional K, M, G or T suffix (e.g. 256M).")]
pub struct SizeError(pub String);

/// A duration that could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    /// Not a number with one of the units.
    #[error("\"{0}\" is not a duration (e.g. 5s, 500ms, 2m)")]
    Invalid(String),
    /// Zero, negative or not finite.
    #[error("\"{0}\" must be a positive duration")]
    NotPositive(String),
    /// More seconds than a `Duration` holds.
    #[error("\"{0}\" is too long a duration")]
    TooLong(String),
}

/// Splits `1.5G` into its number and its unit, after trimming.
fn number_and_unit(s: &str) -> (&str, &str) {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    t.split_at(split)
}

/// Parses `1024`, `512k`, `256M`, `256MiB`, `1G`, `1.5G` (binary units:
/// `K`, `M`, `G`, `T` with an optional `B` or `iB`, any case). Every size
/// the CLI, its config file and template labels take goes through here.
pub fn parse_size(s: &str) -> Result<u64, SizeError> {
    let (num, unit) = number_and_unit(s);
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => return Err(SizeError(s.into())),
    };
    let value: f64 = num.parse().map_err(|_| SizeError(s.into()))?;
    let bytes = (value * mult as f64).round();
    // 2^64 is exact as a float; anything at or above it does not fit.
    if !bytes.is_finite() || bytes < 0.0 || bytes >= u64::MAX as f64 {
        return Err(SizeError(s.into()));
    }
    Ok(runcell_protocol::units::saturating_u64(bytes))
}

/// Parses `5`, `5s`, `500ms`, `2m`, `1h`, `1.5s` (a bare number is
/// seconds). Every duration the CLI and its config file take goes through
/// here.
pub fn parse_duration(s: &str) -> Result<Duration, DurationError> {
    let (num, unit) = number_and_unit(s);
    let v: f64 = num.parse().map_err(|_| DurationError::Invalid(s.into()))?;
    let secs = match unit {
        "" | "s" => v,
        "ms" => v / 1000.0,
        "m" => v * 60.0,
        "h" => v * 3600.0,
        _ => return Err(DurationError::Invalid(s.into())),
    };
    if !(secs > 0.0 && secs.is_finite()) {
        return Err(DurationError::NotPositive(s.into()));
    }
    // Durations past u64 seconds (about 584 billion years) do not exist.
    Duration::try_from_secs_f64(secs).map_err(|_| DurationError::TooLong(s.into()))
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

#[cfg(test)]
mod properties {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn bounds() -> LimitBounds {
        LimitBounds {
            max_memory_mb: 8192,
            max_cpu: 4.0,
            max_pids: MAX_PIDS,
            max_disk_mb: 8192,
            max_timeout: Duration::from_secs(3600),
            max_output_bytes: DEFAULT_MAX_OUTPUT_BYTES,
            max_ttl: Duration::from_secs(86400),
        }
    }

    /// Any float JSON can carry, and the ones it cannot.
    fn number() -> impl Strategy<Value = f64> {
        prop_oneof![
            any::<f64>(),
            (0u64..100_000).prop_map(|v| v as f64),
            any::<u64>().prop_map(|v| v as f64),
            any::<i64>().prop_map(|v| v as f64),
            Just(f64::NAN),
            Just(f64::INFINITY),
            Just(1e20),
            Just(9_223_372_036_854_776.0),
            Just(0.0001),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

        #[test]
        fn limits_from_any_numbers_are_in_range_or_refused(
            m in prop::option::of(number()), c in prop::option::of(number()),
            p in prop::option::of(number()), d in prop::option::of(number()),
            t in prop::option::of(number()), o in prop::option::of(number()),
        ) {
            let b = bounds();
            let req = LimitsRequest { memory_mb: m, cpu: c, pids: p, disk_mb: d, timeout_seconds: t, output_bytes: o };
            match b.apply(SandboxLimits::default(), &req) {
                Ok(l) => {
                    if let Some(m) = m { prop_assert_eq!(l.memory_bytes, runcell_protocol::units::saturating_u64(m) << 20); }
                    prop_assert!(l.memory_bytes >= MIN_MEMORY_MB << 20 && l.memory_bytes <= b.max_memory_mb << 20);
                    prop_assert!(l.cpu_millis >= 10 && l.cpu_millis as f64 <= b.max_cpu * 1000.0);
                    prop_assert!(l.pids >= MIN_PIDS && l.pids <= b.max_pids);
                    prop_assert!(l.disk_bytes >= 1 << 20 && l.disk_bytes <= b.max_disk_mb << 20);
                    prop_assert!(l.timeout > Duration::ZERO && l.timeout <= b.max_timeout);
                    prop_assert!(l.output_bytes <= b.max_output_bytes);
                }
                Err(e) => {
                    // Every refusal names a field and its range.
                    let msg = e.to_string();
                    prop_assert!(msg.starts_with("limits.") && msg.contains(" between "), "{}", msg);
                }
            }
        }

        #[test]
        fn timeouts_and_ttls_never_panic_and_stay_in_range(v in number()) {
            let b = bounds();
            if let Ok(d) = b.timeout("timeout_seconds", v) {
                prop_assert!(d >= Duration::from_millis(1) && d <= b.max_timeout);
            }
            if let Ok(d) = b.timeout_ms("timeout_ms", v) {
                prop_assert!(d >= Duration::from_millis(1) && d <= b.max_timeout);
            }
            if let Ok(t) = b.ttl("ttl_seconds", v) {
                prop_assert!(t <= b.max_ttl.as_secs());
                prop_assert_eq!(t as f64, v);
            }
        }

        #[test]
        fn encoded_len_is_the_json_length(s in "\\PC{0,40}|[\\x00-\\x7f]{0,40}") {
            prop_assert_eq!(encoded_len(&s), serde_json::to_string(&s).unwrap().len());
        }

        #[test]
        fn accepted_environments_are_ones_a_process_can_have(
            env in prop::collection::btree_map("[A-Za-z_=\\x00]{0,6}", "[a-z\\x00=]{0,6}", 0..6)
        ) {
            let env: BTreeMap<String, String> = env;
            if check_env("env", &env).is_ok() {
                for (k, v) in &env {
                    prop_assert!(!k.is_empty() && !k.contains('=') && !k.contains('\0'));
                    prop_assert!(!v.contains('\0'));
                }
            }
        }

        #[test]
        fn sizes_parse_any_text_without_panicking(s in "[0-9.]{0,25}[kKmMgGtTbBiI ]{0,3}|\\PC{0,10}") {
            let _ = parse_size(&s);
        }

        #[test]
        fn whole_byte_counts_parse_exactly(n in 0u64..(1 << 53), unit in 0usize..4) {
            let (suffix, shift) = [("", 0), ("K", 10), ("M", 20), ("G", 30)][unit];
            let n = n >> shift;
            prop_assert_eq!(parse_size(&format!("{n}{suffix}")).unwrap(), n << shift);
        }
    }

    #[test]
    fn parses_durations() {
        assert_eq!(parse_duration("5").unwrap(), Duration::from_secs(5));
        assert_eq!(parse_duration("5s").unwrap(), Duration::from_secs(5));
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("1h").unwrap(), Duration::from_secs(3600));
        assert!(parse_duration("0").is_err());
        assert!(parse_duration("soon").is_err());
        // This panicked (Duration::from_secs_f64 on 1e30 seconds).
        assert!(parse_duration(&format!("1{}", "0".repeat(30))).is_err());
        assert!(parse_duration(&format!("1{}h", "0".repeat(20))).is_err());
    }

    #[test]
    fn duration_errors_say_what_is_wrong() {
        assert_eq!(
            parse_duration("soon").unwrap_err().to_string(),
            "\"soon\" is not a duration (e.g. 5s, 500ms, 2m)"
        );
        assert_eq!(
            parse_duration("0s").unwrap_err().to_string(),
            "\"0s\" must be a positive duration"
        );
        assert_eq!(
            parse_duration(&format!("1{}h", "0".repeat(20)))
                .unwrap_err()
                .to_string(),
            format!("\"1{}h\" is too long a duration", "0".repeat(20))
        );
        assert_eq!(
            parse_size("12X").unwrap_err().to_string(),
            "\"12X\" is not a size; use a number of bytes with an optional K, M, G or T suffix (e.g. 256M)."
        );
    }

    #[test]
    fn sizes_beyond_u64_are_refused_not_saturated() {
        assert!(parse_size("99999999999999999999999T").is_err());
        assert!(parse_size("16777216T").is_err());
        assert_eq!(parse_size("16777215T").unwrap(), 16777215 << 40);
    }

    #[test]
    fn refusals_name_the_field_and_range() {
        let b = bounds();
        let req = LimitsRequest {
            memory_mb: Some(1e20),
            ..Default::default()
        };
        let e = b.apply(SandboxLimits::default(), &req).unwrap_err();
        assert_eq!(
            e.to_string(),
            "limits.memory_mb must be a whole number between 16 and 8192 (MiB; the maximum is this host's memory), not 1e20."
        );
        let e = check_command("cmd", &"x".repeat(10 << 20)).unwrap_err();
        assert!(e.is_too_large());
        assert!(e.to_string().contains("128 KiB"), "{e}");
    }

    #[test]
    fn a_long_variable_name_is_not_echoed_whole() {
        let name = "N".repeat(200 << 10);
        let env = [(name.clone(), "v".to_string())].into_iter().collect();
        let e = check_env("env", &env).unwrap_err();
        assert!(e.to_string().len() < 300, "{e}");
        assert!(e.to_string().starts_with("env.NNNN"), "{e}");
        let env = [(format!("{name}="), "v".to_string())]
            .into_iter()
            .collect();
        let e = check_env("env", &env).unwrap_err();
        assert!(e.to_string().len() < 300, "{e}");
    }

    #[test]
    fn metadata_is_held_to_its_limits() {
        use std::collections::BTreeMap;
        let map = |pairs: &[(&str, usize)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, n)| (k.to_string(), "v".repeat(*n)))
                .collect()
        };
        let many: BTreeMap<String, String> = (0..=MAX_METADATA_KEYS)
            .map(|i| (format!("k{i}"), "v".into()))
            .collect();
        let e = check_metadata("metadata", &many, &[]).unwrap_err();
        assert!(!e.is_too_large());
        assert!(e.to_string().contains("between 0 and 64, not 65"), "{e}");
        // The server's own keys are not counted...
        let mut forked = many.clone();
        forked.remove("k0");
        forked.insert("fork_parent".into(), "p".into());
        check_metadata("metadata", &forked, &["fork_parent"]).unwrap();
        assert!(check_metadata("metadata", &forked, &[]).is_err());
        // ...but are held to one value's limit.
        let big = map(&[("fork_parent", MAX_METADATA_VALUE_BYTES + 1)]);
        let e = check_metadata("metadata", &big, &["fork_parent"]).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("metadata.fork_parent is 4097 bytes"),
            "{e}"
        );
        let e = check_metadata("metadata", &map(&[("", MAX_METADATA_VALUE_BYTES + 1)]), &[])
            .unwrap_err();
        assert!(e.is_too_large(), "{e}");
        // A long key is named by its start only.
        let key = "K".repeat(1 << 20);
        let e = check_metadata("metadata", &map(&[(&key, 1)]), &[]).unwrap_err();
        assert!(e.to_string().len() < 300, "{e}");
        assert!(e.to_string().contains("metadata key \"KKKK"), "{e}");
        // All of it together.
        let e = check_metadata(
            "metadata",
            &map(&[
                ("a", 4000),
                ("b", 4000),
                ("c", 4000),
                ("d", 4000),
                ("e", 400),
            ]),
            &[],
        )
        .unwrap_err();
        assert!(
            e.to_string()
                .contains("16 KiB for all keys and values together"),
            "{e}"
        );
        check_metadata(
            "metadata",
            &map(&[("a", 4095), ("b", 4095), ("c", 4095), ("d", 4095)]),
            &[],
        )
        .unwrap();
        check_metadata("metadata", &BTreeMap::new(), &[]).unwrap();
    }
}

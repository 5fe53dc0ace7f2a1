//! Any numbers a request can carry become limits within their ranges or a
//! refusal; sizes parse or are refused; never a panic.
#![no_main]

use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use runcell_core::limits::{LimitBounds, LimitsRequest};
use runcell_core::{parse_size, SandboxLimits};

fn f(bytes: &[u8], i: usize) -> Option<f64> {
    let chunk = bytes.get(i * 9..i * 9 + 9)?;
    (chunk[0] & 1 == 1).then(|| f64::from_le_bytes(chunk[1..9].try_into().expect("8 bytes")))
}

fuzz_target!(|data: &[u8]| {
    let b = LimitBounds::for_host(
        Duration::from_secs(3600),
        Duration::from_secs(86400),
        &SandboxLimits::default(),
    );
    let req = LimitsRequest {
        memory_mb: f(data, 0),
        cpu: f(data, 1),
        pids: f(data, 2),
        disk_mb: f(data, 3),
        timeout_seconds: f(data, 4),
        output_bytes: f(data, 5),
    };
    if let Ok(l) = b.apply(SandboxLimits::default(), &req) {
        assert!(l.timeout <= b.max_timeout && l.pids <= b.max_pids && l.cpu_millis >= 10);
    }
    if let Some(v) = f(data, 6) {
        let _ = b.ttl("ttl_seconds", v);
        let _ = b.timeout_ms("timeout_ms", v);
    }
    if let Ok(s) = std::str::from_utf8(data) {
        let _ = parse_size(s);
    }
});

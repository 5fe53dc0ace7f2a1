//! The egress policy and address parsers take any text without panicking,
//! and what they show parses back to the same value.
#![no_main]

use libfuzzer_sys::fuzz_target;
use runcell_egress::{HostRule, NetworkPolicy, PrivateException};

fuzz_target!(|s: &str| {
    if let Ok(r) = s.parse::<HostRule>() {
        let _ = r.matches(s, 443);
        assert_eq!(r.to_string().parse::<HostRule>().ok(), Some(r));
    }
    if let Ok(x) = s.parse::<PrivateException>() {
        assert_eq!(x.to_string().parse::<PrivateException>().ok(), Some(x));
    }
    if let Ok(p) = NetworkPolicy::parse_setting(s) {
        let _ = p.allows(s, 80);
    }
    let _ = serde_json::from_str::<NetworkPolicy>(s);
});

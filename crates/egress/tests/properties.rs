//! Property tests (proptest) for the egress policy and address parsers,
//! which take outside input: whatever they are given, they answer (a value
//! or an error) and never panic, and their classifications keep their
//! invariants. Pure: no sandbox, no root.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use proptest::prelude::*;
use runcell_egress::{classify, AddrClass, HostRule, NetworkPolicy, PrivateException};

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 512,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn every_ipv4_address_has_one_class_and_mapped_forms_agree(bits in any::<u32>()) {
        let v4 = Ipv4Addr::from(bits);
        let class = classify(IpAddr::V4(v4));
        // The IPv6 forms that carry an IPv4 address are judged by it.
        prop_assert_eq!(classify(IpAddr::V6(v4.to_ipv6_mapped())), class);
        let [a, b, ..] = v4.octets();
        let expected = match (a, b) {
            (127, _) => Some(AddrClass::Loopback),
            (10, _) => Some(AddrClass::Private),
            (172, 16..=31) | (192, 168) => Some(AddrClass::Private),
            (169, 254) => Some(AddrClass::LinkLocal),
            (224..=239, _) => Some(AddrClass::Multicast),
            (0, _) => Some(AddrClass::Unspecified),
            _ => None,
        };
        if let Some(e) = expected {
            prop_assert_eq!(class, e, "{}", v4);
        }
        if class.is_public() {
            prop_assert!(!v4.is_loopback() && !v4.is_private() && !v4.is_link_local()
                && !v4.is_multicast() && !v4.is_broadcast() && !v4.is_unspecified(), "{}", v4);
        }
    }

    #[test]
    fn ipv6_classification_is_total_and_never_public_for_special_ranges(bits in any::<u128>()) {
        let v6 = Ipv6Addr::from(bits);
        let class = classify(IpAddr::V6(v6));
        if class.is_public() {
            prop_assert!(!v6.is_loopback() && !v6.is_unspecified() && !v6.is_multicast(), "{}", v6);
            let first = v6.segments()[0];
            prop_assert!(first & 0xfe00 != 0xfc00, "unique local {} is public", v6);
            prop_assert!(first & 0xffc0 != 0xfe80, "link-local {} is public", v6);
        }
    }

    #[test]
    fn private_exceptions_parse_any_text_and_round_trip(s in "[0-9a-fA-F:./\\[\\]a-z%-]{0,45}|\\PC{0,30}") {
        if let Ok(x) = s.parse::<PrivateException>() {
            let again: PrivateException = x.to_string().parse().map_err(|e| TestCaseError::fail(format!("{x} does not parse back: {e}")))?;
            prop_assert_eq!(&again, &x);
            let _ = x.allows("example.com", SocketAddr::from(([10, 0, 0, 1], 443)));
        }
    }

    #[test]
    fn exceptions_match_only_what_they_name(bits in any::<u32>(), prefix in 0u8..=32, probe in any::<u32>(), port in any::<u16>()) {
        let net = Ipv4Addr::from(bits);
        let x: PrivateException = format!("{net}/{prefix}").parse().unwrap();
        let probe = Ipv4Addr::from(probe);
        let mask = if prefix == 0 { 0 } else { u32::MAX << (32 - prefix) };
        let inside = (u32::from(probe) & mask) == (u32::from(net) & mask);
        prop_assert_eq!(x.allows("h", SocketAddr::from((probe, port))), inside, "{} vs {}", x, probe);
    }

    #[test]
    fn host_rules_parse_any_text_and_match_without_panicking(rule in "\\PC{0,40}", host in "\\PC{0,40}", port in any::<u16>()) {
        if let Ok(r) = rule.parse::<HostRule>() {
            let _ = r.matches(&host, port);
            // What is shown (and stored) parses back to the same rule.
            let again: HostRule = r.to_string().parse().map_err(|e| TestCaseError::fail(format!("{r} does not parse back: {e}")))?;
            prop_assert_eq!(again, r);
        }
    }

    #[test]
    fn wildcard_rules_match_names_below_and_never_the_suffix_itself(
        // Wildcards need a dot in the suffix (no `*.com`).
        suffix in "[a-z][a-z0-9-]{0,10}(\\.[a-z][a-z0-9-]{0,10}){1,3}",
        label in "[a-z0-9][a-z0-9-]{0,10}",
        port in any::<u16>(),
    ) {
        let r: HostRule = format!("*.{suffix}").parse().unwrap();
        let default_port = port == 80 || port == 443;
        let below = format!("{label}.{suffix}");
        let below_upper_dot = format!("{}.{}.", label.to_uppercase(), suffix);
        let glued = format!("{label}{suffix}");
        prop_assert!(!r.matches(&suffix, port));
        prop_assert_eq!(r.matches(&below, port), default_port);
        prop_assert_eq!(r.matches(&below_upper_dot, port), default_port);
        // A name that only ends with the same letters is not below it.
        prop_assert!(!r.matches(&glued, port));
        let exact: HostRule = suffix.parse().unwrap();
        prop_assert_eq!(exact.matches(&suffix, port), default_port);
        prop_assert!(!exact.matches(&below, port));
    }

    #[test]
    fn network_settings_parse_any_text(s in "(none|open|allowlist:|\\{\"mode\":)?\\PC{0,60}") {
        if let Ok(p) = NetworkPolicy::parse_setting(&s) {
            let _ = p.allows("example.com", 443);
        }
        let _ = serde_json::from_str::<NetworkPolicy>(&s);
    }

    #[test]
    fn none_allows_nothing_and_open_allows_every_name(host in "\\PC{0,40}", port in any::<u16>()) {
        prop_assert!(!NetworkPolicy::none().allows(&host, port));
        prop_assert!(NetworkPolicy::open().allows(&host, port));
    }
}

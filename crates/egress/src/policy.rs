//! A sandbox's network policy: `none`, `allowlist` (host rules and presets)
//! or `open`.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Errors in a network policy given by a caller or a template.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// A host rule could not be parsed.
    #[error("{0:?} is not a host rule; use a host name (pypi.org), a wildcard (*.example.com), optionally with ports (pypi.org:443 or example.com:80,443).")]
    Rule(String),
    /// An unknown preset name.
    #[error("{0:?} is not a network preset; the presets are: package-index.")]
    Preset(String),
    /// An unknown mode.
    #[error("{0:?} is not a network mode; use none, allowlist or open.")]
    Mode(String),
    /// Rules given for a mode that does not use them.
    #[error("Host rules and presets only apply to the allowlist mode, not to {0}.")]
    RulesWithoutAllowlist(NetworkMode),
    /// More host rules or presets than a policy may have.
    #[error("A network policy may have at most {max} {what}, not {got}.")]
    TooMany {
        /// "host rules" or "presets".
        what: &'static str,
        /// How many were given.
        got: usize,
        /// The most allowed.
        max: usize,
    },
    /// The policy was not valid JSON.
    #[error("The network policy is not valid: {0}.")]
    Json(#[source] serde_json::Error),
}

/// The most host rules (`allow`) one policy may have: each connection is
/// checked against every one, and the policy is kept with the sandbox.
pub const MAX_RULES: usize = 256;
/// The most presets one policy may name.
pub const MAX_PRESETS: usize = 16;

/// How many bytes of a caller's mode, preset or rule an error quotes.
const QUOTED: usize = 256;

/// `s` as an error quotes it.
fn clipped(s: &str) -> String {
    runcell_protocol::text::clip(s, QUOTED).into_owned()
}

/// How much network a sandbox has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NetworkMode {
    /// Loopback only; no proxy, DNS and connections fail at once.
    #[default]
    None,
    /// Only hosts matching the rules, through the egress proxy.
    Allowlist,
    /// Any public host, through the egress proxy.
    Open,
}

impl fmt::Display for NetworkMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            NetworkMode::None => "none",
            NetworkMode::Allowlist => "allowlist",
            NetworkMode::Open => "open",
        })
    }
}

impl FromStr for NetworkMode {
    type Err = PolicyError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "none" => Ok(NetworkMode::None),
            "allowlist" => Ok(NetworkMode::Allowlist),
            "open" => Ok(NetworkMode::Open),
            _ => Err(PolicyError::Mode(clipped(s))),
        }
    }
}

/// Ports a rule without ports allows.
pub const DEFAULT_PORTS: [u16; 2] = [80, 443];

/// One allowlist entry: an exact host or a `*.suffix` wildcard, with ports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostRule {
    /// Lower-case host name, or the suffix (without `*.`) of a wildcard.
    host: String,
    /// `*.host`: any name strictly below `host`, not `host` itself.
    wildcard: bool,
    /// Allowed ports; empty means [`DEFAULT_PORTS`].
    ports: Vec<u16>,
}

impl HostRule {
    /// Whether a request for `host:port` matches this rule.
    pub fn matches(&self, host: &str, port: u16) -> bool {
        let host = normalize(host);
        let ports: &[u16] = if self.ports.is_empty() {
            &DEFAULT_PORTS
        } else {
            &self.ports
        };
        if !ports.contains(&port) {
            return false;
        }
        if self.wildcard {
            host.len() > self.host.len() + 1
                && host.ends_with(&self.host)
                && host.as_bytes()[host.len() - self.host.len() - 1] == b'.'
        } else {
            host == self.host
        }
    }
}

fn normalize(host: &str) -> String {
    host.trim()
        .trim_end_matches('.')
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_ascii_lowercase()
}

fn valid_host(h: &str) -> bool {
    if h.parse::<std::net::IpAddr>().is_ok() {
        return true;
    }
    !h.is_empty()
        && h.len() <= 253
        && h.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && l.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        })
}

impl FromStr for HostRule {
    type Err = PolicyError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || PolicyError::Rule(clipped(s));
        let t = s.trim();
        // [v6]:ports, v6 alone, or host[:ports].
        let (host, ports) = if let Some(rest) = t.strip_prefix('[') {
            let (h, after) = rest.split_once(']').ok_or_else(bad)?;
            match after.strip_prefix(':') {
                Some(p) => (h, Some(p)),
                None if after.is_empty() => (h, None),
                None => return Err(bad()),
            }
        } else if t.parse::<std::net::Ipv6Addr>().is_ok() {
            (t, None)
        } else {
            match t.split_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (t, None),
            }
        };
        let host = normalize(host);
        let (host, wildcard) = match host.strip_prefix("*.") {
            Some(rest) => (rest.to_string(), true),
            None => (host, false),
        };
        if !valid_host(&host) || (wildcard && !host.contains('.')) {
            return Err(bad());
        }
        let ports = match ports {
            None => Vec::new(),
            Some(p) => p
                .split(',')
                .map(|x| x.trim().parse::<u16>().ok().filter(|&n| n != 0))
                .collect::<Option<Vec<u16>>>()
                .ok_or_else(bad)?,
        };
        Ok(HostRule {
            host,
            wildcard,
            ports,
        })
    }
}

impl fmt::Display for HostRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.wildcard {
            f.write_str("*.")?;
        }
        if self.host.contains(':') {
            write!(f, "[{}]", self.host)?;
        } else {
            f.write_str(&self.host)?;
        }
        if !self.ports.is_empty() {
            let p: Vec<String> = self.ports.iter().map(u16::to_string).collect();
            write!(f, ":{}", p.join(","))?;
        }
        Ok(())
    }
}

impl Serialize for HostRule {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for HostRule {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Named rule sets.
pub const PRESETS: &[(&str, &[&str])] = &[(
    "package-index",
    &[
        "pypi.org:443",
        "files.pythonhosted.org:443",
        "registry.npmjs.org:443",
    ],
)];

fn preset(name: &str) -> Result<Vec<HostRule>, PolicyError> {
    PRESETS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, rules)| {
            rules
                .iter()
                .map(|r| r.parse().expect("preset rules parse"))
                .collect()
        })
        .ok_or_else(|| PolicyError::Preset(clipped(name)))
}

/// A sandbox's network policy.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct NetworkPolicy {
    /// The mode.
    pub mode: NetworkMode,
    /// Host rules (allowlist mode), as given.
    #[serde(default)]
    pub allow: Vec<HostRule>,
    /// Presets (allowlist mode), as given.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub presets: Vec<String>,
    /// `allow` plus the presets' rules.
    #[serde(skip)]
    effective: Vec<HostRule>,
}

/// What callers may send: a mode string or an object.
#[derive(Deserialize)]
#[serde(untagged)]
enum PolicyInput {
    Mode(String),
    Full {
        mode: Option<String>,
        #[serde(default)]
        allow: Vec<String>,
        #[serde(default)]
        presets: Vec<String>,
    },
}

impl<'de> Deserialize<'de> for NetworkPolicy {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let input = PolicyInput::deserialize(d)?;
        let r = match input {
            PolicyInput::Mode(m) => {
                NetworkPolicy::new(m.parse().map_err(serde::de::Error::custom)?, vec![], vec![])
            }
            PolicyInput::Full {
                mode,
                allow,
                presets,
            } => {
                let mode = match mode {
                    Some(m) => m.parse().map_err(serde::de::Error::custom)?,
                    // {"allow": [...]} alone means an allowlist.
                    None if !allow.is_empty() || !presets.is_empty() => NetworkMode::Allowlist,
                    None => NetworkMode::None,
                };
                if allow.len() > MAX_RULES {
                    return Err(serde::de::Error::custom(PolicyError::TooMany {
                        what: "host rules",
                        got: allow.len(),
                        max: MAX_RULES,
                    }));
                }
                let rules = allow
                    .iter()
                    .map(|r| r.parse())
                    .collect::<Result<Vec<HostRule>, _>>()
                    .map_err(serde::de::Error::custom)?;
                NetworkPolicy::new(mode, rules, presets)
            }
        };
        r.map_err(serde::de::Error::custom)
    }
}

impl NetworkPolicy {
    /// A policy; fails for unknown presets or rules outside allowlist mode.
    pub fn new(
        mode: NetworkMode,
        allow: Vec<HostRule>,
        presets: Vec<String>,
    ) -> Result<Self, PolicyError> {
        if mode != NetworkMode::Allowlist && (!allow.is_empty() || !presets.is_empty()) {
            return Err(PolicyError::RulesWithoutAllowlist(mode));
        }
        for (what, got, max) in [
            ("host rules", allow.len(), MAX_RULES),
            ("presets", presets.len(), MAX_PRESETS),
        ] {
            if got > max {
                return Err(PolicyError::TooMany { what, got, max });
            }
        }
        let mut effective = allow.clone();
        for p in &presets {
            effective.extend(preset(p)?);
        }
        Ok(Self {
            mode,
            allow,
            presets,
            effective,
        })
    }

    /// No network.
    pub fn none() -> Self {
        Self::default()
    }

    /// Any public host.
    pub fn open() -> Self {
        Self {
            mode: NetworkMode::Open,
            ..Self::default()
        }
    }

    /// Parses a template's `defaults.network` or a command-line value:
    /// `none`, `open`, `allowlist:RULE,RULE,...` (rules or preset names,
    /// comma-separated ports not allowed there: use `;`), or a JSON object.
    pub fn parse_setting(s: &str) -> Result<Self, PolicyError> {
        let t = s.trim();
        if t.starts_with('{') || t.starts_with('"') {
            return serde_json::from_str(t).map_err(PolicyError::Json);
        }
        if let Some(list) = t.strip_prefix("allowlist:") {
            let mut rules = Vec::new();
            let mut presets = Vec::new();
            for item in list
                .split(';')
                .flat_map(|x| x.split(' '))
                .map(str::trim)
                .filter(|x| !x.is_empty())
            {
                if PRESETS.iter().any(|(n, _)| *n == item) {
                    presets.push(item.to_string());
                } else {
                    rules.push(item.parse()?);
                }
            }
            return Self::new(NetworkMode::Allowlist, rules, presets);
        }
        Self::new(t.parse()?, vec![], vec![])
    }

    /// Whether the proxy should serve this sandbox at all.
    pub fn has_egress(&self) -> bool {
        self.mode != NetworkMode::None
    }

    /// Whether the policy allows asking for `host:port` (addresses are
    /// checked separately, after resolution).
    pub fn allows(&self, host: &str, port: u16) -> bool {
        match self.mode {
            NetworkMode::None => false,
            NetworkMode::Open => true,
            NetworkMode::Allowlist => self.effective.iter().any(|r| r.matches(host, port)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(s: &str) -> HostRule {
        s.parse().unwrap()
    }

    #[test]
    fn exact_rules_match_only_that_host_on_default_ports() {
        let r = rule("PyPI.org");
        assert!(r.matches("pypi.org", 443));
        assert!(r.matches("pypi.org.", 80));
        assert!(r.matches("PYPI.ORG", 443));
        assert!(!r.matches("pypi.org", 22));
        assert!(!r.matches("evil-pypi.org", 443));
        assert!(!r.matches("pypi.org.evil.example", 443));
        assert!(!r.matches("x.pypi.org", 443));
    }

    #[test]
    fn wildcards_match_subdomains_only() {
        let r = rule("*.pythonhosted.org:443");
        assert!(r.matches("files.pythonhosted.org", 443));
        assert!(r.matches("a.b.pythonhosted.org", 443));
        assert!(!r.matches("pythonhosted.org", 443));
        assert!(!r.matches("evilpythonhosted.org", 443));
        assert!(!r.matches("files.pythonhosted.org", 80));
        assert!("*.com".parse::<HostRule>().is_err());
    }

    #[test]
    fn ports() {
        let r = rule("example.com:8080,8443");
        assert!(r.matches("example.com", 8080));
        assert!(r.matches("example.com", 8443));
        assert!(!r.matches("example.com", 443));
        assert_eq!(r.to_string(), "example.com:8080,8443");
        assert!("example.com:0".parse::<HostRule>().is_err());
        assert!("example.com:x".parse::<HostRule>().is_err());
        assert!("exa mple.com".parse::<HostRule>().is_err());
        let v6 = rule("[2001:db8::1]:443");
        assert!(v6.matches("[2001:db8::1]", 443));
        assert!(v6.matches("2001:db8::1", 443));
        assert_eq!(v6.to_string(), "[2001:db8::1]:443");
    }

    #[test]
    fn modes() {
        assert!(!NetworkPolicy::none().allows("pypi.org", 443));
        assert!(NetworkPolicy::open().allows("anything.example", 8080));
        let p =
            NetworkPolicy::new(NetworkMode::Allowlist, vec![rule("example.com")], vec![]).unwrap();
        assert!(p.allows("example.com", 443));
        assert!(!p.allows("example.org", 443));
        assert!(NetworkPolicy::new(NetworkMode::Open, vec![rule("x.com")], vec![]).is_err());
    }

    #[test]
    fn preset_package_index() {
        let p: NetworkPolicy =
            serde_json::from_str(r#"{"mode":"allowlist","presets":["package-index"]}"#).unwrap();
        assert!(p.allows("pypi.org", 443));
        assert!(p.allows("files.pythonhosted.org", 443));
        assert!(p.allows("registry.npmjs.org", 443));
        assert!(!p.allows("pypi.org", 80));
        assert!(!p.allows("example.com", 443));
        assert!(serde_json::from_str::<NetworkPolicy>(
            r#"{"mode":"allowlist","presets":["nope"]}"#
        )
        .is_err());
    }

    #[test]
    fn json_forms_round_trip() {
        let p: NetworkPolicy = serde_json::from_str(
            r#"{"mode":"allowlist","allow":["pypi.org","*.pythonhosted.org:443"],"presets":["package-index"]}"#,
        )
        .unwrap();
        assert_eq!(p.mode, NetworkMode::Allowlist);
        let v = serde_json::to_value(&p).unwrap();
        assert_eq!(
            v["allow"],
            serde_json::json!(["pypi.org", "*.pythonhosted.org:443"])
        );
        assert_eq!(v["presets"], serde_json::json!(["package-index"]));
        let back: NetworkPolicy = serde_json::from_value(v).unwrap();
        assert_eq!(back, p);
        let open: NetworkPolicy = serde_json::from_str(r#""open""#).unwrap();
        assert_eq!(open, NetworkPolicy::open());
        let none: NetworkPolicy = serde_json::from_str(r#""none""#).unwrap();
        assert_eq!(none, NetworkPolicy::none());
        assert!(serde_json::from_str::<NetworkPolicy>(r#""wide""#).is_err());
        assert!(
            serde_json::from_str::<NetworkPolicy>(r#"{"mode":"allowlist","allow":["a b"]}"#)
                .is_err()
        );
    }

    #[test]
    fn settings() {
        assert_eq!(
            NetworkPolicy::parse_setting("none").unwrap(),
            NetworkPolicy::none()
        );
        assert_eq!(
            NetworkPolicy::parse_setting("open").unwrap(),
            NetworkPolicy::open()
        );
        let p =
            NetworkPolicy::parse_setting("allowlist:package-index;example.com:8080,8443").unwrap();
        assert!(p.allows("pypi.org", 443));
        assert!(p.allows("example.com", 8443));
        assert!(NetworkPolicy::parse_setting("sometimes").is_err());
    }

    #[test]
    fn a_policy_is_bounded_and_quotes_no_value_whole() {
        let rules: Vec<String> = (0..=MAX_RULES)
            .map(|i| format!("h{i}.example.com"))
            .collect();
        let e = serde_json::from_value::<NetworkPolicy>(serde_json::json!({"allow": rules}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("at most 256 host rules, not 257"), "{e}");
        let ok: Vec<String> = rules[..MAX_RULES].to_vec();
        serde_json::from_value::<NetworkPolicy>(serde_json::json!({"allow": ok})).unwrap();
        let presets = vec!["package-index"; MAX_PRESETS + 1];
        let e = serde_json::from_value::<NetworkPolicy>(serde_json::json!({"presets": presets}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("at most 16 presets"), "{e}");
        let huge = "x".repeat(1 << 20);
        for body in [
            serde_json::json!({"allow": [format!("{huge}/")]}),
            serde_json::json!({"presets": [huge.clone()]}),
            serde_json::json!({"mode": huge.clone()}),
            serde_json::json!(huge.clone()),
        ] {
            let e = serde_json::from_value::<NetworkPolicy>(body)
                .unwrap_err()
                .to_string();
            assert!(e.len() < 600, "{} bytes: {}", e.len(), &e[..300]);
            assert!(e.contains("bytes in all"), "{e}");
        }
    }
}

//! Node labels and label selectors for placement, with Kubernetes' label
//! syntax: a node carries `key=value` labels (`--node-label`), a create may
//! ask for `"node_selector": {"key": "value", ...}`, and only nodes that
//! carry every pair are candidates (equality-based, as a Kubernetes
//! `nodeSelector`).
//!
//! A key is an optional prefix (a DNS subdomain, at most 253 characters)
//! and `/`, then a name of at most 63 characters; a value is at most 63
//! characters, possibly empty. Names and values are alphanumeric at both
//! ends with `-`, `_` and `.` between.

use std::collections::BTreeMap;

/// Most labels one node carries.
pub const MAX_LABELS: usize = 64;
/// Most pairs one selector asks for.
pub const MAX_SELECTOR: usize = 32;
const MAX_NAME: usize = 63;
const MAX_PREFIX: usize = 253;

/// A label or selector that is not well formed.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum LabelError {
    /// `--node-label` without `=`.
    #[error("A node label is key=value, not {0:?}.")]
    NoEquals(String),
    /// A key breaks the syntax.
    #[error("The label key {key:?} is invalid: {why}.")]
    Key {
        /// The key.
        key: String,
        /// What is wrong.
        why: &'static str,
    },
    /// A value breaks the syntax.
    #[error("The value {value:?} of label {key:?} is invalid: {why}.")]
    Value {
        /// Its key.
        key: String,
        /// The value.
        value: String,
        /// What is wrong.
        why: &'static str,
    },
    /// Too many pairs.
    #[error("At most {max} labels are allowed, not {got}.")]
    TooMany {
        /// The limit.
        max: usize,
        /// How many there were.
        got: usize,
    },
    /// The same key twice on one node.
    #[error("The node label {0:?} is given twice.")]
    Duplicate(String),
}

fn alnum(c: char) -> bool {
    c.is_ascii_alphanumeric()
}

/// A label name or value's body: alphanumeric ends, `-_.` between.
fn name_like(s: &str) -> Result<(), &'static str> {
    if s.len() > MAX_NAME {
        return Err("it is longer than 63 characters");
    }
    if !s.chars().all(|c| alnum(c) || matches!(c, '-' | '_' | '.')) {
        return Err("only letters, digits, '-', '_' and '.' are allowed");
    }
    if !s.starts_with(alnum) || !s.ends_with(alnum) {
        return Err("it must begin and end with a letter or digit");
    }
    Ok(())
}

/// Checks a label key (`[prefix/]name`).
pub fn check_key(key: &str) -> Result<(), LabelError> {
    let bad = |why| LabelError::Key {
        key: key.into(),
        why,
    };
    let name = match key.split_once('/') {
        Some((prefix, name)) => {
            if prefix.is_empty() || prefix.len() > MAX_PREFIX {
                return Err(bad("its prefix must be 1 to 253 characters"));
            }
            let dns = prefix.split('.').all(|part| {
                !part.is_empty()
                    && part.len() <= MAX_NAME
                    && part
                        .chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                    && part.starts_with(alnum)
                    && part.ends_with(alnum)
            });
            if !dns {
                return Err(bad("its prefix must be a lowercase DNS subdomain"));
            }
            name
        }
        None => key,
    };
    if name.is_empty() {
        return Err(bad("its name is empty"));
    }
    name_like(name).map_err(bad)
}

/// Checks a label value (may be empty).
pub fn check_value(key: &str, value: &str) -> Result<(), LabelError> {
    if value.is_empty() {
        return Ok(());
    }
    name_like(value).map_err(|why| LabelError::Value {
        key: key.into(),
        value: value.into(),
        why,
    })
}

/// Parses a node's `--node-label key=value` flags.
pub fn parse_node_labels(flags: &[String]) -> Result<BTreeMap<String, String>, LabelError> {
    if flags.len() > MAX_LABELS {
        return Err(LabelError::TooMany {
            max: MAX_LABELS,
            got: flags.len(),
        });
    }
    let mut out = BTreeMap::new();
    for flag in flags {
        let (k, v) = flag
            .split_once('=')
            .ok_or_else(|| LabelError::NoEquals(flag.clone()))?;
        check_key(k)?;
        check_value(k, v)?;
        if out.insert(k.to_string(), v.to_string()).is_some() {
            return Err(LabelError::Duplicate(k.into()));
        }
    }
    Ok(out)
}

/// Checks a create's `node_selector`.
pub fn check_selector(selector: &BTreeMap<String, String>) -> Result<(), LabelError> {
    if selector.len() > MAX_SELECTOR {
        return Err(LabelError::TooMany {
            max: MAX_SELECTOR,
            got: selector.len(),
        });
    }
    for (k, v) in selector {
        check_key(k)?;
        check_value(k, v)?;
    }
    Ok(())
}

/// Whether a node's labels carry every pair of the selector.
pub fn matches(labels: &BTreeMap<String, String>, selector: &BTreeMap<String, String>) -> bool {
    selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// `k1=v1,k2=v2`, as messages show a selector or a node's labels.
pub fn show(labels: &BTreeMap<String, String>) -> String {
    labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn kubernetes_style_keys_and_values_are_accepted() {
        for key in [
            "zone",
            "a",
            "disk_type",
            "Gpu.Count-2",
            "runcell.dev/node-name",
            "topology.kubernetes.io/zone",
            &"k".repeat(63),
        ] {
            assert_eq!(check_key(key), Ok(()), "{key}");
        }
        for value in ["", "a", "eu-west-1a", "V1.2_3", &"v".repeat(63)] {
            assert_eq!(check_value("k", value), Ok(()), "{value}");
        }
    }

    #[test]
    fn malformed_keys_and_values_are_refused_saying_why() {
        for (key, says) in [
            ("", "empty"),
            ("-zone", "begin and end"),
            ("zone-", "begin and end"),
            ("zo ne", "only letters"),
            ("zone=a", "only letters"),
            (&"k".repeat(64), "63"),
            ("/zone", "prefix"),
            ("Runcell.dev/zone", "lowercase DNS"),
            ("runcell..dev/zone", "lowercase DNS"),
            ("runcell.dev/", "empty"),
            ("a/b/c", "only letters"),
        ] {
            let e = check_key(key).unwrap_err().to_string();
            assert!(e.contains(says), "{key:?}: {e}");
        }
        for (value, says) in [
            ("-a", "begin and end"),
            ("a b", "only letters"),
            ("é", "only letters"),
            (&"v".repeat(64), "63"),
        ] {
            let e = check_value("zone", value).unwrap_err().to_string();
            assert!(e.contains(says) && e.contains("zone"), "{value:?}: {e}");
        }
    }

    #[test]
    fn node_label_flags_are_key_equals_value_once_each() {
        assert_eq!(
            parse_node_labels(&["zone=a".into(), "gpu=".into()]).unwrap(),
            map(&[("zone", "a"), ("gpu", "")])
        );
        assert_eq!(
            parse_node_labels(&["zone".into()]),
            Err(LabelError::NoEquals("zone".into()))
        );
        assert_eq!(
            parse_node_labels(&["zone=a".into(), "zone=b".into()]),
            Err(LabelError::Duplicate("zone".into()))
        );
        let many: Vec<String> = (0..65).map(|i| format!("k{i}=v")).collect();
        assert!(matches!(
            parse_node_labels(&many),
            Err(LabelError::TooMany { max: 64, got: 65 })
        ));
    }

    #[test]
    fn a_selector_matches_nodes_that_carry_all_its_pairs() {
        let node = map(&[("zone", "a"), ("disk", "ssd")]);
        assert!(matches(&node, &map(&[])));
        assert!(matches(&node, &map(&[("zone", "a")])));
        assert!(matches(&node, &map(&[("zone", "a"), ("disk", "ssd")])));
        assert!(!matches(&node, &map(&[("zone", "b")])));
        assert!(!matches(&node, &map(&[("zone", "a"), ("gpu", "1")])));
        assert_eq!(show(&node), "disk=ssd,zone=a");
        let big: BTreeMap<String, String> =
            (0..33).map(|i| (format!("k{i}"), "v".into())).collect();
        assert!(check_selector(&big).is_err());
    }
}

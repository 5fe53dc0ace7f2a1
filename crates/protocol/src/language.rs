//! The languages `run code` understands and how each one is started.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A language that sandboxes can run code in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Language {
    /// Python 3 (`python3` on the template's PATH).
    Python,
    /// JavaScript on Node.js (`node`).
    Javascript,
    /// Bash (`bash`).
    Bash,
}

impl Language {
    /// Every language, in the order they are listed to users.
    pub const ALL: [Language; 3] = [Language::Python, Language::Javascript, Language::Bash];

    /// The canonical name.
    pub fn name(self) -> &'static str {
        match self {
            Language::Python => "python",
            Language::Javascript => "javascript",
            Language::Bash => "bash",
        }
    }

    /// The interpreter that runs a source file of this language.
    pub fn interpreter(self) -> &'static str {
        match self {
            Language::Python => "python3",
            Language::Javascript => "node",
            Language::Bash => "bash",
        }
    }

    /// File extension for a source file.
    pub fn extension(self) -> &'static str {
        match self {
            Language::Python => "py",
            Language::Javascript => "js",
            Language::Bash => "sh",
        }
    }
}

impl fmt::Display for Language {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A language name that runcell does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("Unknown language \"{0}\"; known languages are python, javascript and bash.")]
pub struct UnknownLanguage(pub String);

impl FromStr for Language {
    type Err = UnknownLanguage;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "python" | "python3" | "py" => Ok(Language::Python),
            "javascript" | "js" | "node" | "nodejs" => Ok(Language::Javascript),
            "bash" | "sh" | "shell" => Ok(Language::Bash),
            _ => Err(UnknownLanguage(
                crate::text::clip(s, NAME_ECHO).into_owned(),
            )),
        }
    }
}

/// How many bytes of an unknown language's name its error repeats.
const NAME_ECHO: usize = 64;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unknown_name_is_repeated_short() {
        let long = "é".repeat(100_000);
        let e = long.parse::<Language>().unwrap_err().to_string();
        assert!(e.len() < 400, "{} bytes", e.len());
        assert!(e.contains("é... (200000 bytes in all)"), "{e}");
        let e = "cobol".parse::<Language>().unwrap_err().to_string();
        assert!(e.contains("\"cobol\""), "{e}");
    }

    #[test]
    fn parses_names_and_aliases_and_lists_known_ones_on_error() {
        assert_eq!("Python".parse::<Language>().unwrap(), Language::Python);
        assert_eq!("node".parse::<Language>().unwrap(), Language::Javascript);
        assert_eq!("sh".parse::<Language>().unwrap(), Language::Bash);
        let err = "cobol".parse::<Language>().unwrap_err().to_string();
        assert!(err.contains("cobol") && err.contains("python, javascript and bash"));
    }
}

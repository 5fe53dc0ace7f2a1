//! The Dockerfile subset `runcell template build` understands:
//! `FROM debian:<suite>` or `FROM <template>` (first), `RUN` (shell or JSON
//! exec form), `ENV`, `WORKDIR`, `COPY`, `USER` and `LABEL`, with `\` line
//! continuations and `#` comments.

/// The instructions the builder supports, for error messages.
pub const SUPPORTED: &str = "FROM, RUN, ENV, WORKDIR, COPY, USER, LABEL";

/// A recipe that cannot be parsed. Every message names the line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// An instruction the builder does not support.
    #[error(
        "Line {line}: {instruction} is not supported; the supported instructions are {SUPPORTED}."
    )]
    Unsupported {
        /// Line number (1-based) where the instruction starts.
        line: usize,
        /// The instruction as written.
        instruction: String,
    },
    /// A supported instruction with arguments it cannot take.
    #[error("Line {line}: {message}")]
    Invalid {
        /// Line number (1-based).
        line: usize,
        /// What is wrong, as a sentence.
        message: String,
    },
    /// The first instruction is not FROM.
    #[error("Line {line}: the first instruction must be FROM (e.g. FROM debian:bookworm).")]
    FromFirst {
        /// Line of the first instruction.
        line: usize,
    },
    /// The recipe has no instructions.
    #[error(
        "The recipe has no instructions; it must start with FROM (e.g. FROM debian:bookworm)."
    )]
    Empty,
    /// The file ends inside a line continuation.
    #[error(
        "Line {line}: the instruction ends with a line continuation (\\) but the file ends there."
    )]
    DanglingContinuation {
        /// Line where the unfinished instruction starts.
        line: usize,
    },
}

/// What a recipe starts from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Base {
    /// A Debian suite, built with debootstrap.
    Debian {
        /// The suite, e.g. `bookworm`.
        suite: String,
    },
    /// An installed layered template.
    Template(String),
}

/// A command for `RUN`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunCommand {
    /// Shell form, run with `/bin/sh -c`.
    Shell(String),
    /// JSON exec form: an argv.
    Exec(Vec<String>),
}

impl RunCommand {
    /// The argv to execute.
    pub fn argv(&self) -> Vec<String> {
        match self {
            RunCommand::Shell(s) => vec!["/bin/sh".into(), "-c".into(), s.clone()],
            RunCommand::Exec(v) => v.clone(),
        }
    }
}

/// One instruction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Instruction {
    /// `FROM`.
    From(Base),
    /// `RUN`.
    Run(RunCommand),
    /// `ENV k=v ...` or `ENV k v`.
    Env(Vec<(String, String)>),
    /// `WORKDIR path`.
    Workdir(String),
    /// `COPY src... dest`.
    Copy {
        /// Paths in the build context.
        sources: Vec<String>,
        /// Destination in the image.
        dest: String,
    },
    /// `USER name|uid[:group|gid]`.
    User {
        /// User name or uid.
        user: String,
        /// Group name or gid.
        group: Option<String>,
    },
    /// `LABEL k=v ...`.
    Label(Vec<(String, String)>),
}

/// One instruction with where it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// Line (1-based) where it starts.
    pub line: usize,
    /// `KEYWORD arguments`, continuations joined: what progress shows and
    /// what the cache key hashes.
    pub text: String,
    /// The parsed instruction.
    pub instruction: Instruction,
}

/// Parses a recipe.
pub fn parse(src: &str) -> Result<Vec<Step>, ParseError> {
    let mut steps = Vec::new();
    let mut pending: Option<(usize, String)> = None;
    for (i, raw) in src.lines().enumerate() {
        let n = i + 1;
        let trimmed = raw.trim();
        // Comment and blank lines are dropped, also inside a continuation
        // (as Docker does).
        if trimmed.starts_with('#') || trimmed.is_empty() {
            continue;
        }
        let (start, mut text) = pending.take().unwrap_or((n, String::new()));
        let line = raw.trim_end();
        if let Some(body) = line.strip_suffix('\\') {
            text.push_str(body);
            pending = Some((start, text));
            continue;
        }
        text.push_str(line);
        if !text.trim().is_empty() {
            steps.push(parse_instruction(start, text.trim())?);
        }
    }
    if let Some((line, _)) = pending {
        return Err(ParseError::DanglingContinuation { line });
    }
    let Some(first) = steps.first() else {
        return Err(ParseError::Empty);
    };
    if !matches!(first.instruction, Instruction::From(_)) {
        return Err(ParseError::FromFirst { line: first.line });
    }
    if let Some(again) = steps
        .iter()
        .skip(1)
        .find(|s| matches!(s.instruction, Instruction::From(_)))
    {
        return Err(ParseError::Invalid {
            line: again.line,
            message: "only one FROM is supported (no multi-stage builds).".into(),
        });
    }
    Ok(steps)
}

fn invalid(line: usize, message: impl Into<String>) -> ParseError {
    ParseError::Invalid {
        line,
        message: message.into(),
    }
}

fn parse_instruction(line: usize, text: &str) -> Result<Step, ParseError> {
    let (word, rest) = match text.split_once(char::is_whitespace) {
        Some((w, r)) => (w, r.trim()),
        None => (text, ""),
    };
    let keyword = word.to_ascii_uppercase();
    let need_args = |what: &str| {
        if rest.is_empty() {
            Err(invalid(line, format!("{keyword} needs {what}.")))
        } else {
            Ok(())
        }
    };
    let instruction = match keyword.as_str() {
        "FROM" => {
            need_args("an image, e.g. FROM debian:bookworm")?;
            let words: Vec<&str> = rest.split_whitespace().collect();
            if words.len() > 1 {
                return Err(invalid(
                    line,
                    "FROM takes one image; stages (FROM ... AS name) and --platform are not supported.",
                ));
            }
            let image = words[0];
            if let Some(suite) = image.strip_prefix("debian:") {
                let ok = !suite.is_empty()
                    && suite
                        .chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
                if !ok {
                    return Err(invalid(
                        line,
                        format!("\"{suite}\" is not a Debian suite name (e.g. bookworm)."),
                    ));
                }
                Instruction::From(Base::Debian {
                    suite: suite.into(),
                })
            } else if image == "debian" {
                return Err(invalid(
                    line,
                    "FROM debian needs a suite, e.g. FROM debian:bookworm.",
                ));
            } else if crate::Template::valid_name(image) {
                Instruction::From(Base::Template(image.into()))
            } else {
                return Err(invalid(
                    line,
                    format!(
                        "FROM {image}: the base must be debian:<suite> or an installed runcell template."
                    ),
                ));
            }
        }
        "RUN" => {
            need_args("a command")?;
            if rest.starts_with('[') {
                let argv = json_array(rest).map_err(|m| invalid(line, format!("RUN {m}")))?;
                Instruction::Run(RunCommand::Exec(argv))
            } else {
                Instruction::Run(RunCommand::Shell(rest.into()))
            }
        }
        "ENV" => {
            need_args("NAME=VALUE")?;
            let first = rest.split_whitespace().next().unwrap_or_default();
            let pairs = if first.contains('=') {
                pairs(rest).map_err(|m| invalid(line, format!("ENV {m}")))?
            } else {
                let (k, v) = rest
                    .split_once(char::is_whitespace)
                    .ok_or_else(|| invalid(line, "ENV needs NAME=VALUE (or NAME VALUE)."))?;
                vec![(k.to_string(), v.trim().to_string())]
            };
            for (k, _) in &pairs {
                let ok = k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                    && !k.starts_with(|c: char| c.is_ascii_digit());
                if !ok {
                    return Err(invalid(
                        line,
                        format!("\"{k}\" is not a valid environment variable name."),
                    ));
                }
            }
            Instruction::Env(pairs)
        }
        "LABEL" => {
            need_args("KEY=VALUE")?;
            let pairs = pairs(rest).map_err(|m| invalid(line, format!("LABEL {m}")))?;
            Instruction::Label(pairs)
        }
        "WORKDIR" => {
            need_args("a directory")?;
            let words = words(rest).map_err(|m| invalid(line, format!("WORKDIR {m}")))?;
            if words.len() != 1 {
                return Err(invalid(line, "WORKDIR takes one directory."));
            }
            Instruction::Workdir(words[0].clone())
        }
        "COPY" => {
            need_args("sources and a destination")?;
            if rest.starts_with("--") {
                let flag = rest.split_whitespace().next().unwrap_or_default();
                return Err(invalid(
                    line,
                    format!("COPY options such as {flag} are not supported; files are copied as root with their modes."),
                ));
            }
            let mut all = if rest.starts_with('[') {
                json_array(rest).map_err(|m| invalid(line, format!("COPY {m}")))?
            } else {
                words(rest).map_err(|m| invalid(line, format!("COPY {m}")))?
            };
            if all.len() < 2 {
                return Err(invalid(
                    line,
                    "COPY needs at least one source and a destination.",
                ));
            }
            let dest = all.pop().expect("two or more");
            Instruction::Copy { sources: all, dest }
        }
        "USER" => {
            need_args("a user name or uid")?;
            let words: Vec<&str> = rest.split_whitespace().collect();
            if words.len() != 1 {
                return Err(invalid(line, "USER takes one user[:group]."));
            }
            let (user, group) = match words[0].split_once(':') {
                Some((u, g)) => (u.to_string(), Some(g.to_string())),
                None => (words[0].to_string(), None),
            };
            if user.is_empty() || group.as_deref() == Some("") {
                return Err(invalid(line, "USER takes user[:group], neither empty."));
            }
            Instruction::User { user, group }
        }
        _ => {
            return Err(ParseError::Unsupported {
                line,
                instruction: keyword,
            })
        }
    };
    Ok(Step {
        line,
        text: format!("{keyword} {rest}"),
        instruction,
    })
}

fn json_array(s: &str) -> Result<Vec<String>, String> {
    let v: Vec<String> = serde_json::from_str(s)
        .map_err(|e| format!("in JSON form must be an array of strings ({e})."))?;
    if v.is_empty() {
        return Err("in JSON form needs at least one element.".into());
    }
    Ok(v)
}

/// Splits shell-like words: whitespace separates, `"..."` and `'...'`
/// quote, a backslash escapes the next character (outside single quotes).
fn words(s: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        match c {
            c if c.is_whitespace() => {
                if in_word {
                    out.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            '\\' => {
                in_word = true;
                cur.extend(chars.next());
            }
            '\'' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('\'') => break,
                        Some(c) => cur.push(c),
                        None => return Err("has an unterminated ' quote.".into()),
                    }
                }
            }
            '"' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('"') => break,
                        Some('\\') => cur.extend(chars.next()),
                        Some(c) => cur.push(c),
                        None => return Err("has an unterminated \" quote.".into()),
                    }
                }
            }
            c => {
                in_word = true;
                cur.push(c);
            }
        }
    }
    if in_word {
        out.push(cur);
    }
    Ok(out)
}

fn pairs(s: &str) -> Result<Vec<(String, String)>, String> {
    words(s)?
        .into_iter()
        .map(|w| match w.split_once('=') {
            Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
            _ => Err(format!("expects KEY=VALUE pairs; \"{w}\" is not one.")),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn instructions(src: &str) -> Vec<Instruction> {
        parse(src)
            .unwrap()
            .into_iter()
            .map(|s| s.instruction)
            .collect()
    }

    #[test]
    fn parses_every_instruction_with_continuations_and_comments() {
        let src = "# syntax comment\n\
                   FROM debian:bookworm\n\
                   \n\
                   RUN apt-get update && \\\n    # a comment inside\n    apt-get install -y curl\n\
                   RUN [\"/bin/echo\", \"hi there\"]\n\
                   ENV A=1 B=\"two words\" C=x\\ y\n\
                   ENV LONG a value with spaces\n\
                   WORKDIR /app\n\
                   COPY a.txt dir/ /app/\n\
                   COPY [\"b c.txt\", \"/opt/\"]\n\
                   user tester:staff\n\
                   LABEL runcell.memory=1g runcell.preload=\"numpy pandas\"\n";
        let steps = parse(src).unwrap();
        assert_eq!(steps[0].line, 2);
        assert_eq!(steps[1].line, 4);
        assert_eq!(
            steps[1].text,
            "RUN apt-get update &&     apt-get install -y curl"
        );
        assert_eq!(steps[8].text, "USER tester:staff");
        assert_eq!(
            instructions(src),
            vec![
                Instruction::From(Base::Debian {
                    suite: "bookworm".into()
                }),
                Instruction::Run(RunCommand::Shell(
                    "apt-get update &&     apt-get install -y curl".into()
                )),
                Instruction::Run(RunCommand::Exec(vec![
                    "/bin/echo".into(),
                    "hi there".into()
                ])),
                Instruction::Env(vec![
                    ("A".into(), "1".into()),
                    ("B".into(), "two words".into()),
                    ("C".into(), "x y".into()),
                ]),
                Instruction::Env(vec![("LONG".into(), "a value with spaces".into())]),
                Instruction::Workdir("/app".into()),
                Instruction::Copy {
                    sources: vec!["a.txt".into(), "dir/".into()],
                    dest: "/app/".into()
                },
                Instruction::Copy {
                    sources: vec!["b c.txt".into()],
                    dest: "/opt/".into()
                },
                Instruction::User {
                    user: "tester".into(),
                    group: Some("staff".into())
                },
                Instruction::Label(vec![
                    ("runcell.memory".into(), "1g".into()),
                    ("runcell.preload".into(), "numpy pandas".into()),
                ]),
            ]
        );
        assert_eq!(
            RunCommand::Shell("echo hi".into()).argv(),
            vec!["/bin/sh", "-c", "echo hi"]
        );
    }

    #[test]
    fn from_a_template() {
        assert_eq!(
            instructions("FROM base-py\nRUN true\n")[0],
            Instruction::From(Base::Template("base-py".into()))
        );
    }

    #[test]
    fn errors_name_the_line() {
        let err = |src: &str| parse(src).unwrap_err().to_string();
        assert_eq!(
            err("FROM debian:bookworm\n\nCMD [\"python3\"]\n"),
            "Line 3: CMD is not supported; the supported instructions are FROM, RUN, ENV, WORKDIR, COPY, USER, LABEL."
        );
        assert_eq!(
            err("# hi\nRUN true\n"),
            "Line 2: the first instruction must be FROM (e.g. FROM debian:bookworm)."
        );
        assert_eq!(
            err("FROM debian:bookworm\nRUN echo \\\n"),
            "Line 2: the instruction ends with a line continuation (\\) but the file ends there."
        );
        assert!(err("FROM debian:bookworm\nRUN [\"echo\", 1]\n")
            .starts_with("Line 2: RUN in JSON form"));
        assert!(
            err("FROM debian:bookworm\nCOPY --chown=1 a /b\n").starts_with("Line 2: COPY options")
        );
        assert!(err("FROM debian:bookworm\nCOPY a\n").starts_with("Line 2: COPY needs"));
        assert!(err("FROM debian\n").starts_with("Line 1: FROM debian needs a suite"));
        assert!(err("FROM debian:bookworm AS build\n").starts_with("Line 1: FROM takes one image"));
        assert!(
            err("FROM debian:bookworm\nFROM debian:trixie\n").starts_with("Line 2: only one FROM")
        );
        assert!(
            err("FROM debian:bookworm\nENV 1A=x\n").contains("not a valid environment variable")
        );
        assert!(err("FROM debian:bookworm\nLABEL novalue\n").starts_with("Line 2: LABEL expects"));
        assert!(err("FROM debian:bookworm\nENV A=\"open\n").contains("unterminated"));
        assert_eq!(err("\n# only comments\n"), ParseError::Empty.to_string());
    }
}

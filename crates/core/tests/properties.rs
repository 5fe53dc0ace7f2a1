//! Property tests (proptest) for the Dockerfile parser, which takes outside
//! input: whatever it is given, it answers (a value or an error) and never
//! panics. Pure: no sandbox, no root. (The egress policy and address
//! parsers have theirs in `crates/egress/tests/properties.rs`.)

use proptest::prelude::*;
use runcell_core::build::dockerfile::{self, Instruction};

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 512,
        ..ProptestConfig::default()
    }
}

/// Text that looks like a recipe: instructions, arguments with quotes,
/// brackets, continuations and comments.
fn recipe_like() -> impl Strategy<Value = String> {
    let keyword = prop_oneof![
        Just("FROM"),
        Just("RUN"),
        Just("ENV"),
        Just("WORKDIR"),
        Just("COPY"),
        Just("USER"),
        Just("LABEL"),
        Just("ARG"),
        Just("from"),
        Just("#"),
        Just(""),
    ];
    let arg = "[ -~\\t\\\\\"\\[\\]=:é]{0,30}";
    let line = (
        keyword,
        arg,
        prop_oneof![Just("\n"), Just("\\\n"), Just("\r\n"), Just("")],
    )
        .prop_map(|(k, a, end)| format!("{k} {a}{end}"));
    prop::collection::vec(line, 0..12).prop_map(|v| v.concat())
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn dockerfile_parse_never_panics_on_any_text(src in any::<String>()) {
        let _ = dockerfile::parse(&src);
    }

    #[test]
    fn dockerfile_parse_never_panics_on_recipe_like_text(src in recipe_like()) {
        if let Ok(steps) = dockerfile::parse(&src) {
            // Steps are in order, start with FROM, and name real lines.
            let lines = src.lines().count().max(1);
            prop_assert!(matches!(steps.first().map(|s| &s.instruction), Some(Instruction::From(_))));
            let mut last = 0;
            for s in &steps {
                prop_assert!(s.line > last && s.line <= lines, "{s:?} in {src:?}");
                last = s.line;
                if let Instruction::Run(r) = &s.instruction {
                    let _ = r.argv();
                }
            }
        }
    }
}

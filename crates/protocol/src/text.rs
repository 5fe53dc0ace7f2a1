//! A caller's text as errors quote it: never whole when it is long (a
//! megabyte of name, rule or key must not come back in an answer or a log).

/// `s`, cut at `max` bytes (on a character boundary) and saying its size
/// when it is longer; as it is otherwise.
pub fn clip(s: &str, max: usize) -> std::borrow::Cow<'_, str> {
    if s.len() <= max {
        return s.into();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}... ({} bytes in all)", &s[..end], s.len()).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_text_is_cut_on_a_character_boundary_with_its_size() {
        assert_eq!(clip("short", 8), "short");
        assert_eq!(clip("exactly8", 8), "exactly8");
        assert_eq!(clip("abcdefghij", 4), "abcd... (10 bytes in all)");
        // "é" is two bytes: a cut inside one moves back before it.
        let e = "é".repeat(100_000);
        let c = clip(&e, 5);
        assert_eq!(c, "éé... (200000 bytes in all)");
        assert!(clip(&e, 256).len() < 300);
    }
}

//! Verifiers: the reward functions the hub computes for each accepted sample, by name.
//!
//! Rewards are computed here, on the hub, from the completion's tokens and the reference
//! answer the trainer gave with the group — an actor never sees the answer and never reports a
//! reward, so it cannot forge one. The completion is decoded with the model's byte tokenizer
//! and cut at the first stop token. Pure functions, no I/O.
//!
//! `math` reads the answer a completion gives the way graders of math benchmarks do: the
//! content of its last `\boxed{…}` if it has one, else its last number; numbers may carry a
//! sign, decimals, `1,234` thousands separators, a trailing `%`, a leading `$`, or be simple
//! fractions (`3/4`, `\frac{3}{4}`); the reference answer is read the same way, and the two
//! are compared numerically (within 1e-6, relative for large values).

use starling_engine::tokenizer::ByteTokenizer;

/// A built-in verifier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verifier {
    /// 1 if the trimmed completion equals the trimmed answer, else 0.
    ExactMatch,
    /// 1 if the first number in the completion equals the answer as a number (within 1e-6,
    /// relative for large values), else 0.
    Numeric,
    /// 1 if the completion's answer — its last `\boxed{…}`, else its last number — equals the
    /// reference numerically (fractions, decimals and thousands separators understood), else 0.
    Math,
    /// Partial credit: the share of the answer's characters that the trimmed completion has at
    /// the same positions, over the longer of the two lengths (so extra characters cost too);
    /// 1 exactly when the two are equal. For toy tasks whose exact-match reward is too sparse
    /// to learn from (the demo's digit reversal).
    CharMatch,
    /// Always 0: the trainer computes its own reward.
    None,
}

impl Verifier {
    /// Every verifier's name, for error messages.
    pub const NAMES: [&'static str; 5] = ["exact_match", "numeric", "math", "char_match", "none"];

    /// The verifier called `name`.
    pub fn parse(name: &str) -> Option<Verifier> {
        match name {
            "exact_match" => Some(Verifier::ExactMatch),
            "numeric" => Some(Verifier::Numeric),
            "math" => Some(Verifier::Math),
            "char_match" => Some(Verifier::CharMatch),
            "none" => Some(Verifier::None),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Verifier::ExactMatch => "exact_match",
            Verifier::Numeric => "numeric",
            Verifier::Math => "math",
            Verifier::CharMatch => "char_match",
            Verifier::None => "none",
        }
    }

    /// Whether `answer` is one this verifier can score against; `Err` says why not (a group
    /// asking for it is refused at submit). `exact_match`, `numeric`, `math` and `char_match`
    /// need an answer; `numeric` and `math` need one that reads as a number.
    pub fn check_answer(self, answer: Option<&str>) -> Result<(), String> {
        let name = self.name();
        match (self, answer) {
            (Verifier::None, _) => Ok(()),
            (_, None) => Err(format!(
                "verifier {name} needs an answer to compare with; give \"answer\" (or use verifier none)"
            )),
            (Verifier::Numeric, Some(a)) if a.trim().parse::<f64>().is_err() => Err(format!(
                "verifier numeric compares numbers, and the answer {a:?} is not one"
            )),
            (Verifier::Math, Some(a)) if number(a).is_none() => Err(format!(
                "verifier math compares numbers, and the answer {a:?} is not one (integers, decimals, 1,234 or a/b)"
            )),
            _ => Ok(()),
        }
    }

    /// The reward of a completion (token ids, as generated) against `answer`.
    pub fn reward(self, completion: &[u32], stop: &[u32], answer: &str) -> f32 {
        self.reward_text(&completion_text(completion, stop), answer)
    }

    /// The reward of decoded completion text against `answer`.
    pub fn reward_text(self, text: &str, answer: &str) -> f32 {
        if self == Verifier::CharMatch {
            return char_match(text.trim(), answer.trim());
        }
        let hit = match self {
            Verifier::ExactMatch => text.trim() == answer.trim(),
            Verifier::Numeric => match (first_number(text), answer.trim().parse::<f64>()) {
                (Some(got), Ok(want)) => close(got, want),
                _ => false,
            },
            Verifier::Math => match (math_answer(text), number(answer)) {
                (Some(got), Some(want)) => close(got, want),
                _ => false,
            },
            Verifier::CharMatch | Verifier::None => false,
        };
        if hit { 1.0 } else { 0.0 }
    }
}

/// A completion's text: its tokens up to the first stop token, decoded.
pub(crate) fn completion_text(completion: &[u32], stop: &[u32]) -> String {
    let end = completion
        .iter()
        .position(|t| stop.contains(t))
        .unwrap_or(completion.len());
    decode(&completion[..end])
}

/// Token ids decoded with the model's tokenizer (the byte tokenizer).
pub(crate) fn decode(ids: &[u32]) -> String {
    ByteTokenizer.decode(ids)
}

/// Equal within 1e-6, relative for large values.
fn close(got: f64, want: f64) -> bool {
    (got - want).abs() <= 1e-6 * want.abs().max(1.0)
}

/// The answer a completion gives: the number in its last `\boxed{…}`, else its last number.
fn math_answer(text: &str) -> Option<f64> {
    match last_boxed(text) {
        Some(inner) => number(inner).or_else(|| last_number(inner)),
        None => last_number(text),
    }
}

/// The content of the last `\boxed{…}` (braces balanced), if any.
fn last_boxed(text: &str) -> Option<&str> {
    let start = text.rfind("\\boxed{")? + "\\boxed{".len();
    let mut depth = 1usize;
    for (i, c) in text[start..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(&text[start..start + i]);
                }
            }
            _ => {}
        }
    }
    None
}

/// `text` read as one number: an integer or decimal (sign, `1,234` separators), a fraction
/// `a/b` or `\frac{a}{b}` (`\dfrac`, `\tfrac`), with `$`, `%`, spaces and TeX spacing
/// around it ignored, and `x = ` before it.
fn number(text: &str) -> Option<f64> {
    let mut t: String = text
        .replace("\\left", "")
        .replace("\\right", "")
        .replace("\\!", "")
        .replace("\\,", "")
        .replace("\\;", "")
        .replace("\\$", "")
        .replace("\\%", "")
        .replace(['$', '%'], "")
        .chars()
        .filter(|c| !c.is_whitespace())
        .collect();
    if let Some((_, rhs)) = t.rsplit_once('=') {
        t = rhs.to_owned();
    }
    let t = t.trim_end_matches('.');
    let (negative, unsigned) = match t.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, t),
    };
    for frac in ["\\frac{", "\\dfrac{", "\\tfrac{"] {
        if let Some(rest) = unsigned.strip_prefix(frac) {
            let (num, den) = rest.strip_suffix('}')?.split_once("}{")?;
            let v = ratio(decimal(num)?, decimal(den)?)?;
            return Some(if negative { -v } else { v });
        }
    }
    if let Some((num, den)) = t.split_once('/') {
        return ratio(decimal(num)?, decimal(den)?);
    }
    decimal(t)
}

fn ratio(num: f64, den: f64) -> Option<f64> {
    (den != 0.0).then(|| num / den)
}

/// A plain decimal number: optional sign, digits (optionally grouped by three with commas),
/// optional fraction.
fn decimal(t: &str) -> Option<f64> {
    let body = t.strip_prefix(['-', '+']).unwrap_or(t);
    let (int, frac) = match body.split_once('.') {
        Some((i, f)) => (i, Some(f)),
        None => (body, None),
    };
    let grouped = int.contains(',');
    let groups: Vec<&str> = int.split(',').collect();
    let int_ok = if grouped {
        (1..=3).contains(&groups[0].len())
            && groups[1..].iter().all(|g| g.len() == 3)
            && groups.iter().all(|g| g.bytes().all(|b| b.is_ascii_digit()))
    } else {
        int.bytes().all(|b| b.is_ascii_digit())
    };
    let frac_ok = frac.is_none_or(|f| !f.is_empty() && f.bytes().all(|b| b.is_ascii_digit()));
    if !int_ok || !frac_ok || (int.is_empty() && frac.is_none()) {
        return None;
    }
    t.replace(',', "").parse().ok()
}

/// The last number in `text`: digits with optional `1,234` grouping, decimals and a `/b`
/// fraction; a `-` directly before it counts when it does not follow a letter or digit.
fn last_number(text: &str) -> Option<f64> {
    let b = text.as_bytes();
    let mut found = None;
    let mut i = 0;
    while i < b.len() {
        if !b[i].is_ascii_digit() {
            i += 1;
            continue;
        }
        let mut start = i;
        if start > 0 && b[start - 1] == b'-' && (start < 2 || !b[start - 2].is_ascii_alphanumeric())
        {
            start -= 1;
        }
        let digits = |mut j: usize| {
            while j < b.len() && b[j].is_ascii_digit() {
                j += 1;
            }
            j
        };
        let mut end = digits(i);
        // Thousands groups: ",ddd" not followed by another digit.
        while end + 4 <= b.len()
            && b[end] == b','
            && b[end + 1..end + 4].iter().all(u8::is_ascii_digit)
            && b.get(end + 4).is_none_or(|c| !c.is_ascii_digit())
        {
            end += 4;
        }
        if end + 1 < b.len() && b[end] == b'.' && b[end + 1].is_ascii_digit() {
            end = digits(end + 1);
        }
        if end + 1 < b.len() && b[end] == b'/' && b[end + 1].is_ascii_digit() {
            end = digits(end + 1);
        }
        found = number(&text[start..end]).or(found);
        i = end;
    }
    found
}

/// Matching characters at equal positions over the longer length (1 for two empty strings).
fn char_match(text: &str, answer: &str) -> f32 {
    let (t, a): (Vec<char>, Vec<char>) = (text.chars().collect(), answer.chars().collect());
    let longer = t.len().max(a.len());
    if longer == 0 {
        return 1.0;
    }
    let same = t.iter().zip(&a).filter(|(x, y)| x == y).count();
    same as f32 / longer as f32
}

/// The first decimal number in `text` (optional sign, digits, optional fraction).
fn first_number(text: &str) -> Option<f64> {
    let b = text.as_bytes();
    let mut i = 0;
    while i < b.len() {
        let starts_digit = b[i].is_ascii_digit();
        let signed = (b[i] == b'-' || b[i] == b'+') && b.get(i + 1).is_some_and(u8::is_ascii_digit);
        if starts_digit || signed {
            let start = i;
            i += 1;
            while i < b.len() && b[i].is_ascii_digit() {
                i += 1;
            }
            if i + 1 < b.len() && b[i] == b'.' && b[i + 1].is_ascii_digit() {
                i += 1;
                while i < b.len() && b[i].is_ascii_digit() {
                    i += 1;
                }
            }
            return text[start..i].parse().ok();
        }
        i += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(s: &str) -> Vec<u32> {
        ByteTokenizer.encode(s)
    }

    #[test]
    fn exact_match_compares_trimmed_text_up_to_the_stop_token() {
        let v = Verifier::ExactMatch;
        let stop = [ByteTokenizer::EOS];
        let mut c = ids(" 321 ");
        c.push(ByteTokenizer::EOS);
        c.extend(ids("garbage after the stop"));
        assert_eq!(v.reward(&c, &stop, "321"), 1.0);
        assert_eq!(v.reward(&ids("3210"), &stop, "321"), 0.0);
        assert_eq!(v.reward(&ids(""), &stop, "321"), 0.0);
        assert_eq!(v.reward(&ids(""), &stop, ""), 1.0);
    }

    #[test]
    fn numeric_takes_the_first_number() {
        let v = Verifier::Numeric;
        assert_eq!(v.reward_text("the answer is 42.", "42"), 1.0);
        assert_eq!(v.reward_text("-7 apples", "-7"), 1.0);
        assert_eq!(v.reward_text("3.50", "3.5"), 1.0);
        assert_eq!(v.reward_text("41 then 42", "42"), 0.0);
        assert_eq!(v.reward_text("no number", "42"), 0.0);
        assert_eq!(v.reward_text("42", "not a number"), 0.0);
        assert_eq!(v.reward_text("a-b 5", "5"), 1.0);
    }

    #[test]
    fn math_reads_the_boxed_answer_else_the_last_number() {
        let v = Verifier::Math;
        let r = |text: &str, answer: &str| v.reward_text(text, answer);
        // The boxed answer wins over every other number.
        assert_eq!(r("12 + 30 = 42, so \\boxed{42}. Check: 7", "42"), 1.0);
        assert_eq!(r("first \\boxed{41} then \\boxed{42}", "42"), 1.0);
        assert_eq!(r("\\boxed{\\frac{3}{4}}", "0.75"), 1.0);
        assert_eq!(r("\\boxed{\\dfrac{-1}{2}}", "-1/2"), 1.0);
        assert_eq!(r("\\boxed{-\\frac{1}{2}}", "-0.5"), 1.0);
        assert_eq!(r("\\boxed{x = 5}", "5"), 1.0);
        assert_eq!(r("\\boxed{\\$1,234.50}", "1234.5"), 1.0);
        assert_eq!(r("\\boxed{{12}}", "12"), 1.0, "nested braces");
        assert_eq!(r("\\boxed{43} but really 42", "42"), 0.0);
        // Else the last number.
        assert_eq!(r("Tom has 12 and buys 30, so 42.", "42"), 1.0);
        assert_eq!(r("The answer is 1,234,567 apples", "1234567"), 1.0);
        assert_eq!(r("that is 3/4 of it", "0.75"), 1.0);
        assert_eq!(r("a drop of -7 degrees", "-7"), 1.0);
        assert_eq!(
            r("pages 3-5", "5"),
            1.0,
            "a dash between numbers is not a sign"
        );
        assert_eq!(r("42 then 41", "42"), 0.0);
        assert_eq!(r("about 50%", "50"), 1.0);
        assert_eq!(r("3.50", "3.5"), 1.0);
        assert_eq!(r("1,23 is not grouped", "23"), 1.0);
        assert_eq!(r("no number here", "42"), 0.0);
        assert_eq!(
            r("42, so \\boxed{}", "42"),
            0.0,
            "an empty box is an empty answer"
        );
        assert_eq!(
            r("unclosed \\boxed{42", "42"),
            1.0,
            "an unclosed box is not a box"
        );
        assert_eq!(r("5/0", "5"), 0.0);
    }

    #[test]
    fn verifiers_that_compare_need_an_answer_they_can_read() {
        for v in [
            Verifier::ExactMatch,
            Verifier::Numeric,
            Verifier::Math,
            Verifier::CharMatch,
        ] {
            let e = v.check_answer(None).expect_err("an answer is needed");
            assert!(e.contains(v.name()) && e.contains("answer"), "{e}");
        }
        assert_eq!(Verifier::None.check_answer(None), Ok(()));
        assert_eq!(Verifier::ExactMatch.check_answer(Some("")), Ok(()));
        assert!(Verifier::Numeric.check_answer(Some("forty-two")).is_err());
        assert!(Verifier::Math.check_answer(Some("forty-two")).is_err());
        assert_eq!(Verifier::Math.check_answer(Some("\\frac{1}{2}")), Ok(()));
        assert_eq!(Verifier::Math.check_answer(Some("1,234")), Ok(()));
        assert_eq!(Verifier::Numeric.check_answer(Some(" 42 ")), Ok(()));
    }

    #[test]
    fn char_match_gives_partial_credit_by_position() {
        let v = Verifier::CharMatch;
        assert_eq!(v.reward_text("4321", "4321"), 1.0);
        assert_eq!(v.reward_text(" 4321 ", "4321"), 1.0);
        assert_eq!(v.reward_text("4301", "4321"), 0.75);
        assert_eq!(v.reward_text("43", "4321"), 0.5);
        assert_eq!(v.reward_text("432100", "4321"), 4.0 / 6.0);
        assert_eq!(v.reward_text("1234", "4321"), 0.0);
        assert_eq!(v.reward_text("", "4321"), 0.0);
    }

    #[test]
    fn names_round_trip_and_none_rewards_nothing() {
        for n in Verifier::NAMES {
            assert_eq!(Verifier::parse(n).map(Verifier::name), Some(n));
        }
        assert_eq!(Verifier::parse("regex"), None);
        assert_eq!(Verifier::None.reward_text("x", "x"), 0.0);
    }
}

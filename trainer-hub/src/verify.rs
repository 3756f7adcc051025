//! Verifiers: the reward functions the hub computes for each accepted sample, by name.
//!
//! Rewards are computed here, on the hub, from the completion's tokens and the reference
//! answer the trainer gave with the group — an actor never sees the answer and never reports a
//! reward, so it cannot forge one. The completion is decoded with the model's byte tokenizer
//! and cut at the first stop token. Pure functions, no I/O.

use starling_engine::tokenizer::ByteTokenizer;

/// A built-in verifier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verifier {
    /// 1 if the trimmed completion equals the trimmed answer, else 0.
    ExactMatch,
    /// 1 if the first number in the completion equals the answer as a number (within 1e-6,
    /// relative for large values), else 0.
    Numeric,
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
    pub const NAMES: [&'static str; 4] = ["exact_match", "numeric", "char_match", "none"];

    /// The verifier called `name`.
    pub fn parse(name: &str) -> Option<Verifier> {
        match name {
            "exact_match" => Some(Verifier::ExactMatch),
            "numeric" => Some(Verifier::Numeric),
            "char_match" => Some(Verifier::CharMatch),
            "none" => Some(Verifier::None),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Verifier::ExactMatch => "exact_match",
            Verifier::Numeric => "numeric",
            Verifier::CharMatch => "char_match",
            Verifier::None => "none",
        }
    }

    /// The reward of a completion (token ids, as generated) against `answer`.
    pub fn reward(self, completion: &[u32], stop: &[u32], answer: &str) -> f32 {
        let end = completion
            .iter()
            .position(|t| stop.contains(t))
            .unwrap_or(completion.len());
        let text = ByteTokenizer.decode(&completion[..end]);
        self.reward_text(&text, answer)
    }

    /// The reward of decoded completion text against `answer`.
    pub fn reward_text(self, text: &str, answer: &str) -> f32 {
        if self == Verifier::CharMatch {
            return char_match(text.trim(), answer.trim());
        }
        let hit = match self {
            Verifier::ExactMatch => text.trim() == answer.trim(),
            Verifier::Numeric => match (first_number(text), answer.trim().parse::<f64>()) {
                (Some(got), Ok(want)) => (got - want).abs() <= 1e-6 * want.abs().max(1.0),
                _ => false,
            },
            Verifier::CharMatch | Verifier::None => false,
        };
        if hit { 1.0 } else { 0.0 }
    }
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

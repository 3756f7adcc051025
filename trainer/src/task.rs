//! The synthetic verifiable task the demo trains on: **digit reversal**. A prompt is a string
//! of decimal digits followed by `>` (e.g. `"4071>"`); the correct completion is the digits
//! reversed (`"1704"`), then end-of-sequence. The hub scores completions with its `char_match`
//! verifier (fraction of answer positions right, so partial progress earns partial reward) or
//! `exact_match`.
//!
//! Why this task: a two-layer model can represent it exactly (it is a fixed permutation of the
//! prompt that attention can learn), its reward is unforgeable and checkable by the hub, and a
//! model that has seen a little supervised data gets some of it right, so group-relative
//! advantages are non-zero from the first RL step and the reward curve is visible in minutes on
//! two cores. Everything is a pure function of a seed.

use starling_engine::ByteTokenizer;
use starling_rng::{GAMMA, SplitMix64};

/// One prompt with its reference answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub prompt: String,
    pub answer: String,
}

/// Digit reversal with digit strings of `min_digits..=max_digits` digits.
#[derive(Debug, Clone, Copy)]
pub struct ReverseDigits {
    pub min_digits: usize,
    pub max_digits: usize,
}

impl Default for ReverseDigits {
    fn default() -> Self {
        Self {
            min_digits: 3,
            max_digits: 5,
        }
    }
}

impl ReverseDigits {
    /// Problem number `index` of the stream keyed by `seed` (deterministic).
    pub fn problem(&self, seed: u64, index: u64) -> Problem {
        let mut rng = SplitMix64::new(seed ^ index.wrapping_mul(GAMMA));
        let span = (self.max_digits - self.min_digits + 1) as u64;
        let len = self.min_digits + (rng.next_u64() % span) as usize;
        let digits: String = (0..len)
            .map(|_| char::from(b'0' + (rng.next_u64() % 10) as u8))
            .collect();
        Problem {
            prompt: format!("{digits}>"),
            answer: digits.chars().rev().collect(),
        }
    }

    /// The longest completion a correct answer needs, with its end-of-sequence token.
    pub fn max_answer_tokens(&self) -> u32 {
        self.max_digits as u32 + 1
    }
}

impl Problem {
    /// The prompt's token ids, as the hub encodes a text prompt (bos, then bytes).
    pub fn prompt_ids(&self) -> Vec<u32> {
        ByteTokenizer.encode_with_bos(&self.prompt)
    }

    /// The reference completion's token ids, ending with end-of-sequence.
    pub fn answer_ids(&self) -> Vec<u32> {
        let mut ids = ByteTokenizer.encode(&self.answer);
        ids.push(ByteTokenizer::EOS);
        ids
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problems_are_reversals_and_deterministic() {
        let t = ReverseDigits::default();
        for i in 0..100 {
            let p = t.problem(7, i);
            assert_eq!(p, t.problem(7, i));
            let digits = p.prompt.strip_suffix('>').expect("ends with >");
            assert!((3..=5).contains(&digits.len()));
            assert!(digits.bytes().all(|b| b.is_ascii_digit()));
            assert_eq!(p.answer, digits.chars().rev().collect::<String>());
            assert_eq!(p.prompt_ids()[0], ByteTokenizer::BOS);
            assert_eq!(p.answer_ids().last(), Some(&ByteTokenizer::EOS));
        }
        assert_ne!(t.problem(7, 0), t.problem(8, 0));
    }

    #[test]
    fn the_problem_stream_is_pinned() {
        // Reference outputs: a change to the generator or its keying changes every seeded
        // run's problems (and the batch seeds drawn from the same generator).
        let t = ReverseDigits::default();
        let prompts: Vec<String> = (0..4).map(|i| t.problem(7, i).prompt).collect();
        assert_eq!(prompts, ["463>", "94961>", "765>", "3163>"]);
        assert_eq!(
            SplitMix64::new(7 ^ 4).next_u64() >> 11,
            1_021_869_836_427_313
        );
    }
}

//! Why a request's input cannot be run: an empty or too long prompt, a token outside the
//! vocabulary, a temperature or top-p out of range.
//!
//! One error for every check of a request, whichever module makes it: the model checks the
//! tokens against its config ([`crate::Model`]), sampling checks its own parameters
//! ([`crate::Sampling`]). It sits below both so that neither imports the other for it.

/// Why an input (prompt, completion) cannot be run.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InputError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("token {token} at position {position} is outside the vocabulary ({vocab})")]
    TokenOutOfRange {
        position: usize,
        token: u32,
        vocab: usize,
    },
    #[error("{tokens} tokens (prompt {prompt} + {new} new) exceed max_position_embeddings {max}")]
    TooLong {
        prompt: usize,
        new: usize,
        tokens: usize,
        max: usize,
    },
    #[error("temperature {0} must be finite and >= 0")]
    Temperature(f32),
    #[error("top_p {0} must be in (0, 1]")]
    TopP(f32),
}

//! One `/v1/completions` answer as vLLM streams it (`"stream": true`), gathered into samples.
//! Pure logic (lines in, samples out, the clock passed in), so every way a stream can be wrong
//! is tested without a server.
//!
//! **Why streamed.** An answer read whole counts its tokens only when the last sample ends. The
//! worker's `Progress` then said nothing about a generation in flight, and the hub, which
//! extends a lease only while its tokens move, let the lease of a long generation run out under
//! it: every attempt expired and the group failed. Streamed, each event's tokens count as they
//! arrive. The stream also gives each sample its own timings (time to its first token, then
//! decoding) where a whole answer had only the call's.
//!
//! **The format** (vLLM 0.32, `completion_stream_generator`): server-sent events, one
//! `data: {json}` line per event and a blank line after each, `data: [DONE]` last. An event's
//! `choices` hold one sample's new tokens: `index`, `logprobs.tokens` (`"token_id:N"` with
//! `return_tokens_as_token_ids`), `logprobs.token_logprobs`, and `finish_reason` on the
//! sample's last event. A generation that fails mid-way sends an event with an `error` object
//! instead (its `code` 400 where vLLM's own checks of the request, run once the stream has
//! begun, refuse it), then `[DONE]`. A usage event, if the server is configured to send one, has no
//! choices. Anything else is refused by name: a sample index out of range, tokens after a
//! sample finished, a token that is not `token_id:N`, an event after `[DONE]`, a stream that
//! ends before `[DONE]` or with a sample unfinished.

use std::time::{Duration, Instant};

use serde_json::Value;
use thiserror::Error;

/// Why a streamed completion cannot be used.
#[derive(Debug, Error, PartialEq, Eq)]
pub(crate) enum StreamError {
    #[error("vLLM reported an error mid-stream (code {code:?}): {message}")]
    Reported { message: String, code: Option<u64> },
    #[error("an event is not JSON: {0}")]
    NotJson(String),
    #[error("an event for sample {index}, of {n}")]
    NoSuchSample { index: u64, n: usize },
    #[error("sample {0} has a token that is not token_id:N, or no tokens list")]
    BadToken(u64),
    #[error("sample {index}: {tokens} tokens but {logprobs} log-probabilities in one event")]
    Mismatch {
        index: u64,
        tokens: usize,
        logprobs: usize,
    },
    #[error("sample {0} has tokens after its finish")]
    AfterFinish(u64),
    #[error("an event after [DONE]")]
    AfterDone,
    #[error("the stream ended before [DONE]")]
    NoDone,
    #[error("sample {0} never finished")]
    Unfinished(usize),
}

/// One sample as it was streamed.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct StreamedSample {
    pub(crate) tokens: Vec<u32>,
    pub(crate) logprobs: Vec<f32>,
    /// vLLM's `finish_reason` (`length`, `stop`, `abort`, …).
    pub(crate) finish_reason: String,
    /// From the request to the sample's first token.
    pub(crate) ttft: Duration,
    /// From its first token to its last.
    pub(crate) decode: Duration,
}

#[derive(Debug, Default)]
struct SoFar {
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    finish: Option<String>,
    first: Option<Instant>,
    last: Option<Instant>,
}

/// The samples of one streamed completion, as far as the stream has come.
#[derive(Debug)]
pub(crate) struct CompletionStream {
    samples: Vec<SoFar>,
    started: Instant,
    done: bool,
}

impl CompletionStream {
    /// A stream of `n` samples, requested at `started`.
    pub(crate) fn new(n: usize, started: Instant) -> Self {
        Self {
            samples: (0..n).map(|_| SoFar::default()).collect(),
            started,
            done: false,
        }
    }

    /// Takes one line of the answer, read at `at`: how many tokens it added.
    pub(crate) fn line(&mut self, line: &str, at: Instant) -> Result<u64, StreamError> {
        // Only `data:` fields carry anything; blank lines end events, `:` lines are comments,
        // and the other SSE fields (`event:`, `id:`, `retry:`) are not used by vLLM.
        let Some(data) = line.strip_prefix("data:") else {
            return Ok(0);
        };
        if self.done {
            return Err(StreamError::AfterDone);
        }
        let data = data.trim();
        if data == "[DONE]" {
            self.done = true;
            return Ok(0);
        }
        let event: Value =
            serde_json::from_str(data).map_err(|_| StreamError::NotJson(clip(data)))?;
        if let Some(error) = event.get("error") {
            let message = error
                .get("message")
                .and_then(Value::as_str)
                .map_or_else(|| clip(&error.to_string()), clip);
            let code = error.get("code").and_then(Value::as_u64);
            return Err(StreamError::Reported { message, code });
        }
        let mut added = 0;
        for choice in event["choices"].as_array().into_iter().flatten() {
            added += self.choice(choice, at)?;
        }
        Ok(added)
    }

    fn choice(&mut self, choice: &Value, at: Instant) -> Result<u64, StreamError> {
        let n = self.samples.len();
        let index = choice["index"].as_u64().unwrap_or(u64::MAX);
        let sample = usize::try_from(index)
            .ok()
            .and_then(|i| self.samples.get_mut(i))
            .ok_or(StreamError::NoSuchSample { index, n })?;
        let lp = &choice["logprobs"];
        let tokens = match lp["tokens"].as_array() {
            Some(tokens) => tokens
                .iter()
                .map(|t| {
                    t.as_str()
                        .and_then(|t| t.strip_prefix("token_id:"))
                        .and_then(|id| id.parse::<u32>().ok())
                        .ok_or(StreamError::BadToken(index))
                })
                .collect::<Result<Vec<u32>, _>>()?,
            // A finishing event may carry no log-probabilities at all.
            None if lp.is_null() => Vec::new(),
            None => return Err(StreamError::BadToken(index)),
        };
        let logprobs = lp["token_logprobs"]
            .as_array()
            .map(|l| {
                l.iter()
                    .map(|x| x.as_f64().map_or(f32::NAN, |x| x as f32))
                    .collect::<Vec<f32>>()
            })
            .unwrap_or_default();
        if logprobs.len() != tokens.len() {
            return Err(StreamError::Mismatch {
                index,
                tokens: tokens.len(),
                logprobs: logprobs.len(),
            });
        }
        if !tokens.is_empty() {
            if sample.finish.is_some() {
                return Err(StreamError::AfterFinish(index));
            }
            sample.first.get_or_insert(at);
            sample.last = Some(at);
        }
        let added = tokens.len() as u64;
        sample.tokens.extend(tokens);
        sample.logprobs.extend(logprobs);
        if let Some(reason) = choice["finish_reason"].as_str() {
            sample.finish = Some(reason.to_owned());
        }
        Ok(added)
    }

    /// Whether `[DONE]` was read: nothing more belongs to the answer.
    pub(crate) fn is_done(&self) -> bool {
        self.done
    }

    /// The samples, once the stream said `[DONE]` and every sample finished.
    pub(crate) fn samples(self) -> Result<Vec<StreamedSample>, StreamError> {
        if !self.done {
            return Err(StreamError::NoDone);
        }
        let started = self.started;
        self.samples
            .into_iter()
            .enumerate()
            .map(|(i, s)| {
                let finish_reason = s.finish.ok_or(StreamError::Unfinished(i))?;
                let first = s.first.unwrap_or(started);
                Ok(StreamedSample {
                    tokens: s.tokens,
                    logprobs: s.logprobs,
                    finish_reason,
                    ttft: first.saturating_duration_since(started),
                    decode: s.last.unwrap_or(first).saturating_duration_since(first),
                })
            })
            .collect()
    }
}

/// At most 200 characters of what a server sent, for an error message.
fn clip(s: &str) -> String {
    s.chars().take(200).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn event(index: u64, tokens: &[u32], logprobs: &[f64], finish: Option<&str>) -> String {
        let v = json!({
            "id": "cmpl-1",
            "object": "text_completion",
            "choices": [{
                "index": index,
                "text": "",
                "logprobs": {
                    "tokens": tokens.iter().map(|t| format!("token_id:{t}")).collect::<Vec<_>>(),
                    "token_logprobs": logprobs,
                    "text_offset": tokens.iter().map(|_| 0).collect::<Vec<_>>(),
                },
                "finish_reason": finish,
            }],
        });
        format!("data: {v}")
    }

    fn feed(s: &mut CompletionStream, lines: &[String], at: Instant) -> Result<u64, StreamError> {
        let mut added = 0;
        for l in lines {
            added += s.line(l, at)?;
        }
        Ok(added)
    }

    #[test]
    fn two_interleaved_samples_are_gathered_with_their_timings() {
        let t0 = Instant::now();
        let mut s = CompletionStream::new(2, t0);
        let ms = |m| t0 + Duration::from_millis(m);
        assert_eq!(s.line(": a comment", ms(1)), Ok(0));
        assert_eq!(s.line(&event(1, &[7], &[-0.5], None), ms(10)), Ok(1));
        assert_eq!(s.line("", ms(10)), Ok(0));
        assert_eq!(
            s.line(&event(0, &[3, 4], &[-1.0, -2.0], None), ms(20)),
            Ok(2)
        );
        assert_eq!(
            s.line(&event(1, &[8], &[-0.25], Some("length")), ms(30)),
            Ok(1)
        );
        assert_eq!(
            s.line(&event(0, &[5], &[-3.0], Some("stop")), ms(50)),
            Ok(1)
        );
        // A usage event has no choices.
        assert_eq!(s.line(r#"data: {"choices":[],"usage":{}}"#, ms(51)), Ok(0));
        assert!(!s.is_done());
        assert_eq!(s.line("data: [DONE]", ms(52)), Ok(0));
        assert!(s.is_done());
        let got = s.samples().expect("whole");
        assert_eq!(got[0].tokens, [3, 4, 5]);
        assert_eq!(got[0].logprobs, [-1.0, -2.0, -3.0]);
        assert_eq!(got[0].finish_reason, "stop");
        assert_eq!(
            (got[0].ttft, got[0].decode),
            (Duration::from_millis(20), Duration::from_millis(30))
        );
        assert_eq!(got[1].tokens, [7, 8]);
        assert_eq!(got[1].logprobs, [-0.5, -0.25]);
        assert_eq!(got[1].finish_reason, "length");
        assert_eq!(
            (got[1].ttft, got[1].decode),
            (Duration::from_millis(10), Duration::from_millis(20))
        );
    }

    #[test]
    fn a_finish_without_tokens_and_an_empty_sample_are_whole() {
        let t0 = Instant::now();
        let mut s = CompletionStream::new(1, t0);
        let lines = [
            event(0, &[1], &[-1.0], None),
            r#"data: {"choices":[{"index":0,"text":"","logprobs":null,"finish_reason":"stop"}]}"#
                .to_owned(),
            "data: [DONE]".to_owned(),
        ];
        assert_eq!(feed(&mut s, &lines, t0), Ok(1));
        assert_eq!(s.samples().expect("whole")[0].tokens, [1]);

        let mut s = CompletionStream::new(1, t0);
        let lines = [event(0, &[], &[], Some("length")), "data: [DONE]".into()];
        assert_eq!(feed(&mut s, &lines, t0), Ok(0));
        let got = s.samples().expect("whole");
        assert!(got[0].tokens.is_empty());
        assert_eq!(
            (got[0].ttft, got[0].decode),
            (Duration::ZERO, Duration::ZERO)
        );
    }

    #[test]
    fn every_malformed_stream_is_refused_by_name() {
        let t0 = Instant::now();
        let bad = |lines: &[String], n: usize| {
            let mut s = CompletionStream::new(n, t0);
            match feed(&mut s, lines, t0) {
                Err(e) => e,
                Ok(_) => s.samples().expect_err("refused"),
            }
        };
        let done = "data: [DONE]".to_owned();
        assert_eq!(
            bad(
                &[r#"data: {"error":{"message":"KV cache exhausted","code":500}}"#.into()],
                1
            ),
            StreamError::Reported {
                message: "KV cache exhausted".into(),
                code: Some(500)
            }
        );
        assert_eq!(
            bad(&[r#"data: {"error":{"object":"error"}}"#.into()], 1),
            StreamError::Reported {
                message: r#"{"object":"error"}"#.into(),
                code: None
            }
        );
        assert_eq!(
            bad(&["data: {not json".into()], 1),
            StreamError::NotJson("{not json".into())
        );
        assert_eq!(
            bad(&[event(2, &[1], &[-1.0], None)], 2),
            StreamError::NoSuchSample { index: 2, n: 2 }
        );
        assert_eq!(
            bad(&[r#"data: {"choices":[{"index":0,"logprobs":{"tokens":["hello"],"token_logprobs":[-1.0]}}]}"#.into()], 1),
            StreamError::BadToken(0)
        );
        assert_eq!(
            bad(&[event(0, &[1, 2], &[-1.0], None)], 1),
            StreamError::Mismatch {
                index: 0,
                tokens: 2,
                logprobs: 1
            }
        );
        assert_eq!(
            bad(
                &[
                    event(0, &[1], &[-1.0], Some("stop")),
                    event(0, &[2], &[-1.0], None)
                ],
                1
            ),
            StreamError::AfterFinish(0)
        );
        assert_eq!(
            bad(
                &[
                    event(0, &[1], &[-1.0], Some("stop")),
                    done.clone(),
                    event(0, &[2], &[-1.0], None)
                ],
                1
            ),
            StreamError::AfterDone
        );
        assert_eq!(
            bad(&[event(0, &[1], &[-1.0], Some("stop"))], 1),
            StreamError::NoDone
        );
        assert_eq!(
            bad(&[event(1, &[1], &[-1.0], Some("stop")), done], 2),
            StreamError::Unfinished(0)
        );
    }

    #[test]
    fn a_missing_log_probability_is_kept_as_nan_for_the_hub_to_refuse() {
        let t0 = Instant::now();
        let mut s = CompletionStream::new(1, t0);
        let lines = [
            r#"data: {"choices":[{"index":0,"logprobs":{"tokens":["token_id:4"],"token_logprobs":[null]},"finish_reason":"length"}]}"#.to_owned(),
            "data: [DONE]".to_owned(),
        ];
        assert_eq!(feed(&mut s, &lines, t0), Ok(1));
        assert!(s.samples().expect("whole")[0].logprobs[0].is_nan());
    }
}

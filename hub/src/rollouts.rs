//! Rollout work as the hub sees it: the trainer's batch request, its validation against the
//! model, the group spec stored in the ledger's job row, the conversion to the wire job an
//! actor gets (without the reference answer), and the judging of an actor's result before the
//! ledger's exactly-once acceptance (shape checks, rewards by the group's verifier).
//!
//! Formats (see `docs/api.md`): the ledger's job `prompt` column holds a [`GroupSpec`] as
//! JSON; the ledger's result `payload` holds a [`StoredResult`] as JSON — what the trainer's
//! result stream returns. Both are hub-private: actors speak `proto::rollout`.

use serde::{Deserialize, Serialize};
use starling_proto::protocol::rollout::{FinishReason, JobResult, JobSpec, SamplingParams};

use crate::reward_service::RewardServices;
use crate::verify::Verifier;

/// What the hub knows of the model, to validate, tokenize and decode.
#[derive(Debug, Clone)]
pub(crate) struct ModelLimits {
    pub(crate) vocab: u32,
    /// Prompt + new tokens must fit.
    pub(crate) context: u32,
    /// Its tokenizer, chat template and EOS ids (the byte tokenizer for generated models).
    pub(crate) text: std::sync::Arc<starling_text::ModelText>,
}

/// Sampling parameters (`docs/api.md`); every key optional in requests.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Sampling {
    pub(crate) temperature: f32,
    pub(crate) top_p: f32,
    pub(crate) top_k: u32,
    pub(crate) max_new_tokens: u32,
    pub(crate) stop_token_ids: Vec<u32>,
    pub(crate) seed: u64,
}

impl Sampling {
    /// The defaults of `docs/api.md`; `stop_token_ids` are the model's EOS ids.
    fn defaults(eos: &[u32]) -> Self {
        Sampling {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            max_new_tokens: 64,
            stop_token_ids: eos.to_vec(),
            seed: 0,
        }
    }
}

/// A partial [`Sampling`]: the keys a request sets.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SamplingPatch {
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<u32>,
    max_new_tokens: Option<u32>,
    stop_token_ids: Option<Vec<u32>>,
    seed: Option<u64>,
}

impl Sampling {
    fn patched(&self, p: &SamplingPatch) -> Sampling {
        Sampling {
            temperature: p.temperature.unwrap_or(self.temperature),
            top_p: p.top_p.unwrap_or(self.top_p),
            top_k: p.top_k.unwrap_or(self.top_k),
            max_new_tokens: p.max_new_tokens.unwrap_or(self.max_new_tokens),
            stop_token_ids: p
                .stop_token_ids
                .clone()
                .unwrap_or_else(|| self.stop_token_ids.clone()),
            seed: p.seed.unwrap_or(self.seed),
        }
    }

    fn check(&self) -> Result<(), String> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(format!("temperature {} must be ≥ 0", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p {} must be in (0, 1]", self.top_p));
        }
        if self.max_new_tokens == 0 {
            return Err("max_new_tokens must be at least 1".into());
        }
        if self.max_new_tokens as usize > starling_proto::protocol::rollout::MAX_NEW_TOKENS {
            return Err(format!(
                "max_new_tokens {} is above the limit of {}",
                self.max_new_tokens,
                starling_proto::protocol::rollout::MAX_NEW_TOKENS
            ));
        }
        if self.stop_token_ids.len() > starling_proto::protocol::rollout::MAX_STOP_TOKENS {
            return Err(format!(
                "{} stop tokens, at most {}",
                self.stop_token_ids.len(),
                starling_proto::protocol::rollout::MAX_STOP_TOKENS
            ));
        }
        Ok(())
    }

    fn wire(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            max_new_tokens: self.max_new_tokens,
            stop_token_ids: self.stop_token_ids.clone(),
            seed: self.seed,
        }
    }
}

/// `POST /v1/batches` body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct BatchRequest {
    pub(crate) version: Option<u64>,
    pub(crate) max_staleness: Option<u64>,
    #[serde(default)]
    pub(crate) sampling: SamplingPatch,
    pub(crate) groups: Vec<GroupRequest>,
}

/// One group of a batch request.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct GroupRequest {
    messages: Option<Vec<starling_text::Message>>,
    prompt: Option<String>,
    prompt_ids: Option<Vec<u32>>,
    n: u32,
    pub(crate) verifier: String,
    #[serde(default)]
    pub(crate) answer: Option<String>,
    sampling: Option<SamplingPatch>,
}

/// A group as stored in the ledger's job row.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct GroupSpec {
    pub(crate) group: u32,
    pub(crate) prompt_ids: Vec<u32>,
    /// The prompt as text: the rendered chat for `messages`, the text for `prompt` (none
    /// for `prompt_ids`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) prompt_text: Option<String>,
    /// The chat, when the group was given as messages.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) messages: Option<Vec<starling_text::Message>>,
    pub(crate) n: u32,
    pub(crate) sampling: Sampling,
    pub(crate) verifier: String,
    /// The reference answer, when the group has one (never sent to actors).
    #[serde(default)]
    pub(crate) answer: Option<String>,
}

/// Why a batch request is refused (the API's error code and sentence).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Invalid {
    pub(crate) code: &'static str,
    pub(crate) message: String,
}

fn invalid(code: &'static str, message: String) -> Invalid {
    Invalid { code, message }
}

/// Checks every group's verifier: a built-in one with the answer it needs, or a reward
/// service this hub was configured with (`unknown_verifier` otherwise).
pub(crate) fn check_rewards(req: &BatchRequest, services: &RewardServices) -> Result<(), Invalid> {
    for (i, g) in req.groups.iter().enumerate() {
        match Verifier::parse(&g.verifier) {
            Some(v) => v
                .check_answer(g.answer.as_deref())
                .map_err(|m| invalid("invalid_batch", format!("group {i}: {m}")))?,
            None if services.get(&g.verifier).is_some() => {}
            None => {
                let known: Vec<&str> = Verifier::NAMES
                    .iter()
                    .copied()
                    .chain(services.names())
                    .collect();
                return Err(invalid(
                    "unknown_verifier",
                    format!(
                        "group {i} names verifier {:?}; this hub knows {}",
                        g.verifier,
                        known.join(", ")
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Refuses groups whose result could never be delivered: `n` samples of `max_new_tokens`
/// tokens must fit one job-protocol message (`proto::rollout::max_result_len`).
pub(crate) fn check_deliverable(groups: &[GroupSpec]) -> Result<(), Invalid> {
    for g in groups {
        let need =
            starling_proto::protocol::rollout::max_result_len(g.n, g.sampling.max_new_tokens);
        // A `Submit` of this one result: its count, then the result.
        if need + 1 > starling_proto::protocol::msg::MAX_MESSAGE_BODY as u64 {
            return Err(invalid(
                "too_large",
                format!(
                    "group {}: {} samples of up to {} tokens may take {} MiB, more than the {} MiB \
                     one job-protocol message carries; lower n or max_new_tokens, or split the group",
                    g.group,
                    g.n,
                    g.sampling.max_new_tokens,
                    need.div_ceil(1 << 20),
                    starling_proto::protocol::msg::MAX_MESSAGE_BODY >> 20
                ),
            ));
        }
    }
    Ok(())
}

/// Checks a batch request against the model and expands it into group specs.
pub(crate) fn expand(req: &BatchRequest, model: &ModelLimits) -> Result<Vec<GroupSpec>, Invalid> {
    if req.groups.is_empty() {
        return Err(invalid("invalid_batch", "the batch has no groups".into()));
    }
    let base = Sampling::defaults(model.text.eos_ids()).patched(&req.sampling);
    let mut out = Vec::with_capacity(req.groups.len());
    for (i, g) in req.groups.iter().enumerate() {
        let bad = |m: String| invalid("invalid_batch", format!("group {i}: {m}"));
        if g.n == 0 {
            return Err(bad("n must be at least 1".into()));
        }
        if g.n as usize > starling_proto::protocol::rollout::MAX_SAMPLES {
            return Err(bad(format!(
                "n = {} is above the limit of {}",
                g.n,
                starling_proto::protocol::rollout::MAX_SAMPLES
            )));
        }
        // Rendered and tokenized once, here: actors get token ids.
        let text_err = |e: starling_text::TextError| bad(e.to_string());
        let (prompt_ids, prompt_text) = match (&g.messages, &g.prompt, &g.prompt_ids) {
            (Some(messages), None, None) => {
                let (text, ids) = model.text.encode_chat(messages).map_err(text_err)?;
                (ids, Some(text))
            }
            (None, Some(text), None) => (
                model.text.encode(text).map_err(text_err)?,
                Some(text.clone()),
            ),
            (None, None, Some(ids)) => (ids.clone(), None),
            _ => {
                return Err(bad(
                    "give exactly one of messages, prompt and prompt_ids".into()
                ));
            }
        };
        if prompt_ids.is_empty() {
            return Err(bad("the prompt is empty".into()));
        }
        if let Some(t) = prompt_ids.iter().find(|&&t| t >= model.vocab) {
            return Err(bad(format!(
                "token id {t} is outside the vocabulary of {}",
                model.vocab
            )));
        }
        let sampling = match &g.sampling {
            Some(p) => base.patched(p),
            None => base.clone(),
        };
        sampling.check().map_err(bad)?;
        let need = prompt_ids.len() as u64 + u64::from(sampling.max_new_tokens);
        if prompt_ids.len() > starling_proto::protocol::rollout::MAX_PROMPT_TOKENS
            || need > u64::from(model.context)
        {
            return Err(invalid(
                "prompt_too_long",
                format!(
                    "group {i}: {} prompt tokens + {} new tokens exceed the model's context of {}",
                    prompt_ids.len(),
                    sampling.max_new_tokens,
                    model.context
                ),
            ));
        }
        out.push(GroupSpec {
            group: u32::try_from(i).unwrap_or(u32::MAX),
            prompt_ids,
            prompt_text,
            messages: g.messages.clone(),
            n: g.n,
            sampling,
            verifier: g.verifier.clone(),
            answer: g.answer.clone(),
        });
    }
    Ok(out)
}

impl GroupSpec {
    pub(crate) fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    pub(crate) fn parse(bytes: &[u8]) -> Option<GroupSpec> {
        serde_json::from_slice(bytes).ok()
    }

    /// The job an actor gets: everything but the answer and the verifier.
    pub(crate) fn wire(&self, job: &starling_ledger::ClaimedJob) -> JobSpec {
        JobSpec {
            job: u64::try_from(job.id.raw()).unwrap_or(0),
            version: job.version.number(),
            attempt: job.attempt,
            lease_expires_ms: u64::try_from(job.lease_expires.millis()).unwrap_or(0),
            group: self.group,
            prompt: self.prompt_ids.clone(),
            n: self.n,
            sampling: self.sampling.wire(),
        }
    }
}

/// One version span of a stored sample.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Span {
    pub(crate) version: u64,
    pub(crate) start: u32,
    pub(crate) end: u32,
}

/// One sample as the trainer reads it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct StoredSample {
    pub(crate) tokens: Vec<u32>,
    pub(crate) logprobs: Vec<f32>,
    pub(crate) finish: String,
    /// The completion decoded with the model's tokenizer, up to (without) the first stop
    /// token, special tokens skipped: what the verifiers score.
    #[serde(default)]
    pub(crate) text: String,
    pub(crate) versions: Vec<Span>,
    pub(crate) reward: f32,
    pub(crate) ttft_ms: f64,
    pub(crate) tokens_per_s: f64,
}

/// An accepted group as stored in the ledger's result payload.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct StoredResult {
    pub(crate) group: u32,
    pub(crate) prompt_ids: Vec<u32>,
    pub(crate) samples: Vec<StoredSample>,
}

/// The refusal of a result with a NaN or ±Inf log-probability.
pub(crate) const NONFINITE_LOGPROB: &str = "nonfinite_logprob";
/// The refusal of a result that cannot be stored or delivered.
pub(crate) const RESULT_TOO_LARGE: &str = "result_too_large";

/// Checks an actor's result against its group and scores it with a built-in verifier (a
/// group scored by a reward service gets rewards 0 here, replaced once it is scored). `Err`
/// is a refusal code and sentence: `invalid_result` (the lease stays; the group is re-offered
/// if no valid result comes) or `nonfinite_logprob` (a trainer could not use the result; the
/// group is re-offered at once).
pub(crate) fn judge_result(
    spec: &GroupSpec,
    r: &JobResult,
    model_text: &starling_text::ModelText,
    newest: u64,
) -> Result<(StoredResult, u32), Invalid> {
    let bad = |m: String| invalid("invalid_result", format!("job {}: {m}", r.job));
    if r.samples.len() != spec.n as usize {
        return Err(bad(format!(
            "{} samples for a group of n = {}",
            r.samples.len(),
            spec.n
        )));
    }
    let verifier = Verifier::parse(&spec.verifier).unwrap_or(Verifier::None);
    let mut samples = Vec::with_capacity(r.samples.len());
    let mut tokens = 0u32;
    for (i, s) in r.samples.iter().enumerate() {
        if s.tokens.len() > spec.sampling.max_new_tokens as usize {
            return Err(bad(format!(
                "sample {i} has {} tokens, more than max_new_tokens {}",
                s.tokens.len(),
                spec.sampling.max_new_tokens
            )));
        }
        if s.spans.iter().any(|sp| sp.version < r.version) {
            return Err(bad(format!(
                "sample {i} has tokens from a version older than the {} it claims",
                r.version
            )));
        }
        // Tokens may come from versions after the job's (the weights moved on mid-sample),
        // never from one this hub has not published: a trainer would look for it. (A result
        // that claims an unpublished version itself is the ledger's to refuse, by name.)
        if let Some(sp) = s.spans.iter().find(|sp| sp.version > newest.max(r.version)) {
            return Err(bad(format!(
                "sample {i} has tokens from version {}, which this hub has not published \
                 (its newest is {newest})",
                sp.version
            )));
        }
        if s.finish == FinishReason::Aborted {
            return Err(bad(format!("sample {i} was aborted")));
        }
        if let Some((t, lp)) = s.logprobs.iter().enumerate().find(|(_, p)| !p.is_finite()) {
            return Err(invalid(
                NONFINITE_LOGPROB,
                format!(
                    "job {}: sample {i} has log-probability {lp} at token {t}: the engine's \
                     weights or sampling produced a non-finite value",
                    r.job
                ),
            ));
        }
        tokens = tokens.saturating_add(u32::try_from(s.tokens.len()).unwrap_or(u32::MAX));
        let decode_s = s.decode_us as f64 / 1e6;
        let text = model_text.decode(&s.tokens, &spec.sampling.stop_token_ids);
        samples.push(StoredSample {
            tokens: s.tokens.clone(),
            logprobs: s.logprobs.clone(),
            finish: s.finish.as_str().to_owned(),
            reward: verifier.reward_text(&text, spec.answer.as_deref().unwrap_or("")),
            text,
            versions: s
                .spans
                .iter()
                .map(|sp| Span {
                    version: sp.version,
                    start: sp.start,
                    end: sp.end,
                })
                .collect(),
            ttft_ms: s.ttft_us as f64 / 1e3,
            tokens_per_s: if decode_s > 0.0 {
                s.tokens.len() as f64 / decode_s
            } else {
                0.0
            },
        });
    }
    Ok((
        StoredResult {
            group: spec.group,
            prompt_ids: spec.prompt_ids.clone(),
            samples,
        },
        tokens,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `jobs::JOB_FIELDS_BYTES` rests on this: a job on the wire takes at most its stored
    /// spec's bytes plus that many, for every value its fields can hold (each token id's
    /// decimal and comma against its varint, every float, the largest ids and counts).
    #[test]
    fn a_jobs_wire_size_is_bounded_by_its_stored_spec() {
        use starling_ledger::{BatchId, ClaimedJob, JobId, Timestamp, Version};
        use starling_proto::protocol::msg::Message;
        let ids: Vec<u32> = [0, 9, 10, 99, 100, 127, 128, 999, 16_383, 16_384, 2_097_151]
            .into_iter()
            .chain([2_097_152, 99_999_999, 268_435_455, 268_435_456, u32::MAX])
            .collect();
        let jobs = [
            ClaimedJob {
                id: JobId::from_raw(1),
                batch: BatchId::from_raw(1),
                version: Version::new(0).expect("version"),
                prompt: Vec::new(),
                attempt: 1,
                lease_expires: Timestamp::from_millis(0),
            },
            ClaimedJob {
                id: JobId::from_raw(i64::MAX),
                batch: BatchId::from_raw(i64::MAX),
                version: Version::new(i64::MAX as u64).expect("version"),
                prompt: Vec::new(),
                attempt: u32::MAX,
                lease_expires: Timestamp::from_millis(i64::MAX),
            },
        ];
        let wire_len = |spec: &GroupSpec, job: &ClaimedJob| {
            let (mut one, mut none) = (Vec::new(), Vec::new());
            Message::Jobs {
                jobs: vec![spec.wire(job)],
            }
            .encode(&mut one);
            Message::Jobs { jobs: Vec::new() }.encode(&mut none);
            one.len() - none.len()
        };
        let mut checked = 0;
        for &id in &ids {
            for (temperature, top_p) in [(0.0, 1.0), (1e-30, 1e-30), (f32::MAX, 0.1)] {
                for (top_k, max_new_tokens, seed) in [(0, 1, 0), (u32::MAX, u32::MAX, u64::MAX)] {
                    for stops in [0, starling_proto::protocol::rollout::MAX_STOP_TOKENS] {
                        for (group, n) in [(0, 1), (u32::MAX, u32::MAX)] {
                            let spec = GroupSpec {
                                group,
                                prompt_ids: vec![id; 200],
                                prompt_text: None,
                                messages: None,
                                n,
                                sampling: Sampling {
                                    temperature,
                                    top_p,
                                    top_k,
                                    max_new_tokens,
                                    stop_token_ids: vec![id; stops],
                                    seed,
                                },
                                verifier: String::new(),
                                answer: None,
                            };
                            let stored = spec.to_bytes().len();
                            for job in &jobs {
                                let wire = wire_len(&spec, job);
                                assert!(
                                    wire as u64 <= stored as u64 + crate::jobs::JOB_FIELDS_BYTES,
                                    "id {id}: {wire} bytes on the wire from a {stored}-byte spec"
                                );
                                checked += 1;
                            }
                        }
                    }
                }
            }
        }
        assert_eq!(checked, ids.len() * 3 * 2 * 2 * 2 * 2);
    }

    fn model() -> ModelLimits {
        ModelLimits {
            vocab: 300,
            context: 64,
            text: std::sync::Arc::new(starling_text::ModelText::byte()),
        }
    }

    fn req(json: &str) -> BatchRequest {
        serde_json::from_str(json).expect("request JSON")
    }

    #[test]
    fn a_batch_expands_with_defaults_and_per_group_overrides() {
        let r = req(r#"{"sampling": {"temperature": 0.5, "max_new_tokens": 8},
            "groups": [{"prompt": "ab", "n": 2, "verifier": "exact_match", "answer": "ba"},
                       {"prompt_ids": [5, 6], "n": 1, "verifier": "none", "sampling": {"seed": 9}}]}"#);
        let g = expand(&r, &model()).expect("valid");
        assert_eq!(g[0].prompt_ids, starling_engine::ByteTokenizer.encode("ab"));
        assert_eq!(
            (g[0].sampling.temperature, g[0].sampling.max_new_tokens),
            (0.5, 8)
        );
        assert_eq!((g[1].sampling.seed, g[1].sampling.temperature), (9, 0.5));
        assert_eq!((g[1].group, g[1].n), (1, 1));
        let back = GroupSpec::parse(&g[0].to_bytes()).expect("round trip");
        assert_eq!(back.answer.as_deref(), Some("ba"));
    }

    #[test]
    fn bad_batches_are_refused_with_their_reason() {
        let code = |json: &str| expand(&req(json), &model()).err().map(|e| e.code);
        assert_eq!(code(r#"{"groups": []}"#), Some("invalid_batch"));
        let g = |body: &str| format!(r#"{{"groups": [{body}]}}"#);
        assert_eq!(
            code(&g(r#"{"prompt": "a", "n": 0, "verifier": "none"}"#)),
            Some("invalid_batch")
        );
        assert_eq!(
            code(&g(r#"{"prompt": "", "n": 1, "verifier": "none"}"#)),
            Some("invalid_batch")
        );
        assert_eq!(
            code(&g(
                r#"{"prompt": "a", "prompt_ids": [4], "n": 1, "verifier": "none"}"#
            )),
            Some("invalid_batch")
        );
        assert_eq!(
            code(&g(r#"{"prompt_ids": [300], "n": 1, "verifier": "none"}"#)),
            Some("invalid_batch")
        );
        assert_eq!(
            code(&g(
                r#"{"prompt": "a", "n": 1, "verifier": "none", "sampling": {"top_p": 0}}"#
            )),
            Some("invalid_batch")
        );
        assert_eq!(
            code(&g(
                r#"{"prompt": "a", "n": 1, "verifier": "none", "sampling": {"max_new_tokens": 64}}"#
            )),
            Some("prompt_too_long")
        );
        assert!(
            serde_json::from_str::<BatchRequest>(r#"{"groups": [], "typo": 1}"#).is_err(),
            "unknown keys are refused"
        );
    }

    #[test]
    fn verifiers_are_checked_against_the_built_ins_and_the_configured_services() {
        let services = RewardServices::new(
            vec![
                crate::reward_service::RewardService::parse("judge=http://127.0.0.1:9/")
                    .expect("service"),
            ],
            crate::reward_service::DEFAULT_TIMEOUT,
        )
        .expect("services");
        let check = |body: &str| {
            check_rewards(&req(&format!(r#"{{"groups": [{body}]}}"#)), &services)
                .err()
                .map(|e| (e.code, e.message))
        };
        assert_eq!(
            check(r#"{"prompt": "a", "n": 1, "verifier": "judge"}"#),
            None
        );
        assert_eq!(
            check(r#"{"prompt": "a", "n": 1, "verifier": "math", "answer": "3/4"}"#),
            None
        );
        assert_eq!(
            check(r#"{"prompt": "a", "n": 1, "verifier": "none"}"#),
            None
        );
        let (code, message) =
            check(r#"{"prompt": "a", "n": 1, "verifier": "regex"}"#).expect("refused");
        assert_eq!(code, "unknown_verifier");
        assert!(
            message.contains("math") && message.contains("judge"),
            "{message}"
        );
        // A verifier asked for without the answer it needs (before: accepted, scored 0).
        let (code, message) =
            check(r#"{"prompt": "a", "n": 1, "verifier": "numeric"}"#).expect("refused");
        assert_eq!(code, "invalid_batch");
        assert!(
            message.contains("group 0") && message.contains("answer"),
            "{message}"
        );
        let (code, _) = check(r#"{"prompt": "a", "n": 1, "verifier": "math", "answer": "x"}"#)
            .expect("refused");
        assert_eq!(code, "invalid_batch");
    }

    #[test]
    fn groups_that_cannot_fit_a_message_are_too_large() {
        let big = ModelLimits {
            context: 1 << 20,
            ..model()
        };
        let groups = |n: u32, t: u32| {
            expand(
                &req(&format!(
                    r#"{{"groups": [{{"prompt": "a", "n": {n}, "verifier": "none", "sampling": {{"max_new_tokens": {t}}}}}]}}"#
                )),
                &big,
            )
            .expect("valid")
        };
        assert!(check_deliverable(&groups(16, 65_536)).is_ok());
        assert!(check_deliverable(&groups(1_024, 1_024)).is_ok());
        let e = check_deliverable(&groups(32, 65_536)).expect_err("too large");
        assert_eq!(e.code, "too_large");
        assert!(e.message.contains("MiB"), "{}", e.message);
    }

    #[test]
    fn non_finite_log_probabilities_are_refused_by_name() {
        use starling_proto::protocol::rollout::{JobResult, Sample, VersionSpan};
        let spec = expand(
            &req(r#"{"groups": [{"prompt": "a", "n": 2, "verifier": "none", "sampling": {"max_new_tokens": 4}}]}"#),
            &model(),
        )
        .expect("valid")
        .remove(0);
        let result = |lp: f32| JobResult {
            job: 7,
            attempt: 1,
            version: 0,
            digest: [0; 16],
            elapsed_us: 1,
            samples: vec![
                Sample {
                    tokens: vec![5, 6],
                    logprobs: vec![-0.5, lp],
                    finish: FinishReason::Length,
                    spans: vec![VersionSpan {
                        version: 0,
                        start: 0,
                        end: 2,
                    }],
                    ttft_us: 1,
                    decode_us: 1,
                };
                2
            ],
        };
        let text = starling_text::ModelText::byte();
        assert!(judge_result(&spec, &result(-1.0), &text, 0).is_ok());
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let e = judge_result(&spec, &result(bad), &text, 0).expect_err("refused");
            assert_eq!(e.code, NONFINITE_LOGPROB);
            assert!(e.message.contains("token 1"), "{}", e.message);
        }
        // A span of a later version is fine once the hub has published it, refused before.
        let mut later = result(-1.0);
        later.samples[1].spans = vec![
            VersionSpan {
                version: 0,
                start: 0,
                end: 1,
            },
            VersionSpan {
                version: 2,
                start: 1,
                end: 2,
            },
        ];
        assert!(judge_result(&spec, &later, &text, 2).is_ok());
        let e = judge_result(&spec, &later, &text, 1).expect_err("refused");
        assert_eq!(e.code, "invalid_result");
        assert!(
            e.message
                .contains("version 2, which this hub has not published"),
            "{}",
            e.message
        );
    }
}

//! Generation: batch invariance, score == generate bit for bit, sampling semantics,
//! finishing, validation.

mod common;

use common::tiny_model;
use starling_engine::{
    ByteTokenizer, FinishReason, GenOutput, GenRequest, GenerateError, GenerateOptions, InputError,
    Model, Sampling,
};

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn prompts() -> Vec<Vec<u32>> {
    let t = ByteTokenizer::new(300).expect("vocab");
    vec![
        t.encode_with_bos("The quick brown fox"),
        vec![7],
        t.encode("2 + 2 ="),
        (0..40).map(|i| (i * 7 + 3) % 300).collect(),
        t.encode_with_bos("hello"),
        vec![299, 298, 297],
        t.encode("a"),
        t.encode("Lorem ipsum dolor sit amet"),
    ]
}

fn samplings() -> Vec<Sampling> {
    let s = |temperature, top_k, top_p, seed| Sampling {
        temperature,
        top_k,
        top_p,
        max_new_tokens: 12,
        stop_token_ids: vec![],
        seed,
    };
    vec![
        s(0.0, 0, 1.0, 0),
        s(0.7, 0, 1.0, 1),
        s(1.0, 0, 1.0, 2),
        s(0.7, 20, 1.0, 3),
        s(1.0, 0, 0.9, 4),
        s(1.0, 40, 0.8, 5),
    ]
}

fn requests() -> Vec<GenRequest> {
    let (ps, ss) = (prompts(), samplings());
    (0..8)
        .map(|i| GenRequest {
            prompt: ps[i].clone(),
            sampling: ss[i % ss.len()].clone(),
            sample_index: i as u32,
        })
        .collect()
}

fn gen_one(model: &Model, r: &GenRequest) -> GenOutput {
    model
        .generate(std::slice::from_ref(r), GenerateOptions::default())
        .expect("generate")
        .remove(0)
}

#[test]
fn outputs_do_not_depend_on_batch_or_threads() {
    let (model, _) = tiny_model(21);
    let reqs = requests();
    let alone: Vec<GenOutput> = reqs.iter().map(|r| gen_one(&model, r)).collect();
    for max_batch in [1, 3, 8] {
        for threads in [1, 2, 3] {
            let m = model.clone().with_threads(threads);
            let out = m
                .generate(&reqs, GenerateOptions { max_batch })
                .expect("generate");
            assert_eq!(out.len(), reqs.len());
            for (i, (a, b)) in alone.iter().zip(&out).enumerate() {
                assert_eq!(
                    a.tokens, b.tokens,
                    "request {i}, batch {max_batch}, threads {threads}"
                );
                assert_eq!(bits(&a.logprobs), bits(&b.logprobs), "request {i}");
                assert_eq!(a.finish, b.finish);
            }
        }
    }
    // Reordered and mixed with other requests.
    let mut shuffled: Vec<GenRequest> = reqs.iter().rev().cloned().collect();
    shuffled.push(GenRequest {
        prompt: vec![3; 60],
        sampling: Sampling {
            max_new_tokens: 30,
            ..Sampling::default()
        },
        sample_index: 99,
    });
    let out = model
        .generate(&shuffled, GenerateOptions { max_batch: 5 })
        .expect("generate");
    for (i, a) in alone.iter().enumerate() {
        let b = &out[reqs.len() - 1 - i];
        assert_eq!(
            (&a.tokens, bits(&a.logprobs)),
            (&b.tokens, bits(&b.logprobs))
        );
    }
}

#[test]
fn score_equals_generate_logprobs_bit_for_bit() {
    let (model, _) = tiny_model(22);
    let reqs = requests();
    for batch in [1usize, 3, 8] {
        let out = model
            .generate(&reqs[..batch], GenerateOptions { max_batch: batch })
            .expect("generate");
        for (r, o) in reqs.iter().zip(&out) {
            assert_eq!(o.tokens.len(), o.logprobs.len());
            assert!(!o.tokens.is_empty());
            let scored = model
                .score(&r.prompt, &o.tokens, r.sampling.temperature)
                .expect("score");
            assert_eq!(
                bits(&scored),
                bits(&o.logprobs),
                "batch {batch}, sampling {:?}",
                r.sampling
            );
        }
    }
    // All of them scored together: the same bits as one at a time.
    for temperature in [0.0, 0.7, 1.0] {
        let out = model
            .generate(&reqs, GenerateOptions { max_batch: 8 })
            .expect("generate");
        let mut seqs: Vec<(&[u32], &[u32])> = reqs
            .iter()
            .zip(&out)
            .map(|(r, o)| (r.prompt.as_slice(), o.tokens.as_slice()))
            .collect();
        // A prompt shared by several completions (a GRPO group), one of a single token.
        seqs.push((&reqs[0].prompt, &out[1].tokens));
        seqs.push((&reqs[0].prompt, &out[2].tokens[..1]));
        seqs.push((&reqs[0].prompt, &[])); // an empty completion scores as nothing
        let many = model.score_many(&seqs, temperature).expect("score_many");
        assert_eq!(many.len(), seqs.len());
        assert!(many[seqs.len() - 1].is_empty());
        for ((prompt, completion), got) in seqs.iter().zip(&many) {
            let one = model.score(prompt, completion, temperature).expect("score");
            assert_eq!(bits(got), bits(&one), "temperature {temperature}");
        }
    }
    // Every temperature against every top-k / top-p setting on one prompt.
    for temperature in [0.0, 0.7, 1.0] {
        for (top_k, top_p) in [(0, 1.0), (5, 1.0), (0, 0.5), (10, 0.9)] {
            let r = GenRequest {
                prompt: prompts()[0].clone(),
                sampling: Sampling {
                    temperature,
                    top_k,
                    top_p,
                    max_new_tokens: 9,
                    seed: 7,
                    ..Sampling::default()
                },
                sample_index: 0,
            };
            let o = gen_one(&model, &r);
            let scored = model
                .score(&r.prompt, &o.tokens, temperature)
                .expect("score");
            assert_eq!(
                bits(&scored),
                bits(&o.logprobs),
                "T {temperature} k {top_k} p {top_p}"
            );
            assert!(o.logprobs.iter().all(|l| l.is_finite() && *l <= 0.0));
        }
    }
}

#[test]
fn logits_agree_with_the_last_scored_position() {
    let (model, _) = tiny_model(23);
    let seq = [1u32, 50, 60, 70, 80];
    let logits = model.logits(&seq[..4]).expect("logits");
    let lp = model.score(&seq[..1], &seq[1..], 1.0).expect("score");
    let direct = starling_engine::sampling::token_logprob(&logits, 1.0, 80);
    assert_eq!(lp[3].to_bits(), direct.to_bits());
}

#[test]
fn greedy_equals_top_k_one_and_seeds_matter_only_when_sampling() {
    let (model, _) = tiny_model(24);
    let prompt = prompts()[0].clone();
    let req = |sampling: Sampling, sample_index| GenRequest {
        prompt: prompt.clone(),
        sampling,
        sample_index,
    };
    let greedy = gen_one(&model, &req(Sampling::greedy(16), 0));
    let top1 = gen_one(
        &model,
        &req(
            Sampling {
                top_k: 1,
                max_new_tokens: 16,
                seed: 123,
                ..Sampling::default()
            },
            5,
        ),
    );
    assert_eq!(greedy.tokens, top1.tokens);
    // Greedy ignores the seed.
    let greedy2 = gen_one(
        &model,
        &req(
            Sampling {
                seed: 9,
                ..Sampling::greedy(16)
            },
            3,
        ),
    );
    assert_eq!(greedy.tokens, greedy2.tokens);

    let t1 = |seed| Sampling {
        temperature: 1.0,
        max_new_tokens: 16,
        seed,
        ..Sampling::default()
    };
    let a = gen_one(&model, &req(t1(1), 0));
    let b = gen_one(&model, &req(t1(1), 0));
    assert_eq!(
        (&a.tokens, bits(&a.logprobs)),
        (&b.tokens, bits(&b.logprobs))
    );
    let c = gen_one(&model, &req(t1(2), 0));
    assert_ne!(a.tokens, c.tokens, "another seed, another sample");
    let d = gen_one(&model, &req(t1(1), 1));
    assert_ne!(a.tokens, d.tokens, "another sample index, another sample");
    assert_ne!(
        a.tokens, greedy.tokens,
        "T = 1 on a random model is not greedy"
    );
}

#[test]
fn stops_at_a_stop_token_or_the_length() {
    let (model, _) = tiny_model(25);
    let prompt = prompts()[3].clone();
    let free = gen_one(
        &model,
        &GenRequest {
            prompt: prompt.clone(),
            sampling: Sampling {
                max_new_tokens: 10,
                seed: 4,
                ..Sampling::default()
            },
            sample_index: 0,
        },
    );
    assert_eq!(free.finish, FinishReason::Length);
    assert_eq!(free.tokens.len(), 10);
    // Stop at the token the free run produced at step 4 (first occurrence).
    let stop = free.tokens[4];
    let first = free
        .tokens
        .iter()
        .position(|&t| t == stop)
        .expect("present");
    let stopped = gen_one(
        &model,
        &GenRequest {
            prompt,
            sampling: Sampling {
                max_new_tokens: 10,
                seed: 4,
                stop_token_ids: vec![stop],
                ..Sampling::default()
            },
            sample_index: 0,
        },
    );
    assert_eq!(stopped.finish, FinishReason::Stop);
    assert_eq!(stopped.tokens, free.tokens[..=first]);
    assert_eq!(bits(&stopped.logprobs), bits(&free.logprobs[..=first]));

    let none = gen_one(
        &model,
        &GenRequest {
            prompt: vec![5],
            sampling: Sampling::greedy(0),
            sample_index: 0,
        },
    );
    assert!(none.tokens.is_empty() && none.finish == FinishReason::Length);
}

#[test]
fn invalid_requests_are_refused_before_generating() {
    let (model, _) = tiny_model(26);
    let ok = GenRequest {
        prompt: vec![5, 6],
        sampling: Sampling::greedy(4),
        sample_index: 0,
    };
    let with = |f: &dyn Fn(&mut GenRequest)| {
        let mut bad = ok.clone();
        f(&mut bad);
        match model.generate(&[ok.clone(), ok.clone(), bad], GenerateOptions::default()) {
            Err(GenerateError::Request { index, problem }) => {
                assert_eq!(index, 2);
                problem
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
    };
    assert_eq!(with(&|r| r.prompt.clear()), InputError::EmptyPrompt);
    assert_eq!(
        with(&|r| r.prompt[1] = 300),
        InputError::TokenOutOfRange {
            position: 1,
            token: 300,
            vocab: 300
        }
    );
    assert!(matches!(
        with(&|r| r.sampling.max_new_tokens = 127),
        InputError::TooLong {
            tokens: 129,
            max: 128,
            ..
        }
    ));
    assert!(matches!(
        with(&|r| r.sampling.temperature = -0.5),
        InputError::Temperature(_)
    ));
    assert!(matches!(
        with(&|r| r.sampling.temperature = f32::NAN),
        InputError::Temperature(_)
    ));
    assert!(matches!(
        with(&|r| r.sampling.top_p = 0.0),
        InputError::TopP(_)
    ));
    assert!(matches!(
        with(&|r| r.sampling.top_p = 1.5),
        InputError::TopP(_)
    ));
    // Exactly at the limit is fine.
    let mut edge = ok.clone();
    edge.sampling.max_new_tokens = 126;
    let out = model
        .generate(&[edge], GenerateOptions::default())
        .expect("fits");
    assert_eq!(out[0].tokens.len(), 126);

    assert_eq!(model.score(&[], &[1], 1.0), Err(InputError::EmptyPrompt));
    assert!(matches!(
        model.score(&[1], &[400], 1.0),
        Err(InputError::TokenOutOfRange { position: 1, .. })
    ));
    assert!(matches!(
        model.score(&[1], &[2], -1.0),
        Err(InputError::Temperature(_))
    ));
    assert_eq!(model.score(&[1], &[], 1.0), Ok(vec![]));
}

"""The policy: transformers' causal LM from a Hugging Face directory, and log-probabilities of
completions under it in the hub's definition.

The hub's log-probability of a completion token is ``log_softmax(logits / T)[token]`` over the
full vocabulary at the group's temperature ``T`` (1 when ``T`` is 0), given the prompt and the
completion tokens before it (``docs/api.md``, "Log-probabilities"). :func:`completion_logprobs`
computes exactly that quantity with the model's own forward pass, each prompt once for the
completions that share it, and runs the vocabulary projection only on the completion positions
(the logits of a 49k vocabulary over every prompt position would be most of the memory and
time).
"""

from __future__ import annotations

import json
import os
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from ..safetensors import read_raw

Seq = Tuple[Sequence[int], Sequence[int]]  # (prompt ids, completion ids)


def checkpoint_names(model_dir: str) -> List[str]:
    """The tensor names of the directory's checkpoint (what a published version must hold:
    a tied ``lm_head.weight`` is not among them when the checkpoint leaves it out)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return sorted(json.load(f)["weight_map"])
    return sorted(read_raw(os.path.join(model_dir, "model.safetensors")))


def load_policy(model_dir: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """transformers' model for ``model_dir`` in ``dtype`` (float32: the trainer's master
    weights; the BF16 checkpoint converts to float32 exactly), with PyTorch's scaled-dot-product
    attention (padding is masked, so a right-padded sequence scores as it would alone)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    model.config.use_cache = False
    return model


def bf16_state(model: torch.nn.Module, names: Sequence[str]) -> Dict[str, torch.Tensor]:
    """The BF16 cast of the model's weights under the checkpoint's ``names`` (round to nearest
    even, as ``tensor.to(torch.bfloat16)``): the version the trainer publishes, and the copy it
    keeps to check the samples generated with it."""
    sd = model.state_dict()
    missing = [n for n in names if n not in sd]
    if missing:
        raise ValueError(f"the model has no tensor {missing[0]!r} of the checkpoint ({len(missing)} missing)")
    return {n: sd[n].detach().to(torch.bfloat16).clone() for n in names}


def load_bf16(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Loads BF16 weights into ``model`` (converted to its dtype; exact for float32). Tensors
    the state leaves out (a tied ``lm_head``) follow their tie."""
    params = model.state_dict()
    with torch.no_grad():
        for name, t in state.items():
            params[name].copy_(t.to(params[name].dtype))


def completion_logprobs(
    model: torch.nn.Module,
    seqs: Sequence[Seq],
    temperature: float,
    chunk: int = 8,
) -> List[torch.Tensor]:
    """For each ``(prompt, completion)``: the log-probability of every completion token (a 1-D
    float32 tensor), with gradients when the model has them enabled.

    Sequences that share a prompt (a GRPO group's samples, given one after another) share its
    computation: the prompt runs once, its key/value cache is repeated for up to ``chunk``
    completions, and the completions run together, right-padded, from it. With chat prompts
    about as long as the completions that halves the work of a group of four."""
    t = temperature if temperature > 0 else 1.0
    out: List[Optional[torch.Tensor]] = [None] * len(seqs)
    for prompt, idx in _runs_of_prompts(seqs, chunk):
        comps = [list(seqs[i][1]) for i in idx]
        for i, c in zip(idx, comps):
            if not c:
                out[i] = torch.zeros(0)
        live = [(i, c) for i, c in zip(idx, comps) if c]
        if not live:
            continue
        p = torch.tensor([list(prompt)], dtype=torch.long)
        first = model.model(input_ids=p, use_cache=True)
        h_first = first.last_hidden_state[0, -1]  # predicts every completion's first token
        cache = first.past_key_values
        k = len(live)
        width = max(len(c) for _, c in live) - 1
        rows: List[torch.Tensor] = []
        if width > 0:
            cache.batch_repeat_interleave(k)
            ids = torch.zeros(k, width, dtype=torch.long)
            mask = torch.zeros(k, len(prompt) + width, dtype=torch.long)
            mask[:, : len(prompt)] = 1
            for j, (_, c) in enumerate(live):
                ids[j, : len(c) - 1] = torch.tensor(c[:-1], dtype=torch.long)
                mask[j, len(prompt) : len(prompt) + len(c) - 1] = 1
            pos = (len(prompt) + torch.arange(width)).unsqueeze(0).expand(k, width)
            rest = model.model(
                input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True
            ).last_hidden_state
        for j, (_, c) in enumerate(live):
            rows.append(h_first.unsqueeze(0))
            if len(c) > 1:
                rows.append(rest[j, : len(c) - 1])
        logits = model.lm_head(torch.cat(rows)).float()
        logp = torch.log_softmax(logits / t, dim=-1)
        targets = torch.tensor([tok for _, c in live for tok in c], dtype=torch.long)
        picked = logp.gather(1, targets.unsqueeze(1)).squeeze(1)
        for (i, _), lp in zip(live, torch.split(picked, [len(c) for _, c in live])):
            out[i] = lp
    done: List[torch.Tensor] = []
    for x in out:
        assert x is not None  # every index belongs to one run of prompts
        done.append(x)
    return done


def _runs_of_prompts(seqs: Sequence[Seq], chunk: int) -> Iterator[Tuple[Sequence[int], List[int]]]:
    """Consecutive sequences with the same prompt, at most ``chunk`` at a time."""
    i = 0
    while i < len(seqs):
        prompt = seqs[i][0]
        j = i + 1
        while j < len(seqs) and j - i < chunk and list(seqs[j][0]) == list(prompt):
            j += 1
        yield prompt, list(range(i, j))
        i = j

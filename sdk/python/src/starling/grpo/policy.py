"""The policy: transformers' causal LM from a Hugging Face directory, and log-probabilities of
completions under it in the hub's definition.

The hub's log-probability of a completion token is ``log_softmax(logits / T)[token]`` over the
full vocabulary at the group's temperature ``T`` (1 when ``T`` is 0), given the prompt and the
completion tokens before it (``docs/api.md``, "Log-probabilities"). :func:`completion_logprobs`
computes exactly that quantity with the model's own forward pass, in right-padded chunks, and
runs the vocabulary projection only on the completion positions (the logits of a 49k
vocabulary over every prompt position would be most of the memory and time).
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Mapping, Sequence, Tuple

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
    float32 tensor), with gradients when the model has them enabled. ``chunk`` sequences go
    through the model at once (right-padded; positions start at 0 for each)."""
    t = temperature if temperature > 0 else 1.0
    out: List[torch.Tensor] = []
    for start in range(0, len(seqs), chunk):
        part = seqs[start : start + chunk]
        lens = [len(p) + len(c) for p, c in part]
        width = max(lens)
        ids = torch.zeros(len(part), width, dtype=torch.long)
        mask = torch.zeros(len(part), width, dtype=torch.long)
        for i, (p, c) in enumerate(part):
            ids[i, : lens[i]] = torch.tensor(list(p) + list(c), dtype=torch.long)
            mask[i, : lens[i]] = 1
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        rows, cols, targets, sizes = [], [], [], []
        for i, (p, c) in enumerate(part):
            n = len(c)
            rows.extend([i] * n)
            cols.extend(range(len(p) - 1, len(p) - 1 + n))  # the position that predicts token j
            targets.extend(c)
            sizes.append(n)
        h = hidden[torch.tensor(rows), torch.tensor(cols)]
        logits = model.lm_head(h).float()
        logp = torch.log_softmax(logits / t, dim=-1)
        picked = logp.gather(1, torch.tensor(targets, dtype=torch.long).unsqueeze(1)).squeeze(1)
        out.extend(torch.split(picked, sizes))
    return out

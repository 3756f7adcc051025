"""GRPO's objective: group-normalised advantages and the token-level clipped surrogate on the
behaviour log-probabilities the actors returned.

- Advantage of sample i of a group: ``(r_i - mean(r)) / (std(r) + eps)`` (population std).
  A group whose samples all scored the same has advantage 0 everywhere and no gradient: it is
  left out of the forward and backward passes (it still counts in the reports).
- Loss: ``-mean over every completion token of the batch of min(rho * A, clip(rho, 1 - e,
  1 + e) * A)`` with ``rho = exp(log pi_theta - log pi_behaviour)`` — the token-level mean
  (DAPO's), so long completions are not down-weighted per token.
"""

from __future__ import annotations

import math
from typing import List, Sequence

import torch


def group_advantages(rewards: Sequence[float], eps: float = 1e-4) -> List[float]:
    n = len(rewards)
    if n == 0:
        return []
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / n)
    return [(r - mean) / (std + eps) for r in rewards]


def clipped_surrogate(
    new: Sequence[torch.Tensor],
    behaviour: Sequence[torch.Tensor],
    advantages: Sequence[float],
    clip_eps: float,
    total_tokens: int,
) -> tuple:
    """The loss's share of ``new`` (log-probabilities under the current weights, with
    gradients) against ``behaviour`` for samples with ``advantages``, divided by
    ``total_tokens`` (the batch's completion tokens, so that chunks add up to the batch
    mean), and the number of clipped tokens."""
    new_all = torch.cat(list(new))
    old_all = torch.cat(list(behaviour))
    adv_all = torch.cat([torch.full((len(x),), a) for x, a in zip(new, advantages, strict=True)])
    ratio = torch.exp(new_all - old_all)
    surrogate = torch.minimum(ratio * adv_all, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv_all)
    loss = -surrogate.sum() / total_tokens
    with torch.no_grad():
        clipped = int(((ratio - 1).abs() > clip_eps).sum())
    return loss, clipped

"""A GRPO trainer for Hugging Face causal LMs, training through a Starling hub.

``python -m starling.grpo --hub URL --credentials T1 --model DIR --checkpoint-dir CKPT``:
transformers' model from ``DIR`` (the directory the hub and actors started from) with FP32
master weights, AdamW at RL learning rates, group-normalised advantages and the clipped
token-level loss on the actors' behaviour log-probabilities, rewards from the hub's ``math``
verifier on seeded arithmetic word problems sent as chat messages, every consumed sample's
log-probabilities recomputed on its tagged version, and each step's BF16 weights published
as the next version. Needs ``torch`` and ``transformers`` (the rest of the SDK needs neither).
See ``docs/real-run.md`` in the Starling repository.
"""

from .tasks import ArithmeticProblems, Problem

__all__ = ["ArithmeticProblems", "Problem", "GrpoTrainer", "Settings"]


def __getattr__(name: str):
    # torch and transformers load only when the trainer itself is used.
    if name in ("GrpoTrainer", "Settings"):
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(name)

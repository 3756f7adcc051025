"""Starling's trainer SDK: publish policy versions to a Starling hub, submit batches of prompt
groups, and stream back the accepted rollouts (``docs/api.md`` in the Starling repository).

    from starling import Client

    hub = Client("http://127.0.0.1:8080", credentials="t1", checkpoint_dir="/shared/ckpt")
    v = hub.publish(model.state_dict(), step=1)       # cast to BF16, written atomically, published
    batch = hub.submit([{"prompt": "12+30=", "n": 8, "verifier": "numeric", "answer": "42"}],
                       sampling={"temperature": 1.0, "max_new_tokens": 16, "stop_token_ids": [2]})
    for rollout in batch.results():                   # each accepted group once, until done
        print(rollout.group, [s.reward for s in rollout.samples])

Pure Python (standard library HTTP); PyTorch is imported only to publish a state dict.
"""

from .client import Batch, Client, ResultsPage
from .errors import StarlingError
from .safetensors import load_torch, read_raw, save_bf16
from .types import (
    BatchStatus,
    Group,
    GroupCounts,
    Rollout,
    Sample,
    Sampling,
    Span,
    Version,
)

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "BatchStatus",
    "Client",
    "Group",
    "GroupCounts",
    "ResultsPage",
    "Rollout",
    "Sample",
    "Sampling",
    "Span",
    "StarlingError",
    "Version",
    "load_torch",
    "read_raw",
    "save_bf16",
]

"""``python -m starling.grpo``: the GRPO trainer's command line (see the package doc)."""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Optional, Sequence

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")


def parse(argv: Optional[Sequence[str]] = None):
    p = argparse.ArgumentParser(prog="python -m starling.grpo", description=__doc__)
    p.add_argument("--hub", required=True, help="the hub's HTTP address, e.g. http://127.0.0.1:8080")
    auth = p.add_mutually_exclusive_group(required=True)
    auth.add_argument("--credentials", help="trainer credentials directory (starling-hub issue --role trainer)")
    auth.add_argument("--token", help="the trainer token itself")
    p.add_argument("--model", required=True, help="the model directory the hub started from (its version 0)")
    p.add_argument("--checkpoint-dir", required=True, help="where published checkpoints are written (readable by the hub)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--groups", type=int, default=8, help="prompts per batch")
    p.add_argument("-n", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=3e-6)
    p.add_argument("--clip-eps", type=float, default=0.2)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--problems",
        type=int,
        default=0,
        help="train on a fixed set of this many seeded problems, dealt in a new order each pass "
        "(0, the default: a new problem every time)",
    )
    p.add_argument("--chunk", type=int, default=8, help="sequences per forward/backward pass")
    p.add_argument("--threads", type=int, help="PyTorch threads (default: PyTorch's)")
    p.add_argument("--starling-bin", help="the `starling` binary: builtin-engine samples are then checked bit for bit")
    p.add_argument("--report", help="append one JSON line per step to this file")
    p.add_argument("--batch-timeout", type=float, default=3600.0)
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = parse(argv)
    from .trainer import GrpoTrainer, Settings

    settings = Settings(**{k: v for k, v in vars(a).items()})
    try:
        t = GrpoTrainer(settings)
    except ValueError as e:
        print(f"python -m starling.grpo: {e}", file=sys.stderr)
        return 2
    try:
        t.run()
    finally:
        t.close()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)

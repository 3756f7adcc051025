"""Arithmetic word problems as chat prompts, generated from a seed.

Each problem is one user message and its integer answer, which the hub's ``math`` verifier
checks against the last number (or ``\\boxed{}``) of a completion. The problems are small
enough that a 135 M-parameter instruct model solves some of them (so GRPO's group-normalised
advantages are not all zero) and misses many (so there is something to learn): sums,
differences and small products in a handful of everyday phrasings.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Dict, List

INSTRUCTION = "Answer with the final number only."

# (template, operation): {a} and {b} are the operands, {x} a noun, {name} a person.
_TEMPLATES = [
    ("{name} has {a} {x} and gets {b} more. How many {x} does {name} have now?", "+"),
    ("There are {a} {x} in a box. {name} puts in {b} more. How many {x} are in the box?", "+"),
    ("{name} had {a} {x} and gave away {b}. How many {x} are left?", "-"),
    ("A shop had {a} {x} and sold {b} of them. How many {x} does the shop have left?", "-"),
    ("{name} buys {a} bags with {b} {x} in each bag. How many {x} does {name} buy?", "*"),
    ("What is {a} plus {b}?", "+"),
    ("What is {a} minus {b}?", "-"),
    ("What is {a} times {b}?", "*"),
]
_NAMES = ["Tom", "Anna", "Ravi", "Mei", "Lucas", "Sara", "Omar", "Ines"]
_NOUNS = ["apples", "books", "marbles", "pencils", "stickers", "coins", "cards", "eggs"]


@dataclass(frozen=True)
class Problem:
    """One problem: the chat messages to send and the answer the verifier compares with."""

    messages: List[Dict[str, str]]
    answer: str

    def group(self, n: int) -> Dict[str, object]:
        """The batch API's group for ``n`` samples of this problem, scored by ``math``."""
        return {"messages": self.messages, "n": n, "verifier": "math", "answer": self.answer}


class ArithmeticProblems:
    """Seeded problems: the same seed gives the same problems in the same order.

    With ``pool`` 0 every problem is new (a stream). With ``pool`` N the trainer's dataset is
    the stream's first N problems, dealt in a new seeded order on every pass over them, as a
    run trains for several epochs over a fixed training set. A short run's reward is then a
    measure of learning: the same problems come back, so the first and the last pass differ
    by what the policy learned, not by which problems the seed dealt (with 32 samples a step,
    the mix of sums and products moves the mean reward by more than a dozen steps at an RL
    learning rate do).
    """

    def __init__(self, seed: int, pool: int = 0):
        if pool < 0:
            raise ValueError(f"pool must be at least 0, not {pool}")
        self._rng = random.Random(seed)
        self._pool = [self._draw() for _ in range(pool)]
        self._deal = random.Random(seed * 7919 + 1)
        self._pass: List[Problem] = []

    @property
    def pool(self) -> List[Problem]:
        """The fixed training set (empty for a stream)."""
        return list(self._pool)

    def next(self) -> Problem:
        if not self._pool:
            return self._draw()
        if not self._pass:
            self._pass = list(self._pool)
            self._deal.shuffle(self._pass)
        return self._pass.pop()

    def _draw(self) -> Problem:
        rng = self._rng
        template, op = rng.choice(_TEMPLATES)
        if op == "*":
            a, b = rng.randint(2, 9), rng.randint(2, 9)
            answer = a * b
        elif op == "-":
            a = rng.randint(5, 20)
            b = rng.randint(1, a - 1)
            answer = a - b
        else:
            a, b = rng.randint(1, 20), rng.randint(1, 20)
            answer = a + b
        text = template.format(a=a, b=b, x=rng.choice(_NOUNS), name=rng.choice(_NAMES))
        return Problem([{"role": "user", "content": f"{text} {INSTRUCTION}"}], str(answer))

    def batch(self, k: int) -> List[Problem]:
        return [self.next() for _ in range(k)]

"""Seeded phase mixtures: an endless, resumable stream of examples drawn from stage sources.

The staged-GRPO paper trains in three phases, each a probability mix of curriculum stages
(docs/design.md, section 3):

    A = stage 1 only      B = stage 1 .7 + stage 2 .3      C = stage 2 .6 + stage 3 .4

``MixtureStream`` turns per-stage example lists into one deterministic stream:

    position p  --u_p = uniform(seed, p)-->  stage s (by the cumulative weights)
                --c_s = how many times s was picked before p-->  epoch c_s // len(source_s),
                    slot c_s % len(source_s) of a seeded permutation of source_s for that epoch

so every stage cycles through its examples in a fresh shuffled order each epoch, and the
example at any position is a pure function of (sources, weights, seed, position). A trainer
that resumes at position k sees exactly what an uninterrupted run saw from k on.

Cost of resuming: the stage choices come from numpy in blocks of BLOCK positions seeded by
(seed, block), so ``load_state_dict({"position": k})`` recounts c_s with one vectorised
bincount per block (~0.2 s per million positions on a busy 2-core CPU) instead of
replaying k Python steps;
a state saved by ``state_dict()`` also carries the counts and restores in O(1).
Choosing by probability (not a fixed 7:3 pattern) is what the paper did; the realised
share of each stage over n draws is within a few sqrt(w(1-w)/n) of its weight.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from data.schema import Example

PHASES: dict[str, dict[int, float]] = {
    "A": {1: 1.0},
    "B": {1: 0.7, 2: 0.3},
    "C": {2: 0.6, 3: 0.4},
}
BLOCK = 4096  # positions per block of stage choices


class MixtureStream:
    """Deterministic endless stream over ``sources`` mixed by ``weights`` (see module doc)."""

    def __init__(self, sources: Mapping[Any, Sequence[Example]], weights: Mapping[Any, float],
                 seed: int = 0):
        self.keys, probs = _check(sources, weights)
        self.sources = {k: sources[k] for k in self.keys}
        self.weights = dict(zip(self.keys, probs))
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int (numpy seeds the blocks), got {seed!r}")
        self.seed = seed
        self._cum = np.cumsum(probs)
        self._cum[-1] = 1.0  # guard against 0.9999999 leaving u in (cum[-1], 1) unmatched
        self._block: tuple[int, np.ndarray] | None = None  # (block index, choices)
        self._perm: dict[int, tuple[int, list[int]]] = {}  # key -> (epoch, permutation)
        self.position = 0
        self.counts = {k: 0 for k in self.keys}

    # ------------------------------------------------------------------ the stream

    def __iter__(self) -> MixtureStream:
        return self

    def __next__(self) -> Example:
        key = self.keys[self._choice(self.position)]
        c = self.counts[key]
        src = self.sources[key]
        ex = src[self._permutation(key, c // len(src))[c % len(src)]]
        self.counts[key] = c + 1
        self.position += 1
        return ex

    def next_batch(self, n: int) -> list[Example]:
        return [next(self) for _ in range(n)]

    def take(self, position: int, n: int) -> list[Example]:
        """The ``n`` examples at positions position..position+n-1, leaving this stream as it is."""
        other = MixtureStream(self.sources, self.weights, self.seed)
        other.load_state_dict({"position": position})
        return other.next_batch(n)

    # ------------------------------------------------------------------ resuming

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "seed": self.seed,
                "counts": {str(k): v for k, v in self.counts.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Jump to ``state["position"]``; uses saved counts if present, else recounts them."""
        position = state.get("position")
        if not isinstance(position, int) or position < 0:
            raise ValueError(f"state['position'] must be a non-negative int, got {position!r}")
        if "seed" in state and int(state["seed"]) != self.seed:
            raise ValueError(f"state was saved with seed {state['seed']}, this stream has seed "
                             f"{self.seed}; build the stream with the saved seed")
        if "counts" in state:
            # JSON made the keys strings: match them to the stages (1, 2, 3, "all") by their text
            saved = {str(k): int(v) for k, v in state["counts"].items()}
            if set(saved) != {str(k) for k in self.keys} or sum(saved.values()) != position:
                raise ValueError(f"state counts {saved} do not match stages {self.keys} "
                                 f"at position {position}; was it saved from another mixture?")
            counts = {k: saved[str(k)] for k in self.keys}
        else:
            counts = self._recount(position)
        self.position, self.counts = position, counts

    def _recount(self, position: int) -> dict[int, int]:
        totals = np.zeros(len(self.keys), dtype=np.int64)
        for b in range(position // BLOCK + 1):
            n = min(BLOCK, position - b * BLOCK)
            if n <= 0:
                break
            totals += np.bincount(self._block_choices(b)[:n], minlength=len(self.keys))
        return {k: int(t) for k, t in zip(self.keys, totals)}

    # ------------------------------------------------------------------ randomness

    def _block_choices(self, b: int) -> np.ndarray:
        """Stage index (into self.keys) for each position of block b."""
        if self._block is None or self._block[0] != b:
            u = np.random.default_rng([self.seed, b]).random(BLOCK)
            self._block = (b, np.searchsorted(self._cum, u, side="right"))
        return self._block[1]

    def _choice(self, position: int) -> int:
        return int(self._block_choices(position // BLOCK)[position % BLOCK])

    def _permutation(self, key: int, epoch: int) -> list[int]:
        cached = self._perm.get(key)
        if cached is None or cached[0] != epoch:
            order = list(range(len(self.sources[key])))
            random.Random(f"{self.seed}/{key}/{epoch}").shuffle(order)
            cached = self._perm[key] = (epoch, order)
        return cached[1]


def phase_stream(phase: str, sources: Mapping[int, Sequence[Example]], seed: int = 0) -> MixtureStream:
    """The mixture of a training phase ("A", "B" or "C") over per-stage ``sources``."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {sorted(PHASES)}, got {phase!r}")
    return MixtureStream(sources, PHASES[phase], seed)


def _check(sources: Mapping[int, Sequence[Example]],
           weights: Mapping[int, float]) -> tuple[list[int], list[float]]:
    """Stages with positive weight (sorted) and their normalised probabilities."""
    if not weights:
        raise ValueError("weights is empty; give at least one stage a positive weight, e.g. {1: 1.0}")
    for k, w in weights.items():
        if not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise ValueError(f"weight of stage {k!r} must be a finite number >= 0, got {w!r}")
    keys = sorted((k for k, w in weights.items() if w > 0), key=str)  # stages 1, 2, 3 and "all" together
    if not keys:
        raise ValueError(f"all weights are zero: {dict(weights)}")
    for k in keys:
        if k not in sources or len(sources[k]) == 0:
            raise ValueError(f"stage {k!r} has weight {weights[k]} but no examples in sources "
                             f"(sources has {sorted(sources)}); generate or load that stage first")
    total = sum(weights[k] for k in keys)
    return keys, [weights[k] / total for k in keys]

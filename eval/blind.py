"""The visual-reliance control: exact match with each prompt's image swapped for another's.

A VLM can score well on visual questions without looking: small-integer answers, one
question template per family and a skewed answer distribution let a language prior
guess (MathVista's own paper needed hand-built text-only baselines to show this). The
honest control changes one thing, the picture: the same prompts, the same protocol, each
image replaced by the image of another example of the same kind (a derangement within
the family, or the context where there is no family), so the image is still a
plausible chart or table -- just the wrong one. Then

    blind gap = EM(true images) - EM(shuffled images)

is how much of the exact match comes from reading the figure. It is paired (each prompt
is scored both ways), so its interval is the normal interval of the per-prompt
differences d_i = exact_i(true) - exact_i(shuffled) in [-1, 1]: tighter than comparing two
independent rates, and honest about the sign. An interval that includes 0 means the
evaluation cannot tell this model from one that ignores its images.

Pure Python over examples and completion records (no model, no torch): the caller samples
the second pass (``evaluate_model`` with ``EvalProtocol.image_control``).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from data.schema import Example
from eval.metrics import mean_interval

CONTROL_SEED = 1234  # the derangement's own seed: fixed, so every model sees the same swap


class ControlUnavailable(ValueError):
    """The images of this evaluation set cannot be shuffled (fewer than two examples)."""


@dataclass(frozen=True)
class BlindGap:
    """EM with true and with shuffled images on one subset, and their paired difference."""

    n: int  # prompts scored both ways
    exact_match: float
    exact_match_shuffled: float
    gap: float
    lo: float  # 95% interval of the gap
    hi: float

    @property
    def includes_zero(self) -> bool:
        return self.lo <= 0.0 <= self.hi

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    def __str__(self) -> str:
        return (f"EM {self.exact_match:.3f}, shuffled images {self.exact_match_shuffled:.3f}, "
                f"blind gap {self.gap:+.3f} [{self.lo:+.2f}, {self.hi:+.2f}]")


def image_group(ex: Example) -> str:
    """What an image may be swapped with: the synthetic family, else the context family."""
    return str(ex.metadata.get("family") or ex.context_family or "")


def shuffle_images(examples: Sequence[Example], seed: int = CONTROL_SEED) -> list[Example]:
    """Shallow copies of ``examples`` in which no example keeps its own image.

    Within each image group (``image_group``) a seeded random cyclic order hands every
    example the next one's image. Examples alone in their group are pooled and deranged
    among themselves; a single leftover joins the largest group. Raises ControlUnavailable
    for fewer than two examples, where no derangement exists.
    """
    if len(examples) < 2:
        raise ControlUnavailable(f"{len(examples)} example(s): the shuffled-image control needs at least 2")
    rng = random.Random(seed)
    groups: dict[str, list[int]] = {}
    for i, ex in enumerate(examples):
        groups.setdefault(image_group(ex), []).append(i)
    cycles = [idx for idx in groups.values() if len(idx) > 1]
    alone = [idx[0] for idx in groups.values() if len(idx) == 1]
    if len(alone) > 1:
        cycles.append(alone)
    elif alone:
        max(cycles, key=len).append(alone[0])
    out = [copy.copy(ex) for ex in examples]
    for idx in cycles:
        order = idx[:]
        rng.shuffle(order)
        for a, b in zip(order, order[1:] + order[:1]):  # a cycle: nobody keeps their own image
            out[a].image, out[a].image_path = examples[b].image, examples[b].image_path
            out[a].images = examples[b].images  # a prompt of several images takes all of the other's
    return out


def blind_gap(true_records: Sequence[dict], shuffled_records: Sequence[dict],
              pids: Sequence[str] | None = None, per_prompt: str = "mean") -> BlindGap:
    """Paired gap from two evaluations' per-completion records (``EvalResult.records``).

    Each record has ``pid`` and ``exact``; a prompt's exact rate is the mean over its
    samples (``per_prompt="mean"``), or 1 if any of its samples is exact (``"any"``: then
    the two rates are pass@k with true and with shuffled images, and the gap is the pass@k
    a model loses without the right picture). Only prompts scored in both passes count;
    ``pids`` restricts to a subset (a curriculum stage).
    """
    if per_prompt not in ("mean", "any"):
        raise ValueError(f"per_prompt={per_prompt!r}: use 'mean' (exact rate) or 'any' (pass@k)")
    reduce = (lambda v: sum(v) / len(v)) if per_prompt == "mean" else max

    def by_prompt(records):
        sums: dict[str, list[float]] = {}
        for r in records:
            sums.setdefault(str(r["pid"]), []).append(float(r["exact"]))
        return {p: reduce(v) for p, v in sums.items()}

    t, s = by_prompt(true_records), by_prompt(shuffled_records)
    keep = [p for p in t if p in s and (pids is None or p in pids)]
    if not keep:
        nan = float("nan")
        return BlindGap(0, nan, nan, nan, nan, nan)
    d = [t[p] - s[p] for p in keep]
    lo, hi = mean_interval(d, lo=-1.0, hi=1.0)
    em, em_s = sum(t[p] for p in keep) / len(keep), sum(s[p] for p in keep) / len(keep)
    return BlindGap(len(keep), em, em_s, em - em_s, lo, hi)

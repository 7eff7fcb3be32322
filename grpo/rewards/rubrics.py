"""V-Rubrics: per-criterion rubric rewards, a judge interface, and prefix attribution inputs.

V-Rubrics (arXiv 2608.25580) splits a VQA response into independent checks: rubric items
with a dimension (VF visual fidelity, RC reasoning consistency, IF instruction following),
a label (ESSENTIAL / IMPORTANT / OPTIONAL / PITFALL) and a signed weight w_j. A judge
decides each item and returns the sentence of the response that supports it.

    rho_j = w_j / sum of positive w           (a PITFALL has w < 0, so rho_j < 0)
    s_j   = 1 if the judge says the item holds (for a PITFALL: the mistake was made), else 0
    veto  = some PITFALL holds -> the answer reward and every positive s_j become 0

Two ways to use the scores (the release's weights answer/format/rubric: sequence mode
.10/.10/.80, prefix mode .50/.05/.45, see RUBRIC_RELEASE_WEIGHTS in grpo.rewards.compose):

    sequence  R_rubric = clip(sum_j rho_j s_j, -1, 1)       one scalar per completion
    prefix    A_t = a z(R_ans) + (1-a) sum_j rho_j z(s_j) 1[t <= t_end_j]
              -> this module builds (R_ans, s, scored, rho, t_end); grpo_kernels/grpo_loss.py
                 does the group z-scores and the token sums.

The clip to [-1, 1] is ours: without it a response that commits several pitfalls could
lose more than the positive items are worth (V-Rubrics leaves the sum unbounded).

t_end_j is the index of the completion token where item j's supporting sentence ends.
The sentence is located exact -> case-insensitive -> fuzzy (partial ratio >= 60, the
release's threshold) -> character span -> token index. Anything unlocated (no sentence,
unsatisfied item, vetoed credit, fuzzy score < 60) gets the last token: its credit or
blame covers the whole response, as the paper does when alignment fails.

Character -> token: with the sampled ids, a token's character end is found by decoding
the id prefix (``decode(ids[:k])``) and measuring how much of the completion text it
reproduces; a binary search needs ~log2(T) decodes per item. A partial UTF-8 character
decodes to U+FFFD, which simply does not count as reproduced yet. Without ids, the text
is re-encoded with ``return_offsets_mapping`` (fast tokenizers) and the offsets are used.

partial_ratio is rapidfuzz's ``fuzz.partial_ratio`` semantics (best alignment of the
shorter string inside the longer, 0..100, similarity = 2 * matches / total length) with
the standard library only: candidate alignments come from difflib's matching blocks
(fuzzywuzzy's method) instead of rapidfuzz's exhaustive window scan, so it can score a
few points below rapidfuzz on rare inputs. Fuzzy search runs on texts up to
FUZZY_MAX_CHARS (a completion is at most L tokens; the cap only bounds garbage input).

The built-in RuleJudge reads the ``evidence`` of synthetic rubric items (data/schema.py)
in the reasoning (the single REASONING block's body, else the whole completion), soft
matched like R1-VL's key steps (grpo.rewards.steps). A model judge is any callable with
the same signature (see Judge); it ignores evidence and reads the item text.
"""

from __future__ import annotations

import bisect
import difflib
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from data.contract import SOLUTION_CLOSE, SOLUTION_OPEN, ParsedResponse, normalize_number, parse_response
from data.schema import RUBRIC_DIMENSIONS, RUBRIC_LABELS, Example, RubricItem
from grpo.rewards.steps import SoftText, canonical_tokens, has_content
from grpo_kernels.grpo_advantages import PrefixRubrics

FUZZY_THRESHOLD = 60.0  # V-Rubrics release: fuzzy match accepted at partial ratio >= 60
FUZZY_MAX_CHARS = 20_000
EVIDENCE_KINDS = ("mentions", "number", "ordered", "answer")


# ----------------------------------------------------------------------------- judge interface


@dataclass(frozen=True)
class Verdict:
    """A judge's answer for one rubric item of one completion."""

    satisfied: bool | None  # None: the judge could not decide (the item is then unscored)
    sentence: str | None = None  # the response's sentence that supports the decision


class Judge(Protocol):
    """Decides every rubric item of one completion: one Verdict per item, in order.

    One call per completion (not per item) so a model judge can put all items of a
    response in one prompt. A (bool, sentence) tuple or None is accepted in place of a
    Verdict.
    """

    def __call__(self, example: Example, completion: str, items: list[RubricItem]) -> Sequence[Any]: ...


def judge_from_item_fn(fn: Callable[[Example, str, RubricItem], Any]) -> Judge:
    """Adapt a per-item model judge ``fn(example, completion, item) -> (satisfied, sentence)``."""
    return lambda example, completion, items: [fn(example, completion, it) for it in items]


def coerce_verdicts(out: Any, n_items: int, pid: str) -> list[Verdict]:
    """A judge's output as Verdicts, or one clear error naming the example."""
    if not isinstance(out, Sequence) or isinstance(out, str) or len(out) != n_items:
        raise ValueError(f"judge returned {type(out).__name__} for example {pid!r}: "
                         f"expected a list of {n_items} verdicts, one per rubric item")
    verdicts = []
    for v in out:
        if v is None:
            v = Verdict(None)
        elif isinstance(v, tuple) and len(v) == 2:
            v = Verdict(None if v[0] is None else bool(v[0]), v[1])
        if not isinstance(v, Verdict) or not (v.sentence is None or isinstance(v.sentence, str)):
            raise ValueError(f"judge returned {v!r} for example {pid!r}: expected Verdict(satisfied, sentence), "
                             f"a (bool, str | None) tuple, or None")
        verdicts.append(v)
    return verdicts


# ----------------------------------------------------------------------------- rule judge


_SENTENCE_END = re.compile(r"[.!?]+(?=\s)|\n")


def _strip_span(text: str, s: int, e: int) -> tuple[int, int]:
    seg = text[s:e]
    return s + len(seg) - len(seg.lstrip()), e - (len(seg) - len(seg.rstrip()))


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """[start, end) of each sentence: split after . ! ? followed by space, and at newlines."""
    cuts = [0] + [m.end() for m in _SENTENCE_END.finditer(text)] + [len(text)]
    spans = [_strip_span(text, s, e) for s, e in zip(cuts, cuts[1:])]
    return [(s, e) for s, e in spans if e > s]


class Sentences:
    """Sentence lookup by character position; the boundaries are found once per text."""

    def __init__(self, text: str):
        self.text = text
        self.cuts = [m.end() for m in _SENTENCE_END.finditer(text)]

    def at(self, pos: int) -> str:
        """The sentence that contains character ``pos``."""
        k = bisect.bisect_right(self.cuts, pos)
        s = self.cuts[k - 1] if k > 0 else 0
        e = self.cuts[k] if k < len(self.cuts) else len(self.text)
        s, e = _strip_span(self.text, s, e)
        return self.text[s:e]


class RuleJudge:
    """Decides synthetic rubric items from their ``evidence`` (data/schema.py), no model."""

    def __call__(self, example: Example, completion: str, items: list[RubricItem]) -> list[Verdict]:
        parsed = parse_response(completion)
        region = (parsed.reasoning if parsed.has_reasoning_tag else completion) or ""
        soft, sentences = SoftText(region), Sentences(region)
        return [self.judge_one(item.evidence, parsed, soft, sentences) for item in items]

    @staticmethod
    def judge_one(evidence: dict[str, Any], parsed: ParsedResponse, soft: SoftText, sentences: Sentences) -> Verdict:
        kind = evidence.get("kind")
        if kind == "answer":
            ok = parsed.answer is not None and parsed.answer == normalize_number(str(evidence.get("value")))
            return Verdict(ok, SOLUTION_OPEN + (parsed.solution_raw or "") + SOLUTION_CLOSE if ok else None)
        at = -1  # token index of the evidence in the reasoning
        if kind == "mentions":
            hits = []
            for phrase in evidence.get("phrases", []):
                i = soft.find(phrase)
                if i >= 0:
                    hits.append(i + len(canonical_tokens(phrase)) - 1)
            at = min(hits) if hits else -1
        elif kind == "number":
            want = normalize_number(str(evidence.get("value")))
            at = next((i for v, i in soft.numbers() if v == want), -1)
        elif kind == "ordered":
            at = _ordered_end(soft, [normalize_number(str(v)) for v in evidence.get("values", [])])
        else:
            raise ValueError(f"rubric evidence kind {kind!r} is unknown to the rule judge: "
                             f"use one of {', '.join(EVIDENCE_KINDS)} or pass a model judge")
        if at < 0:
            return Verdict(False, None)
        return Verdict(True, sentences.at(soft.char_span(at)[0]))


def _ordered_end(soft: SoftText, values: list[str | None]) -> int:
    """Token index where ``values`` complete as a subsequence of the numbers, or -1."""
    nums = soft.numbers()
    k, at = 0, -1
    for want in values:
        while k < len(nums) and nums[k][0] != want:
            k += 1
        if k == len(nums):
            return -1
        at = nums[k][1]
        k += 1
    return at


def check_rubrics(example: Example, rule_judge: bool) -> str | None:
    """Why ``example``'s rubrics cannot be scored, or None when they can."""
    items = example.rubrics
    if not items:
        return "has no rubrics"
    for j, it in enumerate(items):
        where = f"rubric {j} ({it.text!r})"
        if it.dimension not in RUBRIC_DIMENSIONS or it.label not in RUBRIC_LABELS:
            return f"{where} has dimension {it.dimension!r} / label {it.label!r}: use {RUBRIC_DIMENSIONS} / {RUBRIC_LABELS}"
        if not isinstance(it.weight, (int, float)) or not math.isfinite(it.weight) or it.weight == 0:
            return f"{where} has weight {it.weight!r}: give a finite non-zero number"
        if (it.label == "PITFALL") != (it.weight < 0):
            return f"{where} is {it.label} with weight {it.weight}: PITFALL items, and only they, have negative weights"
        if rule_judge:
            bad = _check_evidence(it.evidence)
            if bad:
                return f"{where} {bad} (the rule judge needs it; or pass a model judge)"
    if not any(it.weight > 0 for it in items):
        return "has only PITFALL rubrics: rho_j = w_j / sum of positive weights needs a positive item"
    return None


def _check_evidence(ev: dict[str, Any]) -> str | None:
    kind = ev.get("kind") if isinstance(ev, dict) else None
    if kind not in EVIDENCE_KINDS:
        return f"has evidence {ev!r}: kind must be one of {', '.join(EVIDENCE_KINDS)}"
    if kind in ("number", "answer") and normalize_number(str(ev.get("value"))) is None:
        return f"has {kind} evidence with value {ev.get('value')!r}, which is not a number"
    if kind == "ordered":
        vals = ev.get("values")
        if not isinstance(vals, list) or not vals or any(normalize_number(str(v)) is None for v in vals):
            return f"has ordered evidence {vals!r}: give a non-empty list of numbers"
    if kind == "mentions":
        ph = ev.get("phrases")
        if not isinstance(ph, list) or not ph or not all(isinstance(p, str) and has_content(p) for p in ph):
            return f"has mentions evidence {ph!r}: give a non-empty list of non-empty phrases"
    return None


# ----------------------------------------------------------------------------- sentence location


def _lower(s: str) -> str:
    """Lower-case without changing the length (so indices still point into the original)."""
    return "".join(c if len(c.lower()) != 1 else c.lower() for c in s)


def partial_ratio_span(needle: str, hay: str) -> tuple[float, int, int]:
    """(score 0..100, start, end): best alignment of the shorter string inside the longer.

    start/end is the aligned window in ``hay``, or all of ``hay`` when ``needle`` is longer.
    """
    if not needle or not hay:
        return 0.0, 0, 0
    short, long_ = (needle, hay) if len(needle) <= len(hay) else (hay, needle)
    m = len(short)
    best, best_start = 0.0, 0
    blocks = difflib.SequenceMatcher(None, short, long_, autojunk=False).get_matching_blocks()
    for a, b, size in blocks:
        if size == 0:
            continue  # the terminal dummy block
        start = max(0, min(b - a, len(long_) - m))
        r = difflib.SequenceMatcher(None, short, long_[start:start + m], autojunk=False).ratio()
        if r > best:
            best, best_start = r, start
            if r >= 0.995:
                break
    if short is needle:
        return 100.0 * best, best_start, best_start + m
    return 100.0 * best, 0, len(hay)


def partial_ratio(a: str, b: str) -> float:
    """rapidfuzz-style partial ratio of two strings, 0..100 (see the module docstring)."""
    return partial_ratio_span(a, b)[0]


def locate(completion: str, sentence: str | None, threshold: float = FUZZY_THRESHOLD) -> tuple[int, int] | None:
    """Character span [start, end) of ``sentence`` in ``completion``, or None if not found.

    exact -> case-insensitive -> fuzzy partial ratio >= threshold (first match wins).
    """
    if not sentence or not sentence.strip():
        return None
    sentence = sentence.strip()
    i = completion.find(sentence)
    if i >= 0:
        return i, i + len(sentence)
    low_c, low_s = _lower(completion), _lower(sentence)
    i = low_c.find(low_s)
    if i >= 0:
        return i, i + len(sentence)
    if len(completion) <= FUZZY_MAX_CHARS and len(sentence) <= FUZZY_MAX_CHARS:
        score, s, e = partial_ratio_span(low_s, low_c)
        if score >= threshold:
            return s, e
    return None


class TokenLocator:
    """Maps a character position of a completion to the index of the token that reaches it."""

    def __init__(self, text: str, num_tokens: int, tokenizer: Any, ids: Sequence[int] | None = None):
        self.text, self.last = encodable(text), max(int(num_tokens) - 1, 0)
        self.tokenizer, self.ids = tokenizer, None if ids is None else [int(t) for t in ids]
        self.ends: list[int] | None = None  # per-token character ends, when offsets are known
        self._covered: dict[int, int] = {}
        if self.ids is None:
            try:
                enc = tokenizer(self.text, add_special_tokens=False, return_offsets_mapping=True)
                self.ends = _running_max([int(e) for _, e in enc["offset_mapping"]])
            except (NotImplementedError, TypeError, KeyError, ValueError):  # slow tokenizer: no offsets
                self.ids = list(tokenizer.encode(self.text, add_special_tokens=False))

    def _covered_by(self, k: int) -> int:
        """How many characters of the text decode(ids[:k]) reproduces (a common prefix)."""
        if k not in self._covered:
            dec = self.tokenizer.decode(self.ids[:k], skip_special_tokens=True)
            n = min(len(dec), len(self.text))
            lo = 0
            # common prefix in big strides first, then char by char
            while lo + 64 <= n and dec[lo:lo + 64] == self.text[lo:lo + 64]:
                lo += 64
            while lo < n and dec[lo] == self.text[lo]:
                lo += 1
            self._covered[k] = lo
        return self._covered[k]

    def token_at(self, char_end: int) -> int:
        """Index of the first token whose text reaches ``char_end`` (clamped to the last token)."""
        if self.ends is not None:
            t = bisect.bisect_left(self.ends, char_end)
            return min(t, self.last)
        lo, hi = 1, len(self.ids)
        if hi == 0 or self._covered_by(hi) < char_end:
            return self.last
        while lo < hi:  # smallest k with covered(k) >= char_end
            mid = (lo + hi) // 2
            if self._covered_by(mid) >= char_end:
                hi = mid
            else:
                lo = mid + 1
        return min(lo - 1, self.last)


def encodable(text: str) -> str:
    """``text`` with lone surrogates (never produced by decoding ids) replaced by '?'.

    Tokenizers refuse strings that are not valid UTF-8; the replacement keeps the length,
    so character positions still point into the original.
    """
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")


def _running_max(xs: list[int]) -> list[int]:
    out, m = [], 0
    for x in xs:
        m = max(m, x)
        out.append(m)
    return out


# ----------------------------------------------------------------------------- scores


def rubric_rho(items: list[RubricItem]) -> list[float]:
    """rho_j = w_j / sum of positive weights."""
    pos = sum(it.weight for it in items if it.weight > 0)
    return [it.weight / pos for it in items]


@dataclass
class RubricScore:
    """One completion's rubric outcome."""

    s: list[float]  # [J] 1 if the item holds (after the veto), else 0
    scored: list[bool]  # [J] the judge decided the item
    rho: list[float]  # [J]
    t_end: list[int]  # [J] last credited token (the supporting sentence's end, else the last token)
    veto: bool  # a PITFALL was committed
    reward: float  # sequence-mode rubric reward, clip(sum_j rho_j s_j, -1, 1)


def score_rubrics(items: list[RubricItem], verdicts: list[Verdict], completion: str,
                  locator: TokenLocator | None) -> RubricScore:
    """Apply the PITFALL veto, weigh the items, and locate each supporting sentence."""
    rho = rubric_rho(items)
    veto = any(it.label == "PITFALL" and v.satisfied for it, v in zip(items, verdicts))
    s, scored, t_end = [], [], []
    last = locator.last if locator is not None else 0
    for it, v in zip(items, verdicts):
        held = bool(v.satisfied) and not (veto and it.weight > 0)
        s.append(1.0 if held else 0.0)
        scored.append(v.satisfied is not None)
        span = locate(completion, v.sentence) if held and locator is not None else None
        t_end.append(locator.token_at(span[1]) if span is not None else last)
    total = sum(r * x for r, x, ok in zip(rho, s, scored) if ok)
    return RubricScore(s, scored, rho, t_end, veto, max(-1.0, min(1.0, total)))


# ----------------------------------------------------------------------------- prefix inputs


# The loss's V-Rubrics inputs have one definition, grpo_kernels.grpo_advantages.PrefixRubrics; the
# reward side builds them under the name it has always used. Rows with fewer items than the
# batch's max J are padded with scored=False, s=0, rho=0, t_end=0.
PrefixInputs = PrefixRubrics


def build_prefix_inputs(R_ans: list[float], scores: list[RubricScore | None], a: float) -> PrefixInputs:
    """Pad per-completion rubric scores to the batch's max J (None = example without rubrics)."""
    N = len(R_ans)
    J = max((len(sc.s) for sc in scores if sc is not None), default=0)
    s = torch.zeros(N, J)
    scored = torch.zeros(N, J, dtype=torch.bool)
    rho = torch.zeros(N, J)
    t_end = torch.zeros(N, J, dtype=torch.int64)
    for i, sc in enumerate(scores):
        if sc is None:
            continue
        n = len(sc.s)
        s[i, :n] = torch.tensor(sc.s)
        scored[i, :n] = torch.tensor(sc.scored, dtype=torch.bool)
        rho[i, :n] = torch.tensor(sc.rho)
        t_end[i, :n] = torch.tensor(sc.t_end, dtype=torch.int64)
    return PrefixInputs(torch.tensor(R_ans, dtype=torch.float32), s, scored, rho, t_end, a)

"""Soft key-step matching: is a phrase ("3 + 2", "three") in a text, up to spelling?

One implementation, below the layers that use it: R1-VL's StepRAR / StepRVR rewards
(grpo/rewards/steps.py), RewardMap's detail reward and the V-Rubrics rule judge score
training completions with it, and eval/reasoning.py's key-step accuracy measures
completions with it, so the metric counts exactly what the rewards credit.

Soft matching (R1-VL's "soft key-step matching"; our own rules, since the paper gives
none): both the key step and the response are turned into canonical tokens and the key
step must appear as a contiguous token run. Canonical tokens:

    case and unicode width folded (NFKC + casefold); whitespace ignored ("3+4" == "3 + 4");
    numbers through data.contract.normalize_number ("1,000", "1000.0" -> "1000");
    unicode minus / dashes -> "-"; x (between numbers), ×, ·, \\times, \\cdot -> "*";
    ÷, \\div -> "/"; \\frac{a}{b} and a/b are the same; LaTeX $ { } \\left \\right dropped;
    a fraction of two integers whose value is NOT an integer becomes its value
    ("3/4", "\\frac{3}{4}" -> "0.75"): it denotes a number. One with an integer value
    ("6/3", "14 / 2") stays "6 / 3": it is a division step, and folding it to "2" would
    let a key step like "14 / 2" match any "7" in the text.

Token boundaries make "7" not match inside "17" or "0.75". Number words ("three") are
matched as words: the data lists them as alternatives, as R1-VL's augmentation does.
Simplified: no equation algebra ("3 + 4" does not match "4 + 3" unless listed) and no
fuzzy string matching.
"""

from __future__ import annotations

import functools
import math
import re
import unicodedata
from typing import NamedTuple

from data.contract import normalize_number

_NUM = r"(?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])(?:\.[0-9]+)?|[0-9]+(?:\.[0-9]+)?|\.[0-9]+)"
_TOKEN_RE = re.compile(
    rf"(?P<frac>\\[dt]?frac\s*\{{\s*(?P<fa>{_NUM})\s*\}}\s*\{{\s*(?P<fb>{_NUM})\s*\}})"
    rf"|(?P<num>{_NUM})"
    r"|(?P<cmd>\\[A-Za-z]+)"
    r"|(?P<word>[^\W\d_]+)"
    r"|(?P<sym>[^\s\w])"
)
_SYMBOLS = {"−": "-", "‒": "-", "–": "-", "—": "-", "﹣": "-", "×": "*", "·": "*", "∙": "*",
            "⋅": "*", "÷": "/", "∕": "/"}
_DROP_SYMBOLS = {"$", "{", "}", "\\"}
_COMMANDS = {"times": "*", "cdot": "*", "ast": "*", "div": "/"}
_DROP_COMMANDS = {"left", "right", "displaystyle", "text", "mathrm", "quad", "qquad", "big", "bigg"}


class Tok(NamedTuple):
    """One canonical token and the character span [start, end) it came from."""

    text: str
    start: int
    end: int
    is_num: bool
    parts: tuple[str, ...] = ()  # a folded fraction's numerator and denominator


@functools.lru_cache(maxsize=4096)  # the same few numbers recur across a group's G completions
def _canon_number(s: str) -> str:
    # normalize_number gives None only for values that overflow float; keep the digits then.
    return normalize_number(s) or s.replace(",", "").lstrip("0") or "0"


def _fraction(a: str, b: str) -> str | None:
    """The value of a/b as a canonical number if it is a non-integer rational, else None."""
    if "." in a + b:  # 2.5/5 is a division step, not a fraction
        return None
    fa, fb = float(a), float(b)
    v = fa / fb if fb != 0 else math.nan
    if not math.isfinite(v) or v == int(v):
        return None
    return normalize_number(f"{v:.12g}")


def canonical_tokens(text: str) -> list[Tok]:
    """The soft-matching view of ``text`` (see the module docstring). Never raises."""
    toks: list[Tok] = []
    for m in _TOKEN_RE.finditer(text):
        s, e = m.span()
        kind = m.lastgroup
        if kind == "frac":
            a, b = _canon_number(m["fa"]), _canon_number(m["fb"])
            v = _fraction(a, b)
            if v is not None:
                toks.append(Tok(v, s, e, True, (a, b)))
            else:  # \frac{6}{3} reads as 6 / 3
                toks += [Tok(a, m.start("fa"), m.end("fa"), True), Tok("/", s, e, False),
                         Tok(b, m.start("fb"), m.end("fb"), True)]
        elif kind == "num":
            toks.append(Tok(_canon_number(m[0]), s, e, True))
        elif kind == "cmd":
            name = m[0][1:]
            if name not in _DROP_COMMANDS:
                toks.append(Tok(_COMMANDS.get(name, name.casefold()), s, e, False))
        elif kind == "word":
            toks.append(Tok(unicodedata.normalize("NFKC", m[0]).casefold(), s, e, False))
        else:
            ch = unicodedata.normalize("NFKC", m[0])
            if ch not in _DROP_SYMBOLS:
                toks.append(Tok(_SYMBOLS.get(ch, ch), s, e, False))
    return _fold(toks)


def _fold(toks: list[Tok]) -> list[Tok]:
    """'x' between numbers -> '*'; plain non-integer fractions a/b -> their value."""
    out: list[Tok] = []
    i, n = 0, len(toks)
    while i < n:
        t = toks[i]
        if t.text == "x" and 0 < i < n - 1 and toks[i - 1].is_num and toks[i + 1].is_num:
            out.append(t._replace(text="*"))
            i += 1
            continue
        # a / b, not part of a longer chain like 1/2/2020
        if (t.is_num and not t.parts and i + 2 < n and toks[i + 1].text == "/" and toks[i + 2].is_num
                and not toks[i + 2].parts and (i + 3 >= n or toks[i + 3].text != "/")
                and (i == 0 or toks[i - 1].text != "/")):
            v = _fraction(t.text, toks[i + 2].text)
            if v is not None:
                out.append(Tok(v, t.start, toks[i + 2].end, True, (t.text, toks[i + 2].text)))
                i += 3
                continue
        out.append(t)
        i += 1
    return out


class SoftText:
    """A text in canonical tokens, with a first-token index for fast phrase search."""

    def __init__(self, text: str):
        self.text = text
        self.toks = canonical_tokens(text)
        self._at: dict[str, list[int]] = {}
        self._numbers: list[tuple[str, int]] | None = None
        for i, t in enumerate(self.toks):
            self._at.setdefault(t.text, []).append(i)

    def find(self, phrase: str | list[str], start: int = 0) -> int:
        """Index of the first token of the first run equal to ``phrase`` at or after ``start``; -1 if none."""
        needle = [t.text for t in canonical_tokens(phrase)] if isinstance(phrase, str) else phrase
        if not needle:
            return -1  # a phrase with no content matches nothing (validation reports it)
        m = len(needle)
        for i in self._at.get(needle[0], ()):
            if i >= start and [t.text for t in self.toks[i:i + m]] == needle:
                return i
        return -1

    def find_any(self, alternatives: list[str], start: int = 0) -> int:
        """Earliest match of any alternative at or after ``start``; -1 if none."""
        hits = [i for i in (self.find(a, start) for a in alternatives) if i >= 0]
        return min(hits) if hits else -1

    def numbers(self) -> list[tuple[str, int]]:
        """(canonical value, token index) of every number, a folded fraction also by its parts."""
        if self._numbers is None:
            self._numbers = []
            for i, t in enumerate(self.toks):
                if t.is_num:
                    self._numbers += [(t.text, i)] + [(p, i) for p in t.parts]
        return self._numbers

    def char_span(self, i: int) -> tuple[int, int]:
        return self.toks[i].start, self.toks[i].end


def has_content(phrase: str) -> bool:
    """Whether a key step / phrase has any canonical token (else it could never match)."""
    return bool(canonical_tokens(phrase))


def matched_groups(soft: SoftText, key_steps: list[list[str]]) -> int:
    """How many key-step groups have at least one alternative in ``soft``."""
    return sum(soft.find_any(group) >= 0 for group in key_steps)

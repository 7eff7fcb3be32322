"""One example = one visual question, in MathVista's schema plus what the rewards need.

The MathVista fields (pid, question, image, answer, answer_type, precision, question_type,
metadata{context, skills, grade, language, source, ...}) are kept verbatim so the same
loader, stage filters and metrics serve both MathVista and the synthetic curriculum.

The extra fields carry the supervision each paper's reward needs. They are optional:
MathVista rows have none of them, and a reward that needs a missing field is a config
error at start (grpo/rewards checks), never a silent zero.

    reasoning      worked solution text              -> R1-VL SFT warm-up targets
    key_steps      groups of accepted alternatives    -> R1-VL StepRAR
    intermediates  named intermediate quantities      -> RewardMap detail (partial credit)
    difficulty     easy / middle / hard, hops         -> RewardMap difficulty weight
    rubrics        rubric items with rule evidence    -> V-Rubrics
    marks          shapes and numbers as drawn        -> perception labels of the warm-up
    caption        every quantity drawn, as text      -> caption targets of the warm-up
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ANSWER_TYPES = ("integer", "float", "text", "list")
QUESTION_TYPES = ("free_form", "multi_choice")
DIFFICULTIES = ("easy", "middle", "hard")
RUBRIC_DIMENSIONS = ("VF", "RC", "IF")  # visual fidelity, reasoning correctness, instruction following
RUBRIC_LABELS = ("ESSENTIAL", "IMPORTANT", "OPTIONAL", "PITFALL")


@dataclass
class Intermediate:
    """A quantity a correct solution computes on the way (RewardMap's sub-answer)."""

    name: str  # e.g. "red circles", "height of bar B"
    value: str  # canonical number string (data.contract.normalize_number form)


@dataclass
class RubricItem:
    """One V-Rubrics criterion.

    ``satisfied`` (from a judge) means "the response does what ``text`` says". For a
    PITFALL the text names the mistake ("Reports the total including the blue squares")
    and the weight is negative: satisfied = the pitfall was committed, which vetoes the
    answer reward and all positive rubric credit.

    ``evidence`` is what the built-in rule judge checks, one of:
      {"kind": "mentions", "phrases": [...]}      any phrase (normalised) in the reasoning
      {"kind": "number", "value": "12"}           that number appears in the reasoning
      {"kind": "ordered", "values": ["3", "7"]}   these numbers appear in this order
      {"kind": "answer", "value": "12"}           the SOLUTION equals this number
    A model judge ignores it and reads ``text``.
    """

    text: str
    dimension: str  # one of RUBRIC_DIMENSIONS
    label: str  # one of RUBRIC_LABELS
    weight: float  # signed; PITFALL < 0
    evidence: dict[str, Any] = field(default_factory=dict)


@dataclass
class Example:
    pid: str
    question: str
    answer: str  # gold answer as a string ("" = no gold: training refuses such rows)
    answer_type: str = "integer"
    precision: int | None = None  # decimals for float answers (MathVista convention)
    question_type: str = "free_form"
    metadata: dict[str, Any] = field(default_factory=dict)
    image: Any = None  # PIL.Image.Image, decoded lazily by loaders where possible
    image_path: str | None = None  # relative path inside a dataset directory, if any
    # A row of several images (an `images` list column): all of them, in the order the prompt
    # shows them, and ``image`` is the first; None for the usual one-image row. Read both
    # through ``prompt_images``.
    images: list[Any] | None = None
    choices: list[str] | None = None
    unit: str | None = None
    # --- supervision for the rewards (absent on MathVista) ---
    reasoning: str | None = None
    key_steps: list[list[str]] = field(default_factory=list)
    intermediates: list[Intermediate] = field(default_factory=list)
    difficulty: str | None = None
    hops: int = 1
    rubrics: list[RubricItem] = field(default_factory=list)
    # --- what the renderer drew (synthetic only): dense perception labels for the warm-up
    marks: list[dict[str, Any]] = field(default_factory=list)
    caption: str | None = None  # every perceived quantity, "name: value." (data/gen_common.Family.describe)

    @property
    def prompt_images(self) -> list[Any]:
        """The images the prompt shows, in order: ``images`` of a several-image row, else [image]."""
        return list(self.images) if self.images else [self.image]

    @property
    def context_family(self) -> str:
        """metadata.context lower-cased, with any '*chart' -> 'chart' and '*plot' -> 'plot'."""
        ctx = str(self.metadata.get("context", "")).strip().lower()
        if ctx.endswith("chart"):
            return "chart"
        if ctx.endswith("plot"):
            return "plot"
        return ctx

    @property
    def stage(self) -> int | None:
        """Curriculum stage recorded by the generator (None for external data)."""
        s = self.metadata.get("stage")
        return int(s) if s is not None else None

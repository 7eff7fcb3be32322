"""Examples in the MathVista schema: synthetic curriculum, stage filters, phase mixtures.

Exports only; importing this package draws nothing and touches no files. The JSONL I/O
lives in ``data.jsonl`` and the MathVista loader in ``data.mathvista`` (import them
directly; they are not re-exported so that ``import data`` stays light).
"""

from data.mixture import PHASES, MixtureStream, phase_stream
from data.schema import Example, Intermediate, RubricItem
from data.stages import in_stage, select_stage, stage_filter
from data.synthetic import curriculum, generate, tokenizer_corpus

__all__ = [
    "Example", "Intermediate", "RubricItem",
    "curriculum", "generate", "tokenizer_corpus",
    "in_stage", "select_stage", "stage_filter",
    "PHASES", "MixtureStream", "phase_stream",
]

"""Examples in the MathVista schema: synthetic curriculum, stage filters, phase mixtures, I/O.

Exports only; importing this package draws nothing and touches no files.
"""

from data.schema import Example, Intermediate, RubricItem
from data.synthetic import curriculum, generate, tokenizer_corpus

__all__ = ["Example", "Intermediate", "RubricItem", "curriculum", "generate", "tokenizer_corpus"]

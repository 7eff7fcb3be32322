"""A small byte-level BPE tokenizer with Qwen2.5-VL's chat and vision special tokens.

The embedded tiny model (grpo/model/tiny.py) cannot download Qwen's 151k-token tokenizer, so
it trains its own, the same *kind* of tokenizer as Qwen2's:

- normalizer NFC, then Qwen2's pre-tokenizer regex (letters run together, **every digit
  is its own pre-token**, punctuation runs, whitespace runs), then GPT-2 byte-level
  mapping, so any unicode string round-trips through bytes with no unknown token;
- a byte-level BPE trained with HF ``tokenizers`` on a corpus of contract prompts and
  worked responses (``data.synthetic.tokenizer_corpus``). Training is single-pass and
  deterministic for a fixed corpus (checked by tests: same corpus -> same file);
- Qwen's special tokens after the BPE vocabulary, in Qwen's order (<|endoftext|>,
  <|im_start|>, <|im_end|>, ..., <|vision_start|>, <|vision_end|>, <|vision_pad|>,
  <|image_pad|>, <|video_pad|>). Their ids differ from Qwen's (151643...) because the
  vocabulary is small; the model config takes its ids from this tokenizer, never from
  constants;
- the four contract tags <REASONING> </REASONING> <SOLUTION> </SOLUTION> as *added,
  non-special* tokens: one id each (the policy emits a tag in one step, and the rewards'
  regexes see it whole), and they survive ``decode(skip_special_tokens=True)``.

Simplified relative to Qwen: no tool-call / FIM added tokens, and a vocabulary of at most
1,024 tokens instead of 151k (556 for the shipped model: the merges its small corpus supports;
the LM head is then a rounding error in the cost).
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

# Qwen2's pre-tokenizer: contractions | optional non-letter + letters | ONE digit |
# punctuation run | newlines | trailing spaces | spaces. `\p{N}` without `+` is what
# splits "1234" into 1 2 3 4: numbers are then spelled digit by digit, which keeps
# arithmetic learnable with a tiny vocabulary.
QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen2.5-VL's special tokens, in Qwen's id order (there they start at 151643).
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Contract tags (data/contract.py): single tokens, but ordinary text for decoding.
CONTRACT_TOKENS: tuple[str, ...] = ("<REASONING>", "</REASONING>", "<SOLUTION>", "</SOLUTION>")

# Qwen-style ChatML template. Difference from Qwen2.5-VL's own: no default system prompt
# ("You are a helpful assistant.") when none is given -- the tiny model never saw one, and
# 8 fewer prompt tokens per rollout matter at its scale. A 7B loaded from its directory
# keeps its own template (with the default system prompt).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _empty_bpe_pipeline() -> Tokenizer:
    """Qwen2's normalizer / pre-tokenizer / decoder around an untrained BPE model."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            # use_regex=False: the Split above already did the splitting, ByteLevel only maps bytes.
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def train_bpe(corpus: Iterable[str], vocab_size: int = 1024) -> Tokenizer:
    """Train the byte-level BPE on ``corpus`` and append the special and contract tokens.

    ``vocab_size`` is the total, special tokens included. The BPE part may come out smaller
    when the corpus has too few distinct pairs; the model config reads the real size.
    """
    texts = [t for t in corpus if t]
    if not texts:
        raise ValueError("train_bpe: the corpus is empty; pass a list of non-empty strings")
    n_reserved = len(SPECIAL_TOKENS) + len(CONTRACT_TOKENS)
    if vocab_size < 256 + n_reserved:
        raise ValueError(f"train_bpe: vocab_size={vocab_size} is below 256 bytes + {n_reserved} special tokens")
    tok = _empty_bpe_pipeline()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - n_reserved,
        # All 256 byte symbols are in the vocabulary even if the corpus never uses them:
        # this is what makes arbitrary bytes encodable (no unknown token).
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # Added after training so they take the ids right after the BPE vocabulary, in order.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in CONTRACT_TOKENS])
    return tok


def wrap_for_transformers(tok: Tokenizer):
    """A transformers tokenizer around ``tok``, configured like Qwen2.5-VL-Instruct's.

    eos = <|im_end|> (end of an assistant turn, where sampling stops), pad = <|endoftext|>,
    no BOS; padding side left (prompts are right-aligned so every row's next token is at
    the same column during decoding -- see grpo/rollout/sampler.py).
    """
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )

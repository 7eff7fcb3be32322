"""DAPO's soft overlong punishment: a length penalty that ramps in over the last L_cache tokens.

DAPO (Yu et al. 2025, section 3.4, "Overlong Reward Shaping") punishes a completion that
runs into the budget, but softly: a hard -1 for every truncated completion also punishes
sound reasoning that merely ran long, and the step from 0 to -1 at one token is noise the
policy cannot read. With L_max the completion budget (sampling.max_new_tokens), L_cache
the buffer (rewards.overlong_buffer) and |y| the completion's token count:

    R(y) =  0                               |y| <= L_max - L_cache
            (L_max - L_cache - |y|) / L_cache    L_max - L_cache < |y| <= L_max
            -1                              |y| > L_max

a line from 0 down to -1 across the buffer. DAPO adds R to the correctness reward; here it
is the reward component ``overlong``, weighted like every other, and multiplied by
rewards.overlong_penalty (verl's ``overlong_buffer.penalty_factor``; 1 = DAPO's R exactly).
The sampler never returns more than L_max tokens (a completion that used all of them is
the truncated one, R = -1); the last branch holds for a count from elsewhere (a tokenizer's
re-encoding of the text).

How it differs from ``brevity`` (verifier.py): brevity pays short answers (+1 below .55 L)
and has steps; overlong never pays, is 0 on everything that ends before the buffer, and is
continuous in |y|. Beside ``--optim.mask_truncated`` (DAPO's overlong filtering: no
gradient from truncated rows) it is the other half of DAPO's length treatment.
"""

from __future__ import annotations


def soft_overlong(num_tokens: int, max_new_tokens: int, buffer: int, penalty: float = 1.0) -> float:
    """penalty * R(y) for a completion of ``num_tokens`` tokens (DAPO's soft punishment, above)."""
    free = max_new_tokens - buffer  # L_max - L_cache: the length that costs nothing
    if num_tokens <= free:
        return 0.0
    if num_tokens <= max_new_tokens:
        return penalty * (free - num_tokens) / buffer
    return -penalty

"""Per-token log-probs of sampled completions: the policy's (with grad) and the reference's.

GRPO's loss needs, for every completion token o_t of every rollout,

    logp_t     = log pi_theta(o_t | q, image, o_<t)     policy, LoRA on, with grad
    ref_logp_t = log pi_ref(o_t | q, image, o_<t)       reference (adapters off), no grad

(and old_logp_t: update 1's logp_t, kept for updates 2..mu, grpo/step.py). One forward over
prompt + completion gives all T of them.

What this file does to make that cheap (the reading path skips to the code):

- The vision tower runs per prompt, never per row: frozen (the default), not at all (its
  tokens from sampling, grpo/model/prompt_context.py PromptContext, serve all B*G rows);
  with LoRA in it (lora.vision / lora.merger), once per prompt in each pass (grpo/model/vision.py).
- The prompt once per group (``shared_prefix``, the default, optim.shared_prefix): a group's
  G rows share the prompt, and causal attention means no prompt position sees a completion,
  so grpo/model/shared_prefix.py runs the B prompts once ([B, P, d]) next to the N
  completions ([N, T, d]), each completion attending to its prompt's keys/values copied G
  times; autograd sums the G copies' gradients into the one prompt pass. The same log-probs
  and gradients as the full-row pass below (``completion_hidden_states``: the prompt in all
  N rows, [N, P + T, d]), kept as the reference, at 1/G of the prompt's compute and saved
  activations.
- Logits only at completion positions: the transformer runs on all P + T positions (P prompt
  tokens), but the LM head runs only on the T hidden states that predict completion tokens
  (positions P-1 .. P+T-2).
- Logits never whole: the LM head and the log-softmax run a chunk of whole rows at a time
  (``chunk_tokens`` completion tokens). With grad each chunk is checkpointed: backward
  recomputes its logits from the kept hidden states instead of autograd keeping every
  chunk's [rows, T, V] (64 rows x 256 tokens of Qwen's 152k vocabulary are 5 GB in bf16),
  so the logits and their gradient exist for one chunk at a time, at the price of one more
  LM-head matmul per chunk in backward. (grpo_kernels.logprob.token_logprobs_from_hidden does it
  on a bare weight; here the head stays the model's own module, whatever it is.)
- The log-softmax goes through ``grpo_kernels.logprob.token_logprobs`` (Triton on CUDA, the
  PyTorch reference on CPU): log p(target) without an fp32 [N, T, V] copy on the GPU.
- The policy's entropy H_t = -sum_v p_v log p_v at the log-probs' temperature, from the same
  chunk's logits: ``entropy=True`` the log line's, no grad; ``"grad"`` the bonus's, with grad.
- The pass with grad runs the language model in training mode: transformers' activation
  checkpointing (``model.gradient_checkpointing``) recomputes a decoder layer in backward
  only when the layer is training, and an eval-mode pass would silently keep every
  activation. Qwen2.5-VL has no dropout and GRPO phases refuse LoRA dropout
  (grpo/config_checks.py), so training mode is the same function as the sampler's eval mode.

Temperature: the logits are divided by the sampler's temperature (pass the same value),
so this is the same function as the sampler's ``logprobs``; temperature 0 (greedy
sampling) is scored at 1. The trainer calls these once per training micro-batch
(``PromptContext.prompts``): N rows here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import ContextManager

import torch
from torch.utils.checkpoint import checkpoint

from grpo.model.prompt_context import PromptContext, completion_position_ids, group_rows, prompt_embeds
from grpo.model.shared_prefix import shared_prefix_hidden_states, supports
from grpo_kernels.logprob import token_logprobs
from lora.inject import training_mode


def _check_shapes(ctx: PromptContext, completion_ids: torch.Tensor, completion_mask: torch.Tensor, G: int) -> None:
    if not isinstance(G, int) or G < 1:
        raise ValueError(f"G={G!r}: the group size must be an integer >= 1")
    N = ctx.B * G
    if completion_ids.dim() != 2 or completion_ids.shape[0] != N:
        raise ValueError(f"completion_ids has shape {tuple(completion_ids.shape)}; expected [B*G, T] = [{N}, T] "
                         f"for B={ctx.B} prompts and G={G}")
    if completion_mask.shape != completion_ids.shape:
        raise ValueError(f"completion_mask {tuple(completion_mask.shape)} != completion_ids "
                         f"{tuple(completion_ids.shape)}")


def token_entropy(logits: torch.Tensor, temperature: float, block_tokens: int = 128) -> torch.Tensor:
    """H = -sum_v p_v log p_v of softmax(logits / temperature): logits [..., V] -> fp32 [...], no grad.

    A diagnostic (the log line's ``entropy``), not part of the loss: detached, so it keeps
    nothing for backward. fp32 for the sum over V, ``block_tokens`` tokens at a time, so its
    few fp32 [block_tokens, V] temporaries (78 MB each at Qwen's vocabulary) stay below a
    1024-token chunk's own bf16 logits (311 MB). Cost: a handful of element-wise passes over
    the chunk's logits, against the LM head's 2 d flops per logit."""
    flat = logits.detach().reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    with torch.no_grad():
        for s in range(0, flat.shape[0], block_tokens):
            logp = torch.log_softmax(flat[s : s + block_tokens].float() / temperature, -1)
            out[s : s + block_tokens] = -(logp.exp() * logp).sum(-1)
    return out.reshape(logits.shape[:-1])


class _EntropyWithGrad(torch.autograd.Function):
    """``token_entropy`` with its gradient, for the entropy bonus (optim.entropy_coef):

        dH/dz_v = -p_v (log p_v + H) / temperature,      p = softmax(z / temperature)

    Backward recomputes p from the logits ``block_tokens`` tokens at a time in fp32, like the
    forward: autograd through the formula would keep fp32 p and log p of the whole chunk
    (two fp32 [rows, T, V] copies) until backward. What it keeps is the logits tensor the
    log-prob pass keeps anyway; what it adds in backward is its gradient (the logits' size in
    their dtype, summed by autograd into the log-probs' one) and a few fp32 [block_tokens, V]
    temporaries. ``known``: the entropies already computed (a checkpointed chunk's recompute
    in backward needs the saved logits, not the values again)."""

    @staticmethod
    def forward(ctx, logits, temperature: float, block_tokens: int, known):
        ctx.save_for_backward(logits)
        ctx.temperature, ctx.block_tokens = temperature, block_tokens
        return known.clone() if known is not None else token_entropy(logits, temperature, block_tokens)

    @staticmethod
    def backward(ctx, g):
        (logits,) = ctx.saved_tensors
        flat, t, k = logits.reshape(-1, logits.shape[-1]), ctx.temperature, ctx.block_tokens
        g = g.reshape(-1, 1).float() / t
        out = torch.empty_like(flat)
        for s in range(0, flat.shape[0], k):
            logp = torch.log_softmax(flat[s : s + k].float() / t, -1)
            p = logp.exp()
            H = -(p * logp).sum(-1, keepdim=True)
            out[s : s + k] = -(p * (logp + H)) * g[s : s + k]
        return out.view(logits.shape), None, None, None


def completion_hidden_states(
    model, ctx: PromptContext, completion_ids: torch.Tensor, completion_mask: torch.Tensor, G: int,
) -> torch.Tensor:
    """Final hidden states at the T positions that predict completion tokens: [N, T, d].

    With grad, the language model runs in training mode (module docstring: activation
    checkpointing); without, in the mode it is in."""
    rows = group_rows(ctx.B, G, completion_ids.device)
    T = completion_ids.shape[1]
    # [N, P + T, d]: prompt embeddings (visual tokens in) per row, then completion tokens.
    embeds = torch.cat([prompt_embeds(model, ctx, tower=True)[rows], model.get_input_embeddings()(completion_ids)], 1)
    attention_mask = torch.cat([ctx.attention_mask[rows], completion_mask.to(ctx.attention_mask.dtype)], 1)
    position_ids = torch.cat([ctx.position_ids[:, rows], completion_position_ids(ctx, rows, T)], 2)
    with training_mode(model.model.language_model, on=torch.is_grad_enabled()):
        out = model.model(inputs_embeds=embeds, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False)
    # The token at position P + t is predicted by the hidden state at P + t - 1.
    return out.last_hidden_state[:, ctx.P - 1 : ctx.P + T - 1]


def _chunk_logprobs(lm_head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                    temperature: float, backend: str, entropy: list | None = None, grad: bool = False):
    """One chunk: hidden [rows, T, d] -> logits [rows, T, V] (the only place they exist) -> [rows, T].
    ``entropy``: a list that receives the chunk's token entropies [rows, T] (once: the recompute
    of a checkpointed chunk in backward finds them there); ``grad``: also returned, with grad."""
    logits = lm_head(hidden)
    if grad:
        ent = _EntropyWithGrad.apply(logits, temperature, 128, entropy[0] if entropy else None)
        entropy[:] = [ent.detach()]
        return token_logprobs(logits, targets, temperature=temperature, backend=backend), ent
    if entropy is not None and not entropy:
        entropy.append(token_entropy(logits, temperature))
    return token_logprobs(logits, targets, temperature=temperature, backend=backend)


def completion_logprobs(
    model,
    ctx: PromptContext,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    G: int,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    backend: str = "auto",
    shared_prefix: bool = True,
    entropy: bool | str = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log softmax(lm_head(h) / temperature)[o_t] for B*G completions: [N, T] fp32, 0 where masked.

    Runs under the caller's grad mode and adapter state: call it plainly for the policy, or use
    ``reference_logprobs`` for the reference. ``chunk_tokens``: completion tokens per LM-head chunk
    (whole rows, at least one). ``entropy``: return (log-probs, token entropies [N, T] fp32, no grad
    or, "grad", with grad: the same values).
    """
    _check_shapes(ctx, completion_ids, completion_mask, G)
    if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens!r}: must be an int >= 1")
    temperature = 1.0 if temperature == 0 else float(temperature)
    hidden_states = shared_prefix_hidden_states if shared_prefix and supports(model) else completion_hidden_states
    hidden = hidden_states(model, ctx, completion_ids, completion_mask, G)  # [N, T, d]
    lm_head = model.get_output_embeddings()
    rows = max(1, chunk_tokens // max(1, hidden.shape[1]))
    out, ents = [], []
    for start in range(0, hidden.shape[0], rows):
        # contiguous: a strided [rows, T, d] slice makes torch's no-grad matmul copy the
        # expanded lm_head weight (the reference pass: ~50 s per chunk at the 7B on a CPU)
        h, y = hidden[start : start + rows].contiguous(), completion_ids[start : start + rows]
        box = [] if entropy else None  # the chunk's entropies land here
        if h.requires_grad and entropy == "grad":  # the entropies as a second output, with their gradient
            lp, ent = checkpoint(_chunk_logprobs, lm_head, h, y, temperature, backend, box, True, use_reentrant=False)
            out, box = out + [lp], [ent]
        elif h.requires_grad:  # keep h only; backward recomputes this chunk's logits
            out.append(checkpoint(_chunk_logprobs, lm_head, h, y, temperature, backend, box, use_reentrant=False))
        else:
            out.append(_chunk_logprobs(lm_head, h, y, temperature, backend, box))
        ents += box or []
    m = completion_mask.to(torch.float32)
    return (torch.cat(out, 0) * m, torch.cat(ents, 0) * m) if entropy else torch.cat(out, 0) * m


def reference_logprobs(
    model,
    ctx: PromptContext,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    G: int,
    *,
    ref_context: Callable[[], ContextManager] | None = None,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    backend: str = "auto",
    shared_prefix: bool = True,
) -> torch.Tensor:
    """The reference policy's log-probs: no grad, inside ``ref_context()``.

    With LoRA the reference is the same model with adapters off (the base, or base + a warm-up's frozen adapter); pass
    ``ref_context=lambda: lora.inject.disable_adapters(model)``. None = the model as is
    (e.g. a separate frozen reference model).
    """
    with torch.no_grad(), (ref_context() if ref_context is not None else contextlib.nullcontext()):
        return completion_logprobs(model, ctx, completion_ids, completion_mask, G,
                                   temperature=temperature, chunk_tokens=chunk_tokens, backend=backend,
                                   shared_prefix=shared_prefix)

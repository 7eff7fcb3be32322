"""Group sampling for GRPO: prefill each prompt once, copy its KV cache G times, decode.

GRPO scores each prompt by G completions sampled from the current policy. The obvious way,
``generate`` on every prompt repeated G times, pays for the prompt G times: G vision-tower
passes over the same image and G prefills of the same tokens. Here (gpt-fast style, a
hand-written loop instead of ``model.generate``):

    ctx    = build_prompt_context(model, prompts)   # vision tower + M-RoPE, B prompts
    logits, cache = prefill(model, ctx)             # one prefill per prompt: [B, V]
    copy the cache G times                          # rows b*G .. b*G+G-1 = prompt b
    decode_n_tokens(...)                            # B*G rows, one token per step

Padding side: LEFT. Every prompt ends in the last column, so the token sampled at step s
of every row goes in the same column, the KV cache stays one rectangle, and the attention
mask just grows by a column of ones per step. (Right padding would put each row's next
token at a different column.)

Positions during decode (the Qwen2.5-VL detail that is easy to get wrong): the k-th
completion token of a row sits at ``next_position[prompt] + k`` on all three M-RoPE axes,
next_position = the prompt's real length + its rope delta (grpo/model/prompt_context.py).
Positions are passed explicitly every step, so nothing depends on the ``rope_deltas``
state transformers keeps inside the model.

Which log-prob is returned: ``logprobs`` is log softmax(logits / temperature)[token], the
temperature-scaled distribution *before* top-k / top-p filtering. That is the quantity
grpo/model/logprobs.py recomputes (the loss's sampler_logp: the mismatch stats and the rollout
correction compare the two, so they must be the same function); top-k / top-p are treated as part
of the sampler, not of the policy, as in TRL. ``filtered_logprobs`` is the log-prob under
the distribution actually sampled from (after filtering), for diagnostics. With
temperature 0 (greedy) both are taken at temperature 1.

Stopping: a row stops at its first stop token (<|im_end|>, and <|endoftext|> like Qwen's
generation config); later steps feed it <|endoftext|> as padding and mask it out. The loop
stops when every row has stopped or after max_new_tokens.

Finished rows leave the batch (and the KV cache) once a quarter of it has stopped
(``compact``), so a short completion stops costing compute soon after it ends.

Two decode paths behind one loop (``decode=``): "static" -- a preallocated KV cache and a
hand-written decoder step (grpo/rollout/decoder.py), the default where supported -- and "hf",
transformers' forward with its DynamicCache, kept as the reference. Tests hold both to
transformers' greedy ``generate`` token for token.

What is exact and what is equal to rounding: "static" computes transformers' numbers bit for bit
where the operations are the same, and "auto" takes it in fp32 (the tiny preset's evaluations:
their numbers do not move). "fused" -- "auto" in bf16 / fp16, the qwen7b preset's rollouts and
evaluations -- folds LoRA's add into its B matmul, stacks q/k/v's and gate/up's A, and runs
RMSNorm as one operator (grpo/rollout/decoder.py): other roundings, so it is held to the
contract instead of to bits: greedy = ``generate`` token for token, sampled log-probs = a full
forward within the tolerance of tests/test_sampler.py (tests/test_sampler_fused.py).

Simplified: one host sync per step for the stop check, no speculative decoding, no torch.compile
(on a CPU it does not pay: bench.sampler --compile; a CUDA graph behind a DecodeHook: rollout/merged.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from grpo.model.load import ModelBundle
from grpo.model.prompt_context import PromptContext, build_prompt_context, group_rows, prompt_embeds
from grpo.model.prompts import PromptBatch
from grpo.rollout import decoder
from lora import frozen_adapter_casts


@dataclass
class Rollout:
    """A scored rollout: one sampler call's prompts, completions and rewards (G rows a prompt)."""

    examples: list[Any]  # one per prompt the sampler kept, in row-group order
    out: SampleOutput
    scores: Any  # grpo.rewards.RewardBatch of out's rows
    prompts: Any = None  # grpo.model.prompts.PromptCounts of the call's prompts (entered, resized, skipped)


def content_tokens(out: SampleOutput) -> list[int]:
    """Completion tokens per row without the stop token: what the brevity and truncation rules
    count (tok >= L is truncated: L - 1 tokens and a stop did not hit the budget, L without one did)."""
    return (out.lengths - out.finished.long()).tolist()


@dataclass
class SampleOutput:
    """B*G completions; row n belongs to prompt ``prompt_index[n]`` (= n // G)."""

    completion_ids: torch.Tensor  # [N, T] long, pad after the stop token
    completion_mask: torch.Tensor  # [N, T] long, 1 up to and including the stop token
    logprobs: torch.Tensor  # [N, T] fp32, log p_T(token) unfiltered, 0 on padding: the loss's sampler_logp
    filtered_logprobs: torch.Tensor  # [N, T] fp32, log p under the top-k/top-p filtered distribution
    finished: torch.Tensor  # [N] bool, emitted a stop token
    truncated: torch.Tensor  # [N] bool, hit max_new_tokens without one
    texts: list[str]  # decoded completions, no special tokens, no stop token
    prompt_index: torch.Tensor  # [N] long
    G: int
    context: PromptContext  # vision features + positions, reusable by grpo/model/logprobs.py
    guided: torch.Tensor | None = None  # [N] bool, rows holding a demonstration (grpo/rollout/guided.py); None: none

    @property
    def lengths(self) -> torch.Tensor:
        """[N] completion tokens, the stop token included."""
        return self.completion_mask.sum(1)

    def loss_mask(self, mask_truncated: bool = False) -> torch.Tensor:
        """[N, T] the tokens the loss trains on: every sampled token, or with ``mask_truncated``
        (optim.mask_truncated; TRL's mask_truncated_completions, DAPO's overlong filtering) none
        of a truncated row's. Only the loss reads it: the row keeps its reward and its place in
        its group's advantage statistics (as in TRL), and the log-prob passes attend over
        ``completion_mask`` either way (the row's log-probs stay the policy's)."""
        return self.completion_mask * ~self.truncated[:, None] if mask_truncated else self.completion_mask

    @classmethod
    def from_rows(cls, outs: Sequence["SampleOutput"], context: PromptContext, rows: torch.Tensor | None = None,
                  *, pad_id: int = 0, G: int | None = None) -> "SampleOutput":
        """One output from the rows of ``outs``: their completions padded on the right to the
        longest (token ``pad_id``, mask 0, log-prob 0; outputs of one length pad nothing) and
        stacked in order, then ``rows`` of them taken (None: all), as groups of ``G`` (default
        outs[0].G) on ``context``'s prompts: how dynamic sampling selects and joins rollouts and
        NoisyRollout joins its clean and noisy rows (the sampler builds its own from the decode
        loop)."""
        T = max(o.completion_ids.shape[1] for o in outs)

        def stack(name: str, pad: float | int | bool) -> torch.Tensor:
            x = torch.cat([pad_right(t, T, pad) if t.dim() == 2 else t for t in (getattr(o, name) for o in outs)])
            return x if rows is None else x[rows]

        texts = [t for o in outs for t in o.texts]
        G = outs[0].G if G is None else G
        guided = None
        if any(o.guided is not None for o in outs):
            guided = torch.cat([o.guided_rows for o in outs])
            guided = guided if rows is None else guided[rows]
        return cls(completion_ids=stack("completion_ids", pad_id), completion_mask=stack("completion_mask", 0),
                   logprobs=stack("logprobs", 0.0), filtered_logprobs=stack("filtered_logprobs", 0.0),
                   finished=stack("finished", False), truncated=stack("truncated", False),
                   texts=texts if rows is None else [texts[i] for i in rows.tolist()],
                   prompt_index=group_rows(context.B, G, outs[0].completion_ids.device), G=G, context=context,
                   guided=guided)

    @property
    def guided_rows(self) -> torch.Tensor:
        """[N] bool, the rows holding a demonstration (grpo/rollout/guided.py); all False when ``guided`` is None."""
        return torch.zeros_like(self.finished) if self.guided is None else self.guided


def pad_right(x: torch.Tensor, T: int, value: float | int | bool) -> torch.Tensor:
    """``x`` [..., t] padded with ``value`` on the right to [..., T] (completions of several samplings)."""
    pad = T - x.shape[-1]
    if pad == 0:
        return x
    return torch.cat([x, torch.full((*x.shape[:-1], pad), value, dtype=x.dtype, device=x.device)], -1)


# ----------------------------------------------------------------------------- model calls


def _cache_kwarg(model) -> str:
    """transformers renamed past_key_values -> cache in 5.x; accept both."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def prefill(model, ctx: PromptContext):
    """Run the B prompts once. Returns (logits of the last prompt token [B, V] fp32, KV cache)."""
    out = model(
        inputs_embeds=prompt_embeds(model, ctx),  # visual tokens already in: no vision pass here
        attention_mask=ctx.attention_mask,
        position_ids=ctx.position_ids,
        use_cache=True,
        # The LM head on one position per row, not P. An index, not logits_to_keep=1: the
        # slice [:, -1:] keeps the [B, P, d] strides, torch's matmul then cannot fold it into
        # one mm and copies the expanded head weight instead (152k x 3584 in bf16: ~50 s per
        # call on one CPU thread, against 0.5 s); indexing gives a fresh [B, 1, d].
        logits_to_keep=torch.tensor([ctx.P - 1], device=ctx.input_ids.device),
    )
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    return out.logits[:, -1].float(), cache


def decode_one_token(model, cache, token: torch.Tensor, position: torch.Tensor,
                     attention_mask: torch.Tensor, cache_kw: str = "cache", fused: bool = False) -> torch.Tensor:
    """Feed one token per row ([N] ids at [N] positions) through the cache: next logits [N, V].

    A StaticKVCache takes the hand-written step (grpo/rollout/decoder.py; ``fused``: its
    fused form); a transformers cache takes the model's own forward, the reference path.
    """
    if isinstance(cache, decoder.StaticKVCache):
        return decoder.decode_step(model, cache, token, position, attention_mask.bool(), fused)
    N = token.shape[0]
    out = model(
        input_ids=token.view(N, 1),
        attention_mask=attention_mask,  # [N, P + steps so far + 1] (P: the prompt's length)
        position_ids=position.view(1, N, 1).expand(3, N, 1),  # text token: t = h = w
        use_cache=True,
        **{cache_kw: cache},
    )
    return out.logits[:, -1].float()


# ----------------------------------------------------------------------------- sampling one token


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k then top-p (nucleus) filtering: excluded entries become -inf. [N, V] -> [N, V]."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p; the most
        # likely token is always kept (its preceding mass is 0).
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_token(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token per row from logits [N, V] -> (token [N], logprob [N], sampler_logprob [N]).

    temperature 0 = greedy (argmax; ties go to the lowest id, as in torch.argmax and generate).
    """
    if temperature == 0:
        token = logits.argmax(-1)
        logp = torch.log_softmax(logits, -1).gather(-1, token[:, None]).squeeze(-1)
        return token, logp, logp
    scaled = logits / temperature
    logp_all = torch.log_softmax(scaled, -1)  # the policy's distribution at this temperature
    filtered = filter_logits(scaled, top_k, top_p)
    logq_all = torch.log_softmax(filtered, -1)
    # Exponential-race sampling: argmax p_i / E_i with E_i ~ Exp(1) picks i with probability
    # p_i. Same distribution as torch.multinomial, without its host sync on CUDA.
    e = torch.empty_like(logq_all).exponential_(1.0, generator=generator)
    token = (logq_all - e.log()).argmax(-1)
    idx = token[:, None]
    return token, logp_all.gather(-1, idx).squeeze(-1), logq_all.gather(-1, idx).squeeze(-1)


# ----------------------------------------------------------------------------- the loop


@frozen_adapter_casts()  # the adapters are fixed for the loop: LoRA's A and B cast once, not per token
def decode_n_tokens(
    model,
    cache,
    first_logits: torch.Tensor,
    next_position: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    stop_ids: torch.Tensor,
    pad_id: int,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None,
    compact: bool = True,
    step_fn: DecodeStep | None = None,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode up to max_new_tokens for N rows sharing ``cache``.

    first_logits [N, V]: logits after the prompt; next_position [N]; attention_mask [N, P]
    over the P prompt columns. Returns (tokens [N, T], logprobs [N, T], filtered_logprobs
    [N, T], done [N] bool). ``step_fn`` (token [N], position [N], attention_mask [N, P + t + 1])
    -> logits [N, V] replaces decode_one_token over ``cache`` (a DecodeHook's step); it keeps
    every row, so it runs without compaction. ``fused``: a static cache's step in its fused
    form (decode_one_token).

    ``compact``: once a quarter of the rows still in the batch have stopped, drop them from
    the batch and the KV cache (one gather of the cache), so finished completions stop
    costing compute. GRPO completion lengths vary a lot once the policy learns to stop;
    with random weights few rows stop and it rarely triggers. Greedy results do not
    depend on it; sampled ones do (fewer rows draw fewer random numbers) but stay
    reproducible for a seed.
    """
    if step_fn is not None and compact:
        raise ValueError("compact=True drops rows from the loop's own cache; a step_fn keeps its own: pass compact=False")
    N, device = first_logits.shape[0], first_logits.device
    tokens = torch.full((N, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logps = torch.zeros((N, max_new_tokens), dtype=torch.float32, device=device)
    logqs = torch.zeros_like(logps)
    done_all = torch.zeros(N, dtype=torch.bool, device=device)
    rows = torch.arange(N, device=device)  # original row of each row still in the batch
    done = torch.zeros(N, dtype=torch.bool, device=device)  # per row still in the batch
    cache_kw = _cache_kwarg(model)
    logits, n_steps = first_logits, 0
    for step in range(max_new_tokens):
        token, logp, logq = sample_token(logits, temperature, top_k, top_p, generator)
        token = token.masked_fill(done, pad_id)  # stopped rows (not yet dropped) emit padding
        tokens[rows, step] = token
        logps[rows, step] = logp.masked_fill(done, 0.0)
        logqs[rows, step] = logq.masked_fill(done, 0.0)
        done = done | torch.isin(token, stop_ids)
        n_steps = step + 1
        # A host sync per step (reads `done`); it buys stopping as soon as all rows are done.
        n_done = int(done.sum())
        if step == max_new_tokens - 1 or n_done == done.numel():
            break
        if compact and n_done >= max(1, done.numel() // 4):
            keep = (~done).nonzero().squeeze(1)
            done_all[rows[done]] = True
            cache.batch_select_indices(keep)
            rows, token, done = rows[keep], token[keep], done[keep]
            next_position, attention_mask = next_position[keep], attention_mask[keep]
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.shape[0], 1)], 1)
        if step_fn is None:
            logits = decode_one_token(model, cache, token, next_position + step, attention_mask, cache_kw, fused)
        else:
            logits = step_fn(token, next_position + step, attention_mask)
    done_all[rows[done]] = True
    return tokens[:, :n_steps], logps[:, :n_steps], logqs[:, :n_steps], done_all


def check_generator_device(generator: torch.Generator | None, device: torch.device) -> None:
    """Refuse a generator that does not live on the device the logits are drawn on: the
    exponential draw on CUDA logits needs a CUDA generator, and the mismatch would only
    surface on the first sampled token on a GPU. Checked here so a CPU test catches it."""
    if generator is None:
        return
    got, want = torch.device(generator.device), torch.device(device)
    same_index = got.index is None or want.index is None or got.index == want.index
    if got.type != want.type or not same_index:
        raise ValueError(f"the sampler's generator lives on {got} but the model's logits on {want}: "
                         f"build it as torch.Generator(device=model.device)")


def sampler_generator(generator: torch.Generator | None, seed: int | None, device: torch.device):
    """The generator ``sample`` draws with: the one given (checked to live on ``device``), a
    new one on ``device`` seeded with ``seed``, or None (torch's global RNG)."""
    if generator is None and seed is not None:
        return torch.Generator(device=device).manual_seed(seed)
    check_generator_device(generator, device)
    return generator


def _check_args(bundle: ModelBundle, prompts: PromptBatch, G: int, max_new_tokens: int, temperature: float,
                top_k: int, top_p: float, decode: str) -> None:
    """``sample``'s arguments, refused in one line each."""
    if not isinstance(G, int) or G < 1:
        raise ValueError(f"G={G!r}: the group size must be an integer >= 1")
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: must be an integer >= 1")
    if not temperature >= 0:
        raise ValueError(f"temperature={temperature!r}: must be >= 0 (0 = greedy)")
    if not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k={top_k!r}: must be an integer >= 0 (0 = off)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p!r}: must be in (0, 1] (1 = off)")
    if decode not in ("auto", "static", "fused", "hf"):
        raise ValueError(f"decode={decode!r}: use 'auto', 'static', 'fused' or 'hf'")
    prompt_len = prompts.input_ids.shape[1]
    if prompt_len + max_new_tokens > bundle.context_length:
        raise ValueError(f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} exceeds the model's "
                         f"context of {bundle.context_length}; lower max_new_tokens or the image size")


def stop_token_ids(bundle: ModelBundle) -> list[int]:
    """<|im_end|> (end of the assistant turn) and <|endoftext|>, as Qwen's generation config."""
    ids = [bundle.eos_token_id, bundle.tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    return sorted(set(int(i) for i in ids if i is not None))


DecodeStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DecodeHook(Protocol):
    """Another decode step for ``sample``: the checks, the vision pass, the prefill, the loop,
    the sampling of each token and the output stay the sampler's; only the per-token model
    call is the hook's (grpo/rollout/merged.py: a merged bf16 copy replayed as a CUDA graph)."""

    def begin(self, cache: Any, ctx: PromptContext, rows: torch.Tensor, G: int, max_new_tokens: int) -> DecodeStep:
        """Take the prefill cache of the B prompts; return the step for the N = B*G rows."""

    def end(self) -> None:
        """Free what ``begin`` allocated (the KV cache) between rollouts."""


@torch.no_grad()
def sample(
    bundle: ModelBundle,
    prompts: PromptBatch,
    *,
    G: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    compact: bool = True,
    decode: str = "auto",
    hook: DecodeHook | None = None,
) -> SampleOutput:
    """Sample G completions for each of the B prompts (N = B*G rows, grouped by prompt).

    ``seed`` (or an explicit ``generator``) makes the draw reproducible: same seed, same
    prompts, same device -> same completions. ``decode``: "static" (preallocated KV cache
    and the hand-written step of grpo/rollout/decoder.py), "hf" (transformers' forward and
    DynamicCache, the reference), "fused" (static with fewer operators, other rounding) or
    "auto" (static where supported; fused in bf16 / fp16: decoder.fused_by_default).
    ``compact``: drop finished rows from the batch (see decode_n_tokens). ``hook``: another
    decode step (DecodeHook); it decodes every row to the end and ignores ``decode``.
    """
    _check_args(bundle, prompts, G, max_new_tokens, temperature, top_k, top_p, decode)
    model, device = bundle.model, bundle.model.device
    generator = sampler_generator(generator, seed, device)  # refused unless on the model's device

    ctx = build_prompt_context(model, prompts)  # vision tower: once per prompt
    first_logits, cache = prefill(model, ctx)  # text prefill: once per prompt
    rows = group_rows(ctx.B, G, device)
    # The group copy: every layer's K and V [B, H, P, D] -> [B*G, H, P, D], prompt b in rows b*G..b*G+G-1.
    step_fn, fused = None, False
    if hook is not None:
        step_fn, cache, compact = hook.begin(cache, ctx, rows, G, max_new_tokens), None, False
    elif decode in ("static", "fused") or (decode == "auto" and decoder.supports(model)):
        cache = decoder.StaticKVCache.from_prefill(cache, G, max_new_tokens)
        fused = decode == "fused" or (decode == "auto" and decoder.fused_by_default(model))
    else:
        cache.batch_repeat_interleave(G)
    stop = torch.tensor(stop_token_ids(bundle), device=device)
    tokens, logps, logqs, done = decode_n_tokens(
        model, cache, first_logits[rows], ctx.next_position[rows], ctx.attention_mask[rows],
        max_new_tokens=max_new_tokens, stop_ids=stop, pad_id=bundle.pad_token_id,
        temperature=temperature, top_k=top_k, top_p=top_p, generator=generator, compact=compact,
        step_fn=step_fn, fused=fused,
    )
    if hook is not None:
        hook.end()
    # Mask: tokens up to and including the first stop token. A stopped row's later tokens
    # are padding, so "not yet stopped before this step" is the mask.
    is_stop = torch.isin(tokens, stop)
    stopped_before = (is_stop.long().cumsum(1) - is_stop.long()) > 0
    mask = (~stopped_before).long()
    texts = [bundle.decode(t[m.bool() & ~s].tolist()) for t, m, s in zip(tokens.cpu(), mask.cpu(), is_stop.cpu())]
    return SampleOutput(completion_ids=tokens, completion_mask=mask, logprobs=logps * mask,
                        filtered_logprobs=logqs * mask, finished=done, truncated=~done, texts=texts,
                        prompt_index=rows, G=G, context=ctx)

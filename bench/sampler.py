"""Benchmark: our group sampler vs transformers' generate on repeated prompts.

    python -m bench.sampler                     # tiny (B=4, 64 tokens) and mid (B=2, 32 tokens), G=8
    python -m bench.sampler --model mid --image-size 224 --mid-max-new-tokens 64
    python -m bench.sampler --compile           # also: our decode step under torch.compile

The baseline is what TRL does for a VLM group: every prompt and its pixels repeated G
times, one ``model.generate(do_sample=True, ...)`` call (``num_return_sequences=G`` with
Qwen2.5-VL images failed with a shape error in transformers 5.24). Both sides get the same
prompts, images, G, max_new_tokens, temperature / top-k / top-p and stop tokens; weights
are random (speed does not depend on their values). Rows rarely stop early with random
weights, so both sides mostly decode the full budget; tokens/s counts completion tokens
each side actually produced (up to and including the stop token).

Models: "tiny" is the embedded 1.4M-parameter model at 112 px (16 visual tokens per
image: per-step overhead dominates); "mid" is a randomly initialised Qwen2.5-VL of ~90M
parameters (text d=768 x 12 layers, vision d=384 x 8 blocks) at 336 px (576 patches,
144 visual tokens), the shape where sharing the prompt across the group pays. The mid
run uses a smaller batch and budget by default so that it stays near two minutes on two
CPU cores (generate re-encodes 16 images of 576 patches).

``--compile`` times our sampler a second way, its static decode step
(grpo/rollout/decoder.py ``decode_step``) under ``torch.compile`` (dynamic shapes: the
batch shrinks and the cache grows), alternated with the eager step: the first call's compile
time, the steady-state ratio, and whether the compiled step keeps the contract (greedy tokens,
sampled tokens for the seed, the largest log-prob difference). It is an experiment, not a
trainer path: measured on the 2-core CPU it does not pay (bench/RESULTS.md).
``--compile-backend eager`` traces without generating code (the smoke test's seconds).

Threads: 1 by default. On a 2-core machine shared with other jobs, 2 OpenMP threads
spin-wait on each other and timings swing 5-10x from run to run; one thread is slower
but stable. ``--threads 0`` uses torch's default.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager

import numpy as np
import torch
from PIL import Image

from grpo.model.load import ModelBundle, load_bundle
from grpo.model.prompts import encode_prompts
from grpo.rollout import decoder
from grpo.rollout.sampler import sample, stop_token_ids

MID_TEXT = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                num_key_value_heads=2, initializer_range=0.02)
MID_VISION = dict(depth=8, hidden_size=384, intermediate_size=1024, num_heads=6, fullatt_block_indexes=[3, 7],
                  window_size=112, out_hidden_size=768, initializer_range=0.02)
QUESTIONS = ["How many red circles are there?", "What is the sum of the numbers in column 2?",
             "How many bars are taller than 5?", "What is the total number of shapes in the picture?"]


def mid_bundle(tiny: ModelBundle, image_size: int) -> ModelBundle:
    """A ~90M-parameter random Qwen2.5-VL sharing the tiny tokenizer (vocabulary 1024)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from grpo.model.tiny import tiny_image_processor

    t = tiny.model.config
    text = dict(t.text_config.to_dict(), **MID_TEXT, layer_types=None, head_dim=None)
    text["rope_parameters"] = dict(text["rope_parameters"], mrope_section=[8, 12, 12])  # head_dim 64
    vision = dict(t.vision_config.to_dict(), **MID_VISION)
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=t.image_token_id,
                           video_token_id=t.video_token_id, vision_start_token_id=t.vision_start_token_id,
                           vision_end_token_id=t.vision_end_token_id)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    return ModelBundle(model=model, tokenizer=tiny.tokenizer, image_processor=tiny_image_processor(image_size),
                       source="mid")


def images(n: int, size: int) -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(n)]


def run_ours(bundle, prompts, args) -> int:
    out = sample(bundle, prompts, G=args.G, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                 top_k=args.top_k, top_p=args.top_p, seed=0)
    return int(out.completion_mask.sum())


@torch.no_grad()
def run_generate(bundle, prompts, args) -> int:
    G = args.G
    inputs = prompts.repeated(G)  # every prompt and its images G times: the TRL way
    stops = stop_token_ids(bundle)
    torch.manual_seed(0)
    out = bundle.model.generate(**inputs, do_sample=True, temperature=args.temperature, top_k=args.top_k or None,
                                top_p=args.top_p, max_new_tokens=args.max_new_tokens, eos_token_id=stops,
                                pad_token_id=bundle.pad_token_id)
    new = out[:, prompts.input_ids.shape[1]:]
    # Count tokens up to and including the first stop token, as for ours.
    is_stop = torch.isin(new, torch.tensor(stops))
    before_stop = (is_stop.long().cumsum(1) - is_stop.long()) == 0
    return int(before_stop.sum())


def timed_pair(fns: dict, warmups: dict, repeats: int) -> dict[str, tuple[float, int]]:
    """{name: (median seconds, tokens)}; runs alternate between the sides so that load
    changes on a shared machine hit both alike. One small warm-up run each first."""
    for w in warmups.values():
        w()
    times: dict[str, list[float]] = {k: [] for k in fns}
    tokens: dict[str, int] = {}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            tokens[name] = fn()
            times[name].append(time.perf_counter() - t0)
    return {k: (statistics.median(v), tokens[k]) for k, v in times.items()}


def bench_one(name: str, bundle: ModelBundle, image_size: int, args) -> float:
    """Time both samplers on one model; prints a table row, returns ours/generate tokens/s."""
    prompts = encode_prompts(bundle, (images(args.B, image_size), [QUESTIONS[i % 4] for i in range(args.B)]))
    n_params = sum(p.numel() for p in bundle.model.parameters())
    vis = int(prompts.n_image_tokens[0])
    # Warm-up: one prompt, G=1, 2 tokens (first-call costs without a full-size run).
    one = encode_prompts(bundle, (images(1, image_size), QUESTIONS[:1]))
    small = argparse.Namespace(**{**vars(args), "G": 1, "max_new_tokens": 2})
    res = timed_pair({"generate": lambda: run_generate(bundle, prompts, args),
                      "ours": lambda: run_ours(bundle, prompts, args)},
                     {"generate": lambda: run_generate(bundle, one, small),
                      "ours": lambda: run_ours(bundle, one, small)},
                     args.repeats)
    (t_gen, n_gen), (t_ours, n_ours) = res["generate"], res["ours"]
    print(f"{name:>5} {n_params / 1e6:7.1f}M {image_size:4d}px {vis:4d} vis {prompts.input_ids.shape[1]:4d} prompt | "
          f"generate {t_gen * 1e3:8.0f} ms {n_gen / t_gen:8.1f} tok/s | ours {t_ours * 1e3:8.0f} ms "
          f"{n_ours / t_ours:8.1f} tok/s | speed-up {(n_ours / t_ours) / (n_gen / t_gen):5.2f}x")
    return (n_ours / t_ours) / (n_gen / t_gen)


@contextmanager
def decode_step_as(step):
    """The sampler's static decode step replaced by ``step`` inside the block
    (decode_one_token looks it up on the module at every call)."""
    eager, decoder.decode_step = decoder.decode_step, step
    try:
        yield
    finally:
        decoder.decode_step = eager


def bench_compile(name: str, bundle: ModelBundle, image_size: int, args) -> float:
    """Our sampler with the eager and the compiled decode step, alternated; prints a row and the
    contract check, returns compiled/eager tokens/s."""
    prompts = encode_prompts(bundle, (images(args.B, image_size), [QUESTIONS[i % 4] for i in range(args.B)]))
    greedy = argparse.Namespace(**{**vars(args), "temperature": 0.0})
    eager = decoder.decode_step
    compiled = torch.compile(eager, backend=args.compile_backend, dynamic=True)

    def draw(a, step):
        with decode_step_as(step):
            return sample(bundle, prompts, G=a.G, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                          top_k=a.top_k, top_p=a.top_p, seed=0)

    ref_greedy, ref = draw(greedy, eager), draw(args, eager)
    t0 = time.perf_counter()
    got_greedy = draw(greedy, compiled)  # the first call compiles
    t_compile = time.perf_counter() - t0
    got = draw(args, compiled)
    res = timed_pair({"eager": lambda: int(draw(args, eager).completion_mask.sum()),
                      "compiled": lambda: int(draw(args, compiled).completion_mask.sum())}, {}, args.repeats)
    (t_e, n_e), (t_c, n_c) = res["eager"], res["compiled"]
    same_shape = got.logprobs.shape == ref.logprobs.shape
    dlogp = float((got.logprobs - ref.logprobs).abs().max()) if same_shape else float("nan")
    print(f"{name:>5} compile: first call {t_compile:6.1f} s | eager {t_e * 1e3:8.0f} ms {n_e / t_e:8.1f} tok/s | "
          f"compiled {t_c * 1e3:8.0f} ms {n_c / t_c:8.1f} tok/s | speed-up {(n_c / t_c) / (n_e / t_e):5.2f}x")
    same_greedy = torch.equal(got_greedy.completion_ids, ref_greedy.completion_ids)
    print(f"{name:>5} compile: greedy tokens equal {same_greedy}, "
          f"sampled tokens equal {torch.equal(got.completion_ids, ref.completion_ids)}, max |logp diff| {dlogp:.2e}")
    return (n_c / t_c) / (n_e / t_e)


def main(argv: list[str] | None = None) -> None:
    head, _, rest = __doc__.partition("\n\n")
    p = argparse.ArgumentParser(prog="python -m bench.sampler", description=head, epilog=rest,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["tiny", "mid", "both"], default="both", help="which model(s) to time")
    p.add_argument("--B", type=int, default=4, help="prompts per batch (tiny)")
    p.add_argument("--G", type=int, default=8, help="completions per prompt (group size)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="completion budget (tiny)")
    p.add_argument("--mid-B", type=int, default=2, help="prompts per batch (mid)")
    p.add_argument("--mid-max-new-tokens", type=int, default=32, help="completion budget (mid)")
    p.add_argument("--image-size", type=int, default=336, help="image side in px for the mid model (tiny: 112)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per side, median (tiny)")
    p.add_argument("--mid-repeats", type=int, default=2, help="timed runs per side, median (mid)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--compile", action="store_true", help="also time our decode step under torch.compile")
    p.add_argument("--compile-backend", default="inductor", choices=["inductor", "aot_eager", "eager"],
                   help="torch.compile backend (eager: trace only)")
    args = p.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"device {device}, {torch.get_num_threads()} threads; G={args.G} T={args.temperature} "
          f"top_k={args.top_k} top_p={args.top_p}; tiny B={args.B} max_new_tokens={args.max_new_tokens}, "
          f"mid B={args.mid_B} max_new_tokens={args.mid_max_new_tokens}")
    tiny = load_bundle("tiny", device=device)
    ratios, compiled = {}, {}
    if args.model in ("tiny", "both"):
        ratios["tiny"] = bench_one("tiny", tiny, 112, args)
        if args.compile:
            compiled["tiny"] = bench_compile("tiny", tiny, 112, args)
    if args.model in ("mid", "both"):
        mid = mid_bundle(tiny, args.image_size)
        mid.model.to(device)
        mid_args = argparse.Namespace(**{**vars(args), "B": args.mid_B, "max_new_tokens": args.mid_max_new_tokens,
                                       "repeats": args.mid_repeats})
        ratios["mid"] = bench_one("mid", mid, args.image_size, mid_args)
        if args.compile:
            compiled["mid"] = bench_compile("mid", mid, args.image_size, mid_args)
    if device == "cuda":
        print(f"peak CUDA memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    else:
        import resource

        print(f"peak process RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")
    print("summary: ours vs generate on repeated prompts, G=%d: %s" %
          (args.G, ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items())))
    if compiled:
        print("summary: torch.compile'd decode step vs eager (%s): %s" %
              (args.compile_backend, ", ".join(f"{k} {v:.2f}x" for k, v in compiled.items())))


if __name__ == "__main__":
    main()

"""``python -m grpo.evaluate``: evaluate checkpoints (or completions made elsewhere) under one protocol.

``python -m grpo.evaluate`` is the evaluation CLI (``--help`` lists every option):

    python -m grpo.evaluate base A:best_structure B:best_composite --run-dir runs/tiny --out reports/
    python -m grpo.evaluate --data path/to/MathVista --completions mine=completions.jsonl

The second form scores completions produced elsewhere (JSONL lines
{"pid": ..., "completions": [...], "token_counts": [...]}) under the same metrics.
With ``--run-dir`` on a run that trained on own data, prompts whose pid is among its training
rows are counted and named in one warning line (``warn_contamination``): an own-data run's
report holds its test rows out itself (data/holdout.py), so evaluating on a given set is
where training rows can come back.

Evaluating a model (sampling, then scoring with eval/) is grpo/evaluation/model_eval.py; this is the
command around it: checkpoint selectors, data sources, reports.

grpo.model.load / grpo.model.policy / grpo.state.registry are called through their modules
(``grpo.model.load.load_bundle``), not through bound names, so a test can swap one for a fake.
"""

from __future__ import annotations

if __name__ == "__main__":  # before torch and transformers load: a release out of range is one line
    from grpo.deps import exit_on_unsupported_stack

    exit_on_unsupported_stack()

import argparse
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from transformers.utils import logging as hf_logging

import grpo.model.load
import grpo.model.policy
import grpo.state.registry
from data.holdout import shared_pids
from data.rows import MAX_IMAGES
from eval.inputs import load_examples, read_completions
from eval.report import control_summary, write_report
from eval.results import EvalProtocol, EvalResult, evaluate_completions
from grpo.errors import ConfigError, inside, one_line
from grpo.evaluation.model_eval import evaluate_model
from grpo.model.load import ModelLoadError
from grpo.overrides import from_json
from grpo.run.phase_data import load_own_data
from grpo.state.layout import CheckpointError
from grpo_infra.signals import StopNow, exit_code, signal_name, signals_held, stops_at_once

# ----------------------------------------------------------------------------- CLI


def _checkpoint_bundle(selector: str, args: argparse.Namespace) -> Any:
    """Rebuild a checkpoint's policy with the trainer's own builder (base chain, 4-bit, LoRA), read
    safely while a trainer saves into the run directory (grpo.state.registry.read_resolved)."""
    _, bundle = grpo.state.registry.read_resolved(
        args.run_dir, selector, lambda path: grpo.model.policy.load_policy(path, run_dir=args.run_dir,
                                                                          device=args.device))
    return bundle


def _resolve_selector(selector: str, args: argparse.Namespace) -> Path | None:
    """None for 'base'; else the checkpoint directory from grpo.state.registry.resolve.

    resolve() raises SelectorError (a ValueError) listing the phases, steps and aliases
    the run holds when the selector names nothing; main() prints it as it is.
    """
    if selector == "base":
        return None
    if not args.run_dir:
        raise ValueError(f"selector {selector!r} needs --run-dir (the training run that holds its checkpoints)")
    # a damaged checkpoint: CheckpointError, exit 1 in main(); one a running trainer's save moved: read again
    return grpo.state.registry.read_resolved(args.run_dir, selector, lambda path: path)[0]


def _selector_bundle(selector: str, args: argparse.Namespace) -> Any:
    """'base' -> the base model; a checkpoint selector -> that checkpoint's policy."""
    try:
        if selector == "base":  # _prepare checked the others (ValueError without --run-dir)
            bundle = grpo.model.load.load_bundle(args.model, device=args.device)
        else:
            bundle = _checkpoint_bundle(selector, args)
        # 0 keeps each model's own bounds: the processor config for 'base', the training config for a checkpoint
        return grpo.model.load.set_input_bounds(bundle, args.max_pixels, args.min_pixels,
                                                args.max_prompt_tokens or None)
    except ModelLoadError as err:
        raise ModelLoadError(f"{selector}: {err}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m grpo.evaluate",
        description="Evaluate the base model and checkpoints under one fixed protocol; write Markdown + JSON reports.",
    )
    p.add_argument("selectors", nargs="*", help="'base' and/or checkpoint selectors such as A:best_structure")
    p.add_argument("--run-dir", default=None, help="training run directory the selectors refer to")
    p.add_argument("--model", default="tiny", help="base model: 'tiny', a local directory or a hub id")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    p.add_argument("--data", default="synthetic",
                   help="'synthetic', a JSONL dataset dir (data/jsonl.py), a MathVista parquet/dir, or hub:AI4Math/MathVista")
    p.add_argument("--split", default="testmini", help="MathVista split (testmini has gold answers; test does not)")
    p.add_argument("--subset", default="eval_overall_numeric", choices=("eval_overall_numeric", "all"))
    p.add_argument("--limit", type=int, default=None, help="evaluate at most this many prompts")
    p.add_argument("--image-size", type=int, default=112, help="synthetic data: image side in pixels")
    p.add_argument("--max-pixels", type=int, default=0,
                   help="largest image area in pixels (Qwen's max_pixels); 0 = the model's own: the processor config "
                        "for 'base', the training config for a checkpoint")
    p.add_argument("--min-pixels", type=int, default=0,
                   help="smallest image area in pixels (Qwen's min_pixels); 0 = the model's own")
    p.add_argument("--max-prompt-tokens", type=int, default=0,
                   help="skip prompts longer than this (visual tokens included; counted as sampler_skipped); "
                        "0 = the model's own")
    p.add_argument("--max-images", type=int, default=MAX_IMAGES,
                   help="a dataset directory: the most images one row's `images` list may show (the trainer's "
                        "--data.max_images); a row with more is skipped and counted as too_many_images")
    p.add_argument("--completions", action="append", default=[], metavar="NAME=FILE",
                   help="score pre-generated completions (JSONL) instead of sampling; repeatable")
    p.add_argument("--samples", type=int, default=1, help="completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--no-image-control", dest="image_control", action="store_false",
                   help="skip the second pass with images shuffled across examples (the blind-gap control)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1, as the trainer: more stalled for minutes on shared cores; "
                        "0 = torch's default)")
    p.add_argument("--out", default="reports", help="directory for report.md, report.json, samples")
    p.add_argument("--title", default="Evaluation report")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI. Errors the project raises on purpose are one line on stderr: exit 2 for a
    wrong request (options, data, completions files, selectors, model), exit 1 when a
    checkpoint is damaged or the report cannot be written. Anything else keeps its traceback:
    the ValueError catch covers checking the request and building models, not the scoring.

    Ctrl-C / SIGTERM stop at once (grpo_infra/signals.py ``stops_at_once``): an evaluation not
    yet reported is worth nothing, so there is no step to finish. One line on stderr, exit
    130 / 143, no traceback; the report files are written with the signals held, so a stop
    leaves the previous report or the whole new one, never part of it."""
    args = build_parser().parse_args(argv)
    hf_logging.disable_progress_bar()  # stderr is for the outcome: one line on an error or a stop
    state = {"written": False}
    try:
        with stops_at_once():
            return _main(args, state)
    except StopNow as stop:
        outcome = "the report was written before it" if state["written"] else "no report written"
        print(f"stopped evaluating on {signal_name(stop.signum)}; {outcome}", file=sys.stderr, flush=True)
        return exit_code(stop.signum)


def _main(args: argparse.Namespace, state: dict) -> int:

    def fail(err: BaseException, code: int) -> int:
        print(f"error: {one_line(err)}", file=sys.stderr)
        return code

    try:
        protocol, examples, data_desc, load_skipped, completions = _prepare(args)
    except (ValueError, FileNotFoundError, ImportError, ModelLoadError) as err:  # ConfigError, SelectorError too
        return fail(err, 2)
    except CheckpointError as err:
        return fail(err, 1)
    except OSError as err:
        inputs = [args.data, args.run_dir] + [spec.partition("=")[2] for spec in args.completions]
        if not any(p and inside(err.filename, Path(p)) for p in inputs):
            raise
        return fail(OSError(f"cannot read {err.filename} ({err.strerror})"), 2)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    print(f"evaluating {len(examples)} prompts: {data_desc}")
    if args.run_dir:
        warn_contamination(Path(args.run_dir), examples)
    results: dict[str, EvalResult] = {}
    for name, (texts, counts) in completions.items():
        results[name] = evaluate_completions(examples, texts, counts, protocol.max_new_tokens)
        results[name].control_note = "pre-generated completions: no second pass with shuffled images"
    for selector in args.selectors:
        try:
            bundle = _selector_bundle(selector, args)
        except (ValueError, ModelLoadError) as err:
            return fail(err, 2)
        except CheckpointError as err:
            return fail(err, 1)
        results[selector] = evaluate_model(bundle, examples, protocol)
        print(f"  {selector}: " + ", ".join(f"{k} {v:.3f}" for k, v in results[selector].flat().items() if k != "n"))
        for line in control_summary(selector, results[selector]):
            print(f"    {line}")
    for res in results.values():
        for reason, n in load_skipped.items():  # rows the loader dropped, shown with each model
            res.skipped[f"load:{reason}"] = n
    shown = {**asdict(protocol), "base_model": args.model, "prompts": len(examples)}
    try:
        with signals_held():  # all of the report or none of it; a stop waits the milliseconds this takes
            md, js = write_report(results, shown, Path(args.out), title=args.title, data=data_desc)
            state["written"] = True
    except OSError as err:
        if not inside(err.filename, Path(args.out)):
            raise
        return fail(OSError(f"cannot write the report to {args.out} ({err.strerror}: {err.filename})"), 1)
    print(f"wrote {md} and {js}")
    return 0


def warn_contamination(run_dir: Path, examples: list) -> int:
    """One warning line when evaluation prompts share pids with the own data the run trained on
    (each phase's config_<phase>.json names it; its held-out test rows do not count); returns
    the count. The synthetic curriculum's splits are disjoint by construction: nothing to check."""
    trained, sources = set(), []
    for path in sorted(run_dir.glob("config_*.json")):
        try:
            cfg = from_json(path.read_text(encoding="utf-8"))
        except (ValueError, OSError):
            continue  # not this check's business: the selectors' own loading reports a damaged run
        if cfg.run.data == "synthetic" or cfg.run.data in sources:
            continue
        sources.append(cfg.run.data)
        try:
            trained |= {ex.pid for ex in load_own_data(cfg)[0]}
        except ConfigError as err:
            print(f"warning: cannot check the evaluation prompts against {run_dir}'s training data ({one_line(err)})")
    n = shared_pids(trained, examples)
    if n:
        print(f"warning: {n} of {len(examples)} evaluation prompts have a pid that {run_dir} trained on "
              f"({', '.join(sources)}): their scores are not held-out scores")
    return n


def _prepare(args: argparse.Namespace) -> tuple:
    """Check the whole request before the first (slow) evaluation: protocol, data, selectors, files."""
    if not args.selectors and not args.completions:
        args.selectors = ["base"]
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit {args.limit}: must be >= 1 (leave it out to evaluate every prompt)")
    if args.threads < 0:
        raise ValueError(f"--threads {args.threads}: must be >= 0 (0 = torch's default, 1 = the trainer's)")
    if min(args.max_pixels, args.min_pixels, args.max_prompt_tokens) < 0:
        raise ValueError(f"--max-pixels {args.max_pixels} --min-pixels {args.min_pixels} --max-prompt-tokens "
                         f"{args.max_prompt_tokens}: must be >= 0 (0 = the model's own)")
    if 0 < args.max_pixels < 28 * 28 or (args.max_pixels and args.min_pixels > args.max_pixels):
        raise ValueError(f"--max-pixels {args.max_pixels}: must be >= 784 (one 28x28 visual token) and >= "
                         f"--min-pixels {args.min_pixels}")
    if args.max_images < 1:
        raise ValueError(f"--max-images {args.max_images}: must be >= 1 (the most images one row may show)")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        raise ValueError(f"--device {args.device!r}: use cpu, cuda or cuda:N")
    if args.selectors and "base" in args.selectors:
        grpo.model.load.check_model_source(args.model)  # a typo in --model fails before the data is loaded
    protocol = EvalProtocol(
        samples_per_prompt=args.samples, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, seed=args.seed, batch_size=args.batch_size,
        image_control=args.image_control,
    ).validate()
    for spec in args.completions:
        name, _, path = spec.partition("=")
        if not name or not path:
            raise ValueError(f"--completions {spec!r}: write NAME=FILE.jsonl")
    examples, data_desc, load_skipped = load_examples(args)
    if not examples:
        lost = ", ".join(f"{k} {v}" for k, v in load_skipped.items())
        raise ValueError(f"no examples to evaluate in {data_desc}" + (f" ({lost} skipped)" if lost else ""))
    for selector in args.selectors:  # a typo fails now, not after the first model's evaluation
        _resolve_selector(selector, args)
    completions = {}
    for spec in args.completions:  # every file is read and checked before any is scored
        name, _, path = spec.partition("=")
        completions[name] = read_completions(path, examples)
    return protocol, examples, data_desc, load_skipped, completions


if __name__ == "__main__":
    raise SystemExit(main())

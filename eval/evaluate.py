"""Evaluation engine: one protocol, many models, one report.

Two entry points share every line that turns text into numbers:

    evaluate_completions(examples, completions, token_counts, max_new_tokens) -> EvalResult
        pure Python over texts: per-completion metrics (eval/metrics.py), aggregates with
        95% intervals, Structure / Correctness / Composite (eval/scores.py), the failure-
        mode breakdown, and the same again on each curriculum stage subset.
    evaluate_model(bundle, examples, protocol) -> EvalResult
        samples completions with grpo.sampler under an EvalProtocol, then calls the above.

The trainer's checkpoint-side eval (which feeds the controller gates) calls these same
functions, so a gate and a final report can never disagree about what "parseable" means.

Comparing models fairly means changing nothing but the weights: an ``EvalProtocol`` fixes
the prompts (the example list), sampling settings, seed, token budget and samples per
prompt, and the report prints it next to the numbers. The staged paper's final protocol
was one sample per prompt on its 456-row subset; that is the default here (greedy).

Rows that cannot be scored are skipped and counted (``EvalResult.skipped``), never a
crash: a gold answer that is not a number, a prompt with no completions, an image the
sampler could not encode.

CLI (``python -m eval``; ``python -m eval --help`` lists every option):

    python -m eval base A:best_structure B:best_composite --run-dir runs/tiny --out reports/
    python -m eval --data path/to/MathVista --completions mine=completions.jsonl

The second form scores completions produced elsewhere (JSONL lines
{"pid": ..., "completions": [...], "token_counts": [...]}) under the same metrics.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from data.contract import normalize_number
from data.schema import Example
from data.stages import stage_filter
from eval.blind import BlindGap, ControlUnavailable, blind_gap, shuffle_images
from eval.metrics import CompletionMetrics, Summary, completion_metrics, mean_interval, summarize
from eval.scores import SCORE_KEYS, SCORE_WEIGHTS, all_scores

STAGES = (1, 2, 3)


@dataclass(frozen=True)
class EvalProtocol:
    """Everything that must be identical across the models of one comparison."""

    samples_per_prompt: int = 1
    """Completions per prompt (the paper's final eval: 1). Rates average over all of them."""
    max_new_tokens: int = 48
    """L: the completion budget; truncation is tok >= L without a complete answer."""
    temperature: float = 0.0
    """0 = greedy decoding; > 0 samples at that temperature."""
    top_k: int = 0
    """Keep the k most likely tokens when sampling (0 = off)."""
    top_p: float = 1.0
    """Nucleus mass when sampling (1.0 = off)."""
    seed: int = 0
    """Seed of the sampler's generator (same seed + same model -> same completions)."""
    batch_size: int = 8
    """Prompts per sampler call. Part of the protocol when sampling: each batch has its
    own generator seeded by seed + batch start, so a different batch size draws differently."""
    image_control: bool = True
    """Also score every prompt with another example's image (eval/blind.py) and report the
    blind gap EM(true) - EM(shuffled) with its interval. Doubles the sampling time."""

    def validate(self) -> EvalProtocol:
        checks = [
            (self.samples_per_prompt >= 1, f"samples_per_prompt={self.samples_per_prompt}: must be >= 1"),
            (self.max_new_tokens >= 1, f"max_new_tokens={self.max_new_tokens}: must be >= 1"),
            (math.isfinite(self.temperature) and self.temperature >= 0,
             f"temperature={self.temperature}: must be a finite number >= 0 (0 = greedy)"),
            (self.top_k >= 0, f"top_k={self.top_k}: must be >= 0 (0 = off)"),
            (0 < self.top_p <= 1, f"top_p={self.top_p}: must be in (0, 1]"),
            (self.batch_size >= 1, f"batch_size={self.batch_size}: must be >= 1"),
            (self.temperature > 0 or self.samples_per_prompt == 1,
             f"samples_per_prompt={self.samples_per_prompt} with greedy decoding gives identical copies; "
             "set temperature > 0 or samples_per_prompt 1"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"EvalProtocol: {msg}")
        return self


@dataclass
class SubsetResult:
    """Metrics, scores, intervals and failure modes of one subset (overall or a stage)."""

    n_prompts: int
    n_completions: int
    metrics: dict[str, float]
    scores: dict[str, float]
    intervals: dict[str, tuple[float, float]]  # 95%, for every metric and score key
    failure_modes: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["intervals"] = {k: list(v) for k, v in self.intervals.items()}
        return d


@dataclass
class EvalResult:
    """What an evaluation returns: the overall subset, each stage subset, what was skipped."""

    overall: SubsetResult
    stages: dict[str, SubsetResult]  # "stage1", "stage2", "stage3"
    skipped: dict[str, int]  # reason -> rows not scored
    records: list[dict[str, Any]] = field(default_factory=list)  # one per completion
    # The shuffled-image control (eval/blind.py): "overall", "stage1".. -> BlindGap, or
    # None with control_note saying why there is none (pre-generated completions, n < 2).
    control: dict[str, BlindGap] | None = None
    control_note: str | None = None

    @property
    def blind_gap(self) -> BlindGap | None:
        return None if self.control is None else self.control["overall"]

    @property
    def metrics(self) -> dict[str, float]:
        return self.overall.metrics

    @property
    def scores(self) -> dict[str, float]:
        return self.overall.scores

    def flat(self) -> dict[str, float]:
        """Overall metrics and scores in one dict: the trainer's "eval" log line and the gates."""
        flat = {**self.overall.metrics, **self.overall.scores, "n": float(self.overall.n_prompts)}
        if self.blind_gap is not None:
            g = self.blind_gap
            flat.update(exact_match_shuffled=g.exact_match_shuffled, blind_gap=g.gap,
                        blind_gap_lo=g.lo, blind_gap_hi=g.hi)
        return flat

    def to_dict(self, with_records: bool = False) -> dict[str, Any]:
        d = {
            "overall": self.overall.to_dict(),
            "stages": {k: v.to_dict() for k, v in self.stages.items()},
            "skipped": dict(self.skipped),
            "control": None if self.control is None else {k: v.to_dict() for k, v in self.control.items()},
            "control_note": self.control_note,
        }
        if with_records:
            d["records"] = self.records
        return d


# ----------------------------------------------------------------------------- text -> EvalResult


def _subset_result(groups: Sequence[Sequence[CompletionMetrics]]) -> SubsetResult:
    summary: Summary = summarize(groups)
    groups = [g for g in groups if g]
    scores = all_scores(summary.metrics) if summary.n_completions else {k: math.nan for k in SCORE_KEYS}
    intervals = dict(summary.intervals)
    # Scores are linear in the rates, so a score = the mean of per-completion scores: its
    # interval is the normal interval of per-prompt mean scores (see eval/scores.py).
    per_completion = [[all_scores(c.as_rates()) for c in g] for g in groups]
    for key in SCORE_KEYS:
        w = SCORE_WEIGHTS[key].values()  # a score lies in [sum of negative, sum of positive weights]
        intervals[key] = mean_interval([sum(s[key] for s in g) / len(g) for g in per_completion],
                                       lo=sum(x for x in w if x < 0), hi=sum(x for x in w if x > 0))
    return SubsetResult(
        n_prompts=summary.n_prompts,
        n_completions=summary.n_completions,
        metrics=summary.metrics,
        scores=scores,
        intervals=intervals,
        failure_modes=summary.failure_modes,
    )


def _check_shapes(examples: Sequence[Example], completions: Sequence[Sequence[str]], token_counts) -> None:
    if len(completions) != len(examples) or len(token_counts) != len(examples):
        raise ValueError(
            f"evaluate_completions: {len(examples)} examples but {len(completions)} completion lists and "
            f"{len(token_counts)} token-count lists; pass one list of each per example"
        )
    for i, (texts, counts) in enumerate(zip(completions, token_counts)):
        if len(texts) != len(counts):
            raise ValueError(
                f"evaluate_completions: example {i} (pid {examples[i].pid}) has {len(texts)} completions but "
                f"{len(counts)} token counts; count every completion with the tokenizer that produced it"
            )


def evaluate_completions(
    examples: Sequence[Example],
    completions: Sequence[Sequence[str]],
    token_counts: Sequence[Sequence[int]],
    max_new_tokens: int,
) -> EvalResult:
    """Score completions[i][j] (with token_counts[i][j]) against examples[i]."""
    _check_shapes(examples, completions, token_counts)
    predicates = {s: stage_filter(s) for s in STAGES}  # the curriculum's own filters (overlapping)
    skipped: dict[str, int] = {}
    overall: list[list[CompletionMetrics]] = []
    by_stage: dict[int, list[list[CompletionMetrics]]] = {s: [] for s in STAGES}
    records: list[dict[str, Any]] = []
    for ex, texts, counts in zip(examples, completions, token_counts):
        if normalize_number(ex.answer) is None:
            skipped["no_numeric_gold"] = skipped.get("no_numeric_gold", 0) + 1
            continue
        if not texts:
            skipped["no_completions"] = skipped.get("no_completions", 0) + 1
            continue
        group = [completion_metrics(t, ex.answer, ex.precision, int(n), max_new_tokens) for t, n in zip(texts, counts)]
        stages = [s for s in STAGES if predicates[s](ex)]
        overall.append(group)
        for s in stages:
            by_stage[s].append(group)
        for j, (text, cm) in enumerate(zip(texts, group)):
            records.append({"pid": ex.pid, "sample": j, "gold": ex.answer, "stages": stages, "text": text, **cm.to_dict()})
    return EvalResult(
        overall=_subset_result(overall),
        stages={f"stage{s}": _subset_result(by_stage[s]) for s in STAGES},
        skipped=skipped,
        records=records,
    )


# ----------------------------------------------------------------------------- model -> EvalResult


def _content_tokens(out: Any) -> list[int]:
    """Completion tokens without the stop token: a row that stopped after L-1 tokens did
    not hit the budget, one that produced L tokens without stopping did."""
    return (out.lengths - out.finished.long()).tolist()


Completions = tuple[list[list[str]], list[list[int]]]  # texts and content-token counts per example


def evaluate_model(bundle: Any, examples: Sequence[Example], protocol: EvalProtocol,
                   sample_pass: Callable[[Any, Sequence[Example], EvalProtocol], Completions] | None = None,
                   ) -> EvalResult:
    """Sample ``protocol.samples_per_prompt`` completions per example and score them.

    With ``protocol.image_control`` the same prompts are sampled again with shuffled
    images (eval/blind.py) and ``result.control`` holds the blind gap overall and per
    stage. ``sample_pass`` replaces the one-process pass (``sample_completions``): the
    data-parallel trainer passes one that splits the prompts over ranks and gathers.
    """
    protocol.validate()
    sample_pass = sample_pass or sample_completions
    result = _score(examples, sample_pass(bundle, examples, protocol), protocol)
    if protocol.image_control:
        try:
            shuffled = shuffle_images(examples)
        except ControlUnavailable as err:
            result.control_note = str(err)
            return result
        control = _score(shuffled, sample_pass(bundle, shuffled, protocol), protocol)
        stage_pids = {f"stage{s}": {r["pid"] for r in result.records if s in r["stages"]} for s in STAGES}
        result.control = {"overall": blind_gap(result.records, control.records),
                          **{k: blind_gap(result.records, control.records, pids) for k, pids in stage_pids.items()}}
    return result


def _score(examples: Sequence[Example], completions: Completions, protocol: EvalProtocol) -> EvalResult:
    result = evaluate_completions(examples, *completions, protocol.max_new_tokens)
    lost = result.skipped.pop("no_completions", 0)
    if lost:  # an example whose image the processor could not encode got no completions
        result.skipped["sampler_skipped"] = lost
    return result


def sample_completions(bundle: Any, examples: Sequence[Example], protocol: EvalProtocol) -> Completions:
    """One sampling pass over ``examples`` with grpo.sampler: texts and token counts per example.

    grpo is imported here, not at module top: eval/ sits below grpo/ in the layer order and
    must stay importable (and testable) without a model. An example whose image the
    processor cannot encode gets no completions.
    """
    from grpo.model import encode_prompts  # lazy: see docstring
    from grpo.sampler import sample

    G = protocol.samples_per_prompt
    completions: list[list[str]] = [[] for _ in examples]
    token_counts: list[list[int]] = [[] for _ in examples]
    for start in range(0, len(examples), protocol.batch_size):
        batch = list(examples[start : start + protocol.batch_size])
        try:
            prompts = encode_prompts(bundle, batch, on_bad_image="skip").to(bundle.device)
        except ValueError:  # every image of the batch failed: all of them stay empty
            continue
        # One generator per batch, seeded from the protocol seed and the batch's position:
        # the same protocol (batch_size included) always draws the same completions.
        out = sample(bundle, prompts, G=G, max_new_tokens=protocol.max_new_tokens,
                     temperature=protocol.temperature, top_k=protocol.top_k, top_p=protocol.top_p,
                     seed=protocol.seed + start)
        ntok = _content_tokens(out)
        for n, text in enumerate(out.texts):  # row n belongs to kept prompt n // G
            i = start + prompts.kept[n // G]
            completions[i].append(text)
            token_counts[i].append(int(ntok[n]))
    return completions, token_counts


# ----------------------------------------------------------------------------- CLI


def _load_examples(args: argparse.Namespace) -> tuple[list[Example], str, dict[str, int]]:
    """The evaluation prompts named by --data / --split / --subset / --limit."""
    if args.data == "synthetic":
        from data.synthetic import generate

        per_stage = max(1, args.limit // len(STAGES)) if args.limit else 100
        examples = [ex for s in STAGES for ex in generate("test", s, per_stage, args.seed, args.image_size)]
        return examples, f"synthetic test split, {per_stage} per stage, seed {args.seed}", {}
    from data.mathvista import eval_overall_numeric, is_overall_numeric, load_mathvista

    if (Path(args.data) / "data.jsonl").is_file():  # a dataset written by data/jsonl.py
        from data.jsonl import load_jsonl

        examples, skipped = load_jsonl(args.data, return_skipped=True)
        if args.subset == "eval_overall_numeric":
            examples = eval_overall_numeric(examples)
        return examples[: args.limit], f"JSONL dataset {args.data} ({args.subset})", skipped

    where = is_overall_numeric if args.subset == "eval_overall_numeric" else None
    examples, skipped = load_mathvista(args.data, args.split, where=where, limit=args.limit)
    if args.subset == "eval_overall_numeric":
        examples = eval_overall_numeric(examples)
    return examples, f"MathVista {args.split} ({args.subset}) from {args.data}", skipped


def _read_completions(path: str, examples: list[Example]) -> tuple[list[list[str]], list[list[int]]]:
    """JSONL {"pid", "completions", "token_counts"} aligned to the examples (missing pid -> []).

    Every row is checked: a row without completions, a string where the list belongs, or
    token counts that do not pair one-to-one with the completions would otherwise be scored
    as an empty or misaligned group without a word.
    """
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text (byte {err.start}: {err.reason})") from None
    shape = 'write one JSON object per line: {"pid": ..., "completions": ["..."], "token_counts": [n]}'
    by_pid: dict[str, dict[str, Any]] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not JSON ({err.msg}); {shape}") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: a JSON {type(row).__name__}, not an object; {shape}")
        missing = [k for k in ("pid", "completions", "token_counts") if k not in row]
        if missing:
            raise ValueError(f"{where}: lacks {', '.join(missing)}; {shape}")
        pid, texts, counts = row["pid"], row["completions"], row["token_counts"]
        if isinstance(pid, bool) or not isinstance(pid, (str, int)):
            raise ValueError(f"{where}: pid {pid!r} is not a string or integer")
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            kind = "a string" if isinstance(texts, str) else f"{type(texts).__name__}"
            raise ValueError(f"{where}: completions is {kind}, not a list of strings (write [\"...\"])"
                             if not isinstance(texts, list) else f"{where}: completions holds a non-string")
        if not isinstance(counts, list) or any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
            raise ValueError(f"{where}: token_counts must be a list of integers >= 0, got {counts!r}"[:300])
        if len(counts) != len(texts):
            raise ValueError(f"{where}: {len(texts)} completions but {len(counts)} token_counts; give one count "
                             "per completion, from the tokenizer that produced it")
        if str(pid) in by_pid:
            raise ValueError(f"{where}: pid {pid!r} appears twice; give each prompt's completions on one line")
        by_pid[str(pid)] = row
    texts = [list(by_pid.get(ex.pid, {}).get("completions", [])) for ex in examples]
    counts = [list(by_pid.get(ex.pid, {}).get("token_counts", [])) for ex in examples]
    return texts, counts


def _checkpoint_bundle(path: Path, args: argparse.Namespace) -> Any:
    """Rebuild a checkpoint's policy with the trainer's own builder (base chain, 4-bit, LoRA)."""
    from grpo.policy import load_policy  # lazy: eval sits below grpo

    return load_policy(path, run_dir=args.run_dir, device=args.device)


def _resolve_selector(selector: str, args: argparse.Namespace) -> Path | None:
    """None for 'base'; else the checkpoint directory from grpo.checkpoint.resolve.

    resolve() raises SelectorError (a ValueError) listing the phases, steps and aliases
    the run holds when the selector names nothing; main() prints it as it is.
    """
    if selector == "base":
        return None
    if not args.run_dir:
        raise ValueError(f"selector {selector!r} needs --run-dir (the training run that holds its checkpoints)")
    from grpo.checkpoint import resolve  # lazy: eval sits below grpo

    return resolve(args.run_dir, selector)  # a damaged checkpoint: CheckpointError, exit 1 in main()


def _selector_bundle(selector: str, args: argparse.Namespace) -> Any:
    """'base' -> the base model; a checkpoint selector -> that checkpoint's policy."""
    from grpo.model import ModelLoadError, load_bundle

    try:
        path = _resolve_selector(selector, args)
        return load_bundle(args.model, device=args.device) if path is None else _checkpoint_bundle(path, args)
    except ModelLoadError as err:
        raise ModelLoadError(f"{selector}: {err}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m eval",
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
                   help="torch CPU threads (default 1, as the trainer: more stalled for minutes on shared cores; 0 = torch's default)")
    p.add_argument("--out", default="reports", help="directory for report.md, report.json, samples")
    p.add_argument("--title", default="Evaluation report")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI. Errors the project raises on purpose are one line on stderr: exit 2 for a
    wrong request (options, data, completions files, selectors, model), exit 1 when a
    checkpoint is damaged or the report cannot be written. Anything else keeps its traceback:
    the ValueError catch covers checking the request and building models, not the scoring."""
    args = build_parser().parse_args(argv)
    from eval.report import control_summary
    from grpo.checkpoint import CheckpointError  # lazy: eval sits below grpo
    from grpo.model import ModelLoadError

    def fail(err: BaseException, code: int) -> int:
        print(f"error: {_one_line(err)}", file=sys.stderr)
        return code

    try:
        protocol, examples, data_desc, load_skipped, completions = _prepare(args)
    except (ValueError, FileNotFoundError, ImportError, ModelLoadError) as err:  # ConfigError, SelectorError too
        return fail(err, 2)
    except CheckpointError as err:
        return fail(err, 1)
    except OSError as err:
        inputs = [args.data, args.run_dir] + [spec.partition("=")[2] for spec in args.completions]
        if not any(p and _inside(err.filename, Path(p)) for p in inputs):
            raise
        return fail(OSError(f"cannot read {err.filename} ({err.strerror})"), 2)
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    print(f"evaluating {len(examples)} prompts: {data_desc}")
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
    from eval.report import write_report

    shown = {**asdict(protocol), "base_model": args.model, "prompts": len(examples)}
    try:
        md, js = write_report(results, shown, Path(args.out), title=args.title, data=data_desc)
    except OSError as err:
        if not _inside(err.filename, Path(args.out)):
            raise
        return fail(OSError(f"cannot write the report to {args.out} ({err.strerror}: {err.filename})"), 1)
    print(f"wrote {md} and {js}")
    return 0


def _one_line(err: BaseException) -> str:
    return "; ".join(line.strip() for line in str(err).splitlines() if line.strip())


def _inside(filename: object, root: Path) -> bool:
    if not isinstance(filename, (str, bytes)) and not hasattr(filename, "__fspath__"):
        return False
    try:
        path, root = Path(os.fsdecode(filename)).resolve(), root.resolve()
    except (OSError, ValueError):
        return False
    return path == root or path.is_relative_to(root)


def _prepare(args: argparse.Namespace) -> tuple:
    """Check the whole request before the first (slow) evaluation: protocol, data, selectors, files."""
    if not args.selectors and not args.completions:
        args.selectors = ["base"]
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit {args.limit}: must be >= 1 (leave it out to evaluate every prompt)")
    if args.threads < 0:
        raise ValueError(f"--threads {args.threads}: must be >= 0 (0 = torch's default, 1 = the trainer's)")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        raise ValueError(f"--device {args.device!r}: use cpu, cuda or cuda:N")
    if args.selectors and "base" in args.selectors:
        from grpo.model import check_model_source  # lazy: eval sits below grpo

        check_model_source(args.model)  # a typo in --model fails before the data is loaded
    protocol = EvalProtocol(
        samples_per_prompt=args.samples, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, seed=args.seed, batch_size=args.batch_size,
        image_control=args.image_control,
    ).validate()
    for spec in args.completions:
        name, _, path = spec.partition("=")
        if not name or not path:
            raise ValueError(f"--completions {spec!r}: write NAME=FILE.jsonl")
    examples, data_desc, load_skipped = _load_examples(args)
    if not examples:
        lost = ", ".join(f"{k} {v}" for k, v in load_skipped.items())
        raise ValueError(f"no examples to evaluate in {data_desc}" + (f" ({lost} skipped)" if lost else ""))
    for selector in args.selectors:  # a typo fails now, not after the first model's evaluation
        _resolve_selector(selector, args)
    completions = {}
    for spec in args.completions:  # every file is read and checked before any is scored
        name, _, path = spec.partition("=")
        completions[name] = _read_completions(path, examples)
    return protocol, examples, data_desc, load_skipped, completions


if __name__ == "__main__":
    raise SystemExit(main())

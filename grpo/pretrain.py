"""Build the shipped tiny model: ``python -m grpo.pretrain [--out DIR] [--run-dir DIR] [--key value ...]``.

A GRPO run starts from a model someone pretrained; this command is how the embedded
default's model was pretrained, once, offline, on a CPU. It is the trainer's own warm-up
(grpo/warmup/sft.py) with a longer schedule, run on ``tiny-random`` (the architecture with random
weights), then exported as an ordinary ``save_pretrained`` directory:

    1. warm-up     --phase warmup --model.name tiny-random + PRETRAIN below, into --run-dir:
                   3500 caption steps (the image alone -> every quantity it shows), then
                   2500 worked-reasoning steps, x 32 examples, all weights trained, a linear
                   perception head on every visual token throughout; stages 1/2/3 mixed
                   .4/.35/.25 (the RL phases train stage 1 and a little of stage 2: stages 2
                   and 3 get their reading from here). The run directory keeps resumable
                   checkpoints: the same command continues a stopped or killed run. It is
                   held (grpo/run/lock.py) for the whole command: a second pretraining on it
                   is refused, or with --lock-wait waits for the first to end.
    2. evaluate    the result on the held-out test split (greedy, images shuffled as the
                   control), so the card states what the base does before any RL.
    3. export      weights (float32 safetensors), tokenizer, image processor, config, the
                   model card (MODEL_CARD.md), the provenance (pretrain.json) and a sha256
                   manifest of the model files (SHA256SUMS), moved into --out atomically.

Deterministic on one machine (one torch thread, fixed seeds): a rebuild reproduces the model
files byte for byte; other machines may differ in the last bits of float arithmetic. The
warm-up keeps its imperfect contract on purpose (about a third of greedy answers follow it),
so GRPO's phase A still has format to fix.
"""

from __future__ import annotations

if __name__ == "__main__":  # before torch and transformers load: a release out of range is one line
    from grpo.deps import exit_on_unsupported_stack

    exit_on_unsupported_stack()

import argparse
import json
import os
import platform
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

from grpo.model import shipped
from grpo_infra.atomic import new_directory, replace_file

# The pretraining schedule (passed to the trainer's CLI; the card records them). Measured:
# with the 2 x 64 vision tower, 58.8 minutes in all on one core of this project's 2-core machine; with
# today's 4 x 128 tower, 76 and 84.5 minutes in two builds (the shipped build's card has its own time and machine).
PRETRAIN: dict[str, str] = {
    "warmup.phase.perception_steps": "3500",
    "warmup.phase.steps": "2500",
    "warmup.phase.mixture": "1=0.4,2=0.35,3=0.25",
    # (3500 + 2500) x 32 examples over 3 stages: 32000 per stage keeps repeats to ~2 per example
    "run.train_per_stage": "32000",
}
SOURCE_MODEL = "tiny-random"
WALL_FILE = "pretrain_wall.json"  # wall seconds of every invocation, summed over resumes


def _argv(run_dir: str, extra: list[str]) -> list[str]:
    out = ["--phase", "warmup", "--model.name", SOURCE_MODEL, "--run.run_dir", run_dir]
    for key, value in PRETRAIN.items():
        out += [f"--{key}", value]
    return out + extra


def check_same_settings(run_dir: Path, argv: list[str]) -> None:
    """A run directory that already holds a pretraining run must be resumed with exactly the
    settings it was started with (the card states them, and the export would otherwise
    label one schedule's weights with another's). ConfigError names what differs."""
    saved = run_dir / "config_warmup.json"
    if not saved.is_file():
        return
    from grpo.cli import phase_configs
    from grpo.errors import ConfigError
    from grpo.overrides import from_json, parse_override_args

    want = json.loads(phase_configs("warmup", "tiny", parse_override_args(argv[2:]))["warmup"].to_json())
    try:
        have = json.loads(from_json(saved.read_text()).to_json())  # keys added since: their defaults
    except (ValueError, ConfigError) as err:
        raise ConfigError(f"--run-dir {run_dir}: {saved.name} is unreadable ({err}); use another --run-dir") from None
    diffs = [f"{sec}.{k}: {have[sec].get(k)!r} -> {v!r}" for sec in want for k, v in want[sec].items()
             if have.get(sec, {}).get(k) != v and (sec, k) != ("run", "run_dir")]  # a moved directory is the same run
    if diffs:
        raise ConfigError(f"--run-dir {run_dir} holds a pretraining run made with other settings "
                          f"({'; '.join(diffs[:3])}{'; ...' if len(diffs) > 3 else ''}): resume it with the options "
                          "it was started with, or use another --run-dir (nothing was changed)")


def _git_commit() -> str:
    try:
        root = Path(__file__).resolve().parent.parent
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
        return head.stdout.strip() + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.release()}"


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _record_wall(run_dir: Path, seconds: float) -> dict:
    """Add this invocation's wall time and peak memory to the run's record, and return it
    (total_s, peak_rss_mb, train_code_commit: the code of the first invocation)."""
    path = run_dir / WALL_FILE
    saved = json.loads(path.read_text()) if path.is_file() else {}
    spans = saved.get("spans_s", []) + [round(seconds, 1)]
    peak = max(saved.get("peak_rss_mb", 0.0), round(_peak_rss_mb(), 1))
    saved.update(spans_s=spans, total_s=round(sum(spans), 1), peak_rss_mb=peak)
    saved.setdefault("train_code_commit", _git_commit())  # the code of the first invocation: it trained
    replace_file(path, json.dumps(saved, indent=2))  # summed over resumes: a kill mid-write must not lose it
    return saved


def evaluate_base(bundle, seed: int, n_per_stage: int, max_new_tokens: int, image_size: int) -> dict:
    """Greedy test-split metrics of the pretrained model, with the shuffled-image control, on
    figures drawn at ``image_size`` px (the size it was trained on)."""
    from data.synthetic import generate
    from eval.results import EvalProtocol
    from grpo.evaluation.model_eval import evaluate_model

    examples = [ex for s in (1, 2, 3) for ex in generate("test", s, n_per_stage, seed, image_size)]
    protocol = EvalProtocol(max_new_tokens=max_new_tokens, temperature=0.0, seed=seed, batch_size=64)
    result = evaluate_model(bundle, examples, protocol)
    out = {"n": len(examples), "exact_match": result.metrics["exact_match"],
           "parseable_rate": result.metrics["parseable_rate"]}
    if result.control is not None:
        for subset, g in result.control.items():
            out[f"control/{subset}"] = {"n": g.n, "exact_match": g.exact_match,
                                        "exact_match_shuffled": g.exact_match_shuffled,
                                        "blind_gap": g.gap, "interval": [g.lo, g.hi]}
    return out


def export(run_dir: Path, out: Path, wall_s: float, peak_mb: float, test_seed: int, test_per_stage: int,
           train_commit: str = "") -> Path:
    """warmup:latest of ``run_dir`` -> a verified model directory at ``out``."""
    import torch

    from grpo.model.load import load_bundle
    from grpo.model.policy import load_base_weights
    from grpo.overrides import from_json
    from grpo.state.checkpoint import load_checkpoint
    from grpo.state.registry import resolve

    ckpt = load_checkpoint(resolve(run_dir, "warmup:latest"))
    cfg = from_json(ckpt.config_json)
    total = cfg.phase.perception_steps + cfg.phase.steps
    if ckpt.step < total:
        raise shipped.ShippedModelError(f"{run_dir}: the warm-up stopped at step {ckpt.step} of {total}; run the "
                                        "same command again to finish it before exporting")
    torch.manual_seed(cfg.run.seed)
    # the image size and pixel bounds it was trained with: the evaluation sees what training saw, and the
    # exported processor keeps the bounds (without them a base trained on 224 px figures would be scored,
    # and then used, on 112 px ones: the shipped processor's cap)
    bundle = load_bundle(SOURCE_MODEL, seed=cfg.run.seed, max_pixels=cfg.model.max_pixels,
                         min_pixels=cfg.model.min_pixels)
    load_base_weights(bundle.model, ckpt.tensors)
    bundle.model.eval()
    print(f"pretrain: evaluating the base on the test split ({test_per_stage} per stage, seed {test_seed}, greedy, "
          f"{cfg.model.image_size} px, with shuffled images as the control)", flush=True)
    metrics = evaluate_base(bundle, test_seed, test_per_stage, 48, cfg.model.image_size)
    gap = metrics.get("control/overall", {})
    print(f"pretrain: test EM {metrics['exact_match']:.3f}, parseable {metrics['parseable_rate']:.3f}, "
          f"shuffled-image EM {gap.get('exact_match_shuffled', float('nan')):.3f}, "
          f"blind gap {gap.get('blind_gap', float('nan')):+.3f}", flush=True)

    # out is either the old model or the new one, never half of each; a stop leaves no half copy
    with new_directory(out, replace=True) as staging:
        provenance = provenance_of(ckpt, cfg, run_dir, wall_s, peak_mb, metrics, test_seed, test_per_stage,
                                   train_commit, architecture(bundle.model.config, cfg.model.image_size))
        _write_export(bundle, staging, provenance)
        digests = shipped.read_manifest(staging)
    shipped.verify(out)
    print(f"pretrain: model written to {out} (model.safetensors sha256 {digests['model.safetensors'][:16]}...)")
    return out


def architecture(config, image_size: int) -> dict:
    """The built model's sizes as the card states them, read from its own config (not from
    grpo/model/tiny.py, which may have changed since)."""
    t, v = config.text_config, config.vision_config
    side = image_size // v.patch_size // v.spatial_merge_size
    return {"text_layers": t.num_hidden_layers, "text_hidden": t.hidden_size,
            "vision_blocks": v.depth, "vision_hidden": v.hidden_size, "vision_mlp": v.intermediate_size,
            "image_size": image_size, "visual_tokens": side * side}


def provenance_of(ckpt, cfg, run_dir: Path, wall_s: float, peak_mb: float, metrics: dict, test_seed: int,
                  test_per_stage: int, train_commit: str, arch: dict) -> dict:
    """What pretrain.json and the card say about the build."""
    import torch

    return {
        "command": "python -m grpo.pretrain",
        "architecture": arch,
        "trainer_argv": _argv(str(run_dir), []),
        "config": json.loads(ckpt.config_json),
        "steps": {"caption": cfg.phase.perception_steps, "worked_reasoning": cfg.phase.steps,
                  "examples_per_step": cfg.phase.prompts_per_step},
        "data": {"train": f"synthetic curriculum, seed {cfg.run.seed}, {cfg.run.train_per_stage} per stage",
                 "test": f"synthetic test split, seed {test_seed}, {test_per_stage} per stage"},
        "code_commit": {"trained": train_commit or _git_commit(), "exported": _git_commit()},
        "machine": _machine(),
        "torch": torch.__version__,
        "wall_s": round(wall_s, 1),
        "peak_rss_mb": round(max(peak_mb, _peak_rss_mb()), 1),
        "test_metrics": metrics,
    }


def _write_export(bundle, staging: Path, provenance: dict) -> None:
    """The model directory's files: weights, tokenizer, processor, provenance, manifest, card."""
    bundle.model.save_pretrained(staging)
    bundle.tokenizer.save_pretrained(staging)
    bundle.image_processor.save_pretrained(staging)
    for junk in ("vlgrpo_build.json",):  # the random build's marker would make the result "train from scratch"
        (staging / junk).unlink(missing_ok=True)
    (staging / "pretrain.json").write_text(json.dumps(provenance, indent=2) + "\n")
    digests = shipped.write_manifest(staging, exclude=shipped.NOT_MODEL_FILES)
    (staging / "MODEL_CARD.md").write_text(model_card(provenance, digests))


def model_card(p: dict, digests: dict[str, str]) -> str:
    m = p["test_metrics"]
    rows = []
    for subset in ("overall", "stage1", "stage2", "stage3"):
        g = m.get(f"control/{subset}")
        if g:
            rows.append(f"| {subset} | {g['n']} | {g['exact_match']:.3f} | {g['exact_match_shuffled']:.3f} | "
                        f"{g['blind_gap']:+.3f} [{g['interval'][0]:+.3f}, {g['interval'][1]:+.3f}] |")
    cfg, a = p["config"], p["architecture"]
    return f"""# tiny Qwen2.5-VL, pretrained for vlgrpo's embedded default

The real `Qwen2_5_VLForConditionalGeneration` class at toy size (text: {a['text_layers']} layers,
d = {a['text_hidden']}; vision: {a['vision_blocks']} blocks, d = {a['vision_hidden']}, MLP {a['vision_mlp']};
{a['image_size']} px images -> {a['visual_tokens']} visual tokens; a byte-level BPE trained on the
synthetic curriculum's text, asked for 1,024 tokens, as many as its corpus supports: config.json's
vocab_size), trained from random weights on this project's
synthetic visual-numeric curriculum. It reads simple figures (scenes, tables, charts,
grids) and answers in the `<REASONING>...</REASONING><SOLUTION>n</SOLUTION>` contract only
part of the time, on purpose: GRPO's phase A has format to fix.

## How it was built

    {p['command']}

which runs the trainer's warm-up (`python -m grpo.train {' '.join(p['trainer_argv'])}`) and
exports the result. {p['steps']['caption']} caption steps then {p['steps']['worked_reasoning']}
worked-reasoning steps of {p['steps']['examples_per_step']} examples, every weight trained,
lr {cfg['optim']['lr']}, a linear perception head on every merged visual token (weight
{cfg['optim']['perception_weight']}), stage mixture {cfg['phase']['mixture']}.

- training data: {p['data']['train']}
- code: trained with {p['code_commit']['trained']}, exported with {p['code_commit']['exported']}
- machine: {p['machine']}; torch {p['torch']}, one thread
- wall time: {p['wall_s'] / 60:.1f} min; peak memory (resident) {p['peak_rss_mb']:.0f} MB, most of it the
  96,000 training examples' images held in memory
- the full resolved config: `pretrain.json`

## Measured on the held-out test split

{p['data']['test']}; greedy, 48 new tokens, the contract prompt. EM {m['exact_match']:.3f},
parseable {m['parseable_rate']:.3f}. The control swaps each image for another of the same
question family (`eval/blind.py`); the blind gap is EM minus EM with shuffled images, with a
paired 95% interval (the subsets are the stage filters of data/stages.py, which overlap: a
table question counts in stages 1 and 2):

| subset | n | EM | EM, images shuffled | blind gap [95%] |
|---|---|---|---|---|
{chr(10).join(rows)}

What GRPO does from here (phases A and B, 3 seeds, with controls) is in the project README.

## Files and integrity

`SHA256SUMS` lists the model files; `python -m grpo.train` and `--model tiny` check them on
every load and refuse a missing or changed file in one line. Rebuilding with the command
above on the same machine reproduces them byte for byte (one torch thread, fixed seeds);
this card and pretrain.json carry wall times, so they differ between builds and are not in
the manifest.

model.safetensors sha256 {digests['model.safetensors']}
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m grpo.pretrain",
        description="Pretrain the embedded tiny model from random weights (the trainer's warm-up on tiny-random, "
                    "with the schedule below) and export it as the shipped model. Resumable: the same command "
                    "continues a stopped run.",
        epilog="schedule: " + " ".join(f"--{k} {v}" for k, v in PRETRAIN.items())
               + ". Any other trainer option (--key value) is passed through, e.g. --warmup.phase.steps 10 for a "
                 "smoke run into another --out.")
    p.add_argument("--out", default=str(shipped.SHIPPED_DIR),
                   help="the model directory to write (default: the shipped one, grpo/tiny_model)")
    p.add_argument("--run-dir", default="runs/pretrain", help="the warm-up's run directory (checkpoints, log)")
    p.add_argument("--test-per-stage", type=int, default=100, help="test examples per stage for the card (0: none)")
    p.add_argument("--test-seed", type=int, default=0, help="seed of the synthetic test split for the card")
    p.add_argument("--lock-wait", default="0", metavar="SECONDS",
                   help="when another run holds --run-dir, wait up to this long for it to end, then resume (default 0: "
                        "refuse at once, naming that run)")
    return p


def main(argv: list[str] | None = None) -> int:
    """The command: the run directory locked for the whole of it (grpo/run/lock.py: the warm-up,
    the wall-time record and the export's reading of it), then ``_pretrain``."""
    from grpo.cli import lock_wait, make_run_dir
    from grpo.errors import ConfigError, inside, one_line
    from grpo.run.lock import RunDirBusy, acquire
    from grpo.run.stop import Stopped
    from grpo_infra.signals import exit_code

    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        build_parser().print_help()
        return 0
    args, rest = build_parser().parse_known_args(argv)
    if args.test_per_stage < 1:
        print(f"error: --test-per-stage {args.test_per_stage}: must be >= 1 (the card states test metrics)",
              file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir)
    try:  # the trainer's command line takes the same lock again: this process holds it once
        wait_s = lock_wait(args.lock_wait)
        make_run_dir(run_dir)
        lock = acquire(run_dir, wait_s, other="another --run-dir")
    except (ConfigError, RunDirBusy) as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 2
    except Stopped as stop:
        print(stop, file=sys.stderr)
        return exit_code(stop.signum)
    except OSError as err:
        if not inside(err.filename, run_dir):
            raise
        print(f"error: cannot write to the run directory {run_dir} ({err.strerror}: {err.filename}); "
              "fix its permissions, or use another --run-dir", file=sys.stderr)
        return 1
    try:
        return _pretrain(args, rest)
    finally:
        lock.release()


def _pretrain(args: argparse.Namespace, rest: list[str]) -> int:
    """The warm-up (the trainer's command line), the wall-time record, the export."""
    from grpo import cli
    from grpo.errors import ConfigError
    from grpo.model.load import ModelLoadError
    from grpo.train import run_phase

    try:
        check_same_settings(Path(args.run_dir), _argv(args.run_dir, rest))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    t0 = time.time()
    code = cli.main(_argv(args.run_dir, rest), run_phase)
    started = (Path(args.run_dir) / "config_warmup.json").is_file()  # the warm-up ran here (now or before)
    record = _record_wall(Path(args.run_dir), time.time() - t0) if started else {}
    if code != 0:
        return code
    from grpo.run.stop import EvalAbandoned
    from grpo_infra.signals import STOP, exit_code, signal_name

    STOP.install()  # the export's evaluation polls it like every long loop; a stop loses no training
    try:
        export(Path(args.run_dir), Path(args.out), record.get("total_s", 0.0), record.get("peak_rss_mb", 0.0),
               args.test_seed, args.test_per_stage, record.get("train_code_commit", ""))
    except (shipped.ShippedModelError, ModelLoadError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except (EvalAbandoned, KeyboardInterrupt):
        signum = STOP.signum or signal.SIGINT
        print(f"stopped on {signal_name(signum)} while exporting; the pretraining run in {args.run_dir} is complete "
              f"and {args.out} unchanged; the same command exports it again", file=sys.stderr)
        return exit_code(signum)
    finally:
        STOP.uninstall()
    return 0


if __name__ == "__main__":
    sys.exit(main())

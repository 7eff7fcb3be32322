"""``python -m grpo.export``: a trained checkpoint as a PEFT adapter and/or a merged model.

    python -m grpo.export B:latest --run-dir runs/tiny --peft out/adapter --merged out/merged

``--peft OUT``: OUT/adapter_config.json + adapter_model.safetensors (PEFT's LoRA format,
lora/adapter_io.py ``save_adapter``), for ``PeftModel.from_pretrained(base, OUT)``. The
base named in it (base_model_name_or_path) is the un-quantised model the run started from:
the shipped grpo/tiny_model directory for 'tiny', the directory for a local model, the id
for a hub model. A run trained over an NF4 base (the presets' load_in_4bit) trained the
adapter against NF4's rounded weights; over the bf16/fp32 base its outputs move by that
rounding (the QLoRA gap) -- the merged export has no such gap.

``--merged OUT``: a save_pretrained directory (config.json, model.safetensors,
generation_config.json, tokenizer, chat template, preprocessor_config.json) of the policy
with LoRA folded into the dequantised base: W' = dequant(W_nf4) + (alpha / r) B A in fp32,
rounded once to ``--dtype`` (bf16 by default; never folded back into 4-bit, which rounds
the update into 16 levels per block). ``Qwen2_5_VLForConditionalGeneration.from_pretrained``
loads it with no LoRA and no bitsandbytes. The image processor carries the run's image
bounds (model.max_pixels / min_pixels), so inference resizes images as training did.

Both are written to a temporary directory beside OUT and renamed into place at the end
(OUT must not exist or be empty): a failure or a stop leaves no OUT, never half of one.
Ctrl-C / SIGTERM stop at once with one line and exit 130 / 143 (grpo_infra/signals.py): there is
no step to finish, the temporary directory is removed.

The selector is grpo.evaluate's (``A:best_structure``, ``B:latest``, ``B:40``, a checkpoint
directory), resolved by the same function. A checkpoint whose adapter was trained on a base
checkpoint (the full-weight warm-up of a from-scratch model, --model.name tiny-random) has
no model directory or hub id to name as its PEFT base: ``--peft`` is refused for it and
``--merged`` (which carries the whole model) is the export.

LoRA in the vision tower and merger (lora.vision / lora.merger) goes out with the rest: the
PEFT config's target regex names every adapted layer, tower and merger included, and the merge
folds each LoRALinear wherever it sits.
"""

from __future__ import annotations

if __name__ == "__main__":  # before torch and transformers load: a release out of range is one line
    from grpo.deps import exit_on_unsupported_stack

    exit_on_unsupported_stack()

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

import grpo.evaluation.evaluate
import grpo.model.policy
import grpo.state.registry
from grpo.errors import inside, one_line
from grpo.model.load import ModelLoadError
from grpo.state.layout import CheckpointError
from grpo_infra.atomic import new_directory
from grpo_infra.signals import StopNow, exit_code, signal_name, stops_at_once

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class ExportError(ValueError):
    """The request cannot be exported as asked; the message says what to change."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m grpo.export",
        description="Export a trained checkpoint as a PEFT LoRA adapter (--peft) and/or a merged "
                    "save_pretrained model (--merged); both may be given at once.",
        epilog="--peft OUT: adapter_config.json + adapter_model.safetensors for PeftModel.from_pretrained over "
               "the base model named in it (the un-quantised base; an NF4-trained adapter over it differs by "
               "the 4-bit rounding). --merged OUT: LoRA folded into the dequantised base, in --dtype, with the "
               "tokenizer and image processor; loads with Qwen2_5_VLForConditionalGeneration.from_pretrained. "
               "OUT must not exist (or be empty); it appears only when complete.",
    )
    p.add_argument("selector", help="checkpoint: PHASE[:ALIAS|STEP] such as B:latest, A:best_structure, B:40, "
                                    "or a checkpoint directory")
    p.add_argument("--run-dir", default=None, help="training run directory the selector refers to")
    p.add_argument("--peft", default=None, metavar="OUT", help="write a PEFT adapter directory here")
    p.add_argument("--merged", default=None, metavar="OUT", help="write a merged save_pretrained model directory here")
    p.add_argument("--dtype", default="bf16",
                   help="merged weights' dtype: bf16 (default), fp16 or fp32. Merged in fp32, rounded once")
    p.add_argument("--device", default="cpu", help="where the policy is rebuilt and merged: cpu or cuda[:i]")
    return p


def peft_base_name(model_name: str, seed: int) -> str:
    """What a PEFT user loads under the adapter: the un-quantised base the run started from."""
    from grpo.model.shipped import SHIPPED_DIR
    from grpo.model.tiny import TINY_NAME, TINY_RANDOM_NAME, default_model_dir

    if model_name == TINY_NAME:
        return str(SHIPPED_DIR)
    if model_name == TINY_RANDOM_NAME:
        return str(default_model_dir(seed))
    path = Path(model_name).expanduser()
    return str(path.resolve()) if path.is_dir() else model_name  # a directory, else a hub id


def _check_out(flag: str, out: str) -> Path:
    path = Path(out)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        what = "a file" if not path.is_dir() else "a non-empty directory"
        raise ExportError(f"{flag} {out} is {what}; name a new directory (the export never overwrites)")
    if not path.parent.is_dir():
        raise ExportError(f"{flag} {out}: its parent directory {path.parent} does not exist; create it first")
    return path


def _check_request(args: argparse.Namespace) -> tuple[Path, dict[str, Path], torch.dtype]:
    """Everything checkable before the (slow) policy build: flags, outputs, dtype, selector."""
    if not args.peft and not args.merged:
        raise ExportError("nothing to export: give --peft OUT (an adapter) and/or --merged OUT (a merged model)")
    if args.dtype not in DTYPES:
        raise ExportError(f"--dtype {args.dtype!r}: use one of {', '.join(DTYPES)}")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        raise ExportError(f"--device {args.device!r}: use cpu, cuda or cuda:N")
    if args.run_dir is not None and not Path(args.run_dir).is_dir():
        raise ExportError(f"--run-dir {args.run_dir} does not exist; pass the training run's directory "
                          "(the --run.run_dir it was trained with)")
    if args.selector == "base":
        raise ExportError("selector 'base' is the untrained model: there is no adapter to export; name a "
                          "checkpoint such as B:latest")
    outs = {flag: _check_out(f"--{flag}", out) for flag, out in (("peft", args.peft), ("merged", args.merged)) if out}
    if len(outs) == 2 and outs["peft"].resolve() == outs["merged"].resolve():
        raise ExportError(f"--peft and --merged both name {args.peft}; give each its own directory")
    path = grpo.evaluation.evaluate._resolve_selector(args.selector, args)  # SelectorError lists what the run holds
    return path, outs, DTYPES[args.dtype]


def _write(out: Path, fill) -> Path:
    """``fill(tmp)`` writes into a fresh directory beside ``out``; renamed to ``out`` at the end
    (an empty OUT, checked in _check_out, is replaced by the rename; one that filled since
    is refused)."""
    with new_directory(out) as tmp:
        fill(tmp)
    return out


def _summary(out: Path) -> str:
    files = sorted(p for p in out.iterdir() if p.is_file())
    total = sum(p.stat().st_size for p in files)
    listed = ", ".join(f"{p.name} {p.stat().st_size / 1e6:.2f} MB" for p in files if p.stat().st_size > 100_000)
    return f"{len(files)} files, {total / 1e6:.2f} MB" + (f" ({listed})" if listed else "")


def _loaded(path: Path, args: argparse.Namespace, outs: dict[str, Path]) -> tuple:
    """(config, policy) of a checkpoint directory, the export checked against the checkpoint
    before the (slow) policy build: ExportError for what it cannot give."""
    from grpo.overrides import from_json
    from grpo.state.checkpoint import load_checkpoint
    from grpo.state.contents import adapter_tensors, base_checkpoint_of

    ckpt = load_checkpoint(path)  # a damaged checkpoint: CheckpointError before the model is built
    cfg = from_json(ckpt.config_json)
    run_dir = Path(args.run_dir) if args.run_dir else path.parent.parent
    on_base_ckpt = base_checkpoint_of(run_dir, ckpt) is not None
    if "peft" in outs and on_base_ckpt:
        raise ExportError(f"{args.selector} -> {path} was trained on a base checkpoint of this run (the full-weight "
                          f"warm-up of {cfg.model.name!r}), which no model directory or hub id holds, so a PEFT adapter "
                          "would have no base to load under it; export --merged instead")
    if "peft" in outs and not adapter_tensors(ckpt.tensors):
        raise ExportError(f"{args.selector} -> {path} holds no LoRA tensors; export --merged instead")
    return cfg, grpo.model.policy.load_policy(path, run_dir=run_dir, device=args.device)


def export(args: argparse.Namespace, done: list[Path]) -> list[str]:
    """Build the checkpoint's policy once and write what was asked; returns the lines to print.
    ``done`` collects each output once it is in place (a stop's line names them). The checkpoint
    is read as grpo.evaluate reads it: safely while a trainer saves into the run directory."""
    from lora import export_merged, save_adapter

    _, outs, dtype = _check_request(args)
    path, (cfg, bundle) = grpo.state.registry.read_resolved(args.run_dir, args.selector,
                                                          lambda p: _loaded(p, args, outs))
    lines = [f"{args.selector} -> {path} (model {cfg.model.name}, {'NF4' if cfg.model.load_in_4bit else cfg.model.dtype} "
             f"base, LoRA r={cfg.lora.rank})"]
    if "peft" in outs:
        base = peft_base_name(cfg.model.name, cfg.run.seed)
        done.append(_write(outs["peft"], lambda d: save_adapter(bundle.model, d, base_model_name_or_path=base)))
        lines.append(f"wrote PEFT adapter {outs['peft']}: {_summary(outs['peft'])}; base_model_name_or_path {base}")
        if cfg.model.load_in_4bit:
            lines.append("  note: trained over an NF4 base; over the un-quantised base its outputs differ by the "
                         "4-bit rounding (the merged export folds it into the dequantised base instead)")
    if "merged" in outs:
        def fill(d: Path) -> None:
            export_merged(bundle.model, d, dtype)
            bundle.tokenizer.save_pretrained(str(d))
            bundle.image_processor.save_pretrained(str(d))

        done.append(_write(outs["merged"], fill))
        lines.append(f"wrote merged model {outs['merged']} in {args.dtype} ({dtype}): {_summary(outs['merged'])}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI: exit 0, or one line on stderr -- 2 for a wrong request (flags, outputs,
    selector, model), 1 for a damaged checkpoint or an output that cannot be written, 130 /
    143 on Ctrl-C / SIGTERM. Anything else is a bug and keeps its traceback."""
    args = build_parser().parse_args(argv)
    hf_logging.disable_progress_bar()  # stderr is for the outcome: one line on an error or a stop
    done: list[Path] = []
    try:
        with stops_at_once():  # nothing half-exported is worth keeping: stop now
            for line in export(args, done):
                print(line)
        return 0
    except StopNow as stop:
        kept = f"{' and '.join(map(str, done))} written whole before it" if done else "nothing was written"
        print(f"stopped exporting on {signal_name(stop.signum)}; {kept}", file=sys.stderr, flush=True)
        return exit_code(stop.signum)
    except (ValueError, ModelLoadError) as err:  # ExportError, SelectorError, ConfigError, a non-finite merge
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 2
    except CheckpointError as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 1
    except OSError as err:
        outs = [o for o in (args.peft, args.merged) if o]
        if not any(inside(err.filename, Path(o).parent) for o in outs):
            raise
        print(f"error: cannot write the export ({err.strerror}: {err.filename})", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())

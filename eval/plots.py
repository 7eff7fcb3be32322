"""Training plots as PNG, drawn with pillow only (no matplotlib at run time).

Input: the trainer's JSONL log, one JSON object per line. The format (the trainer writes
exactly this; unknown keys are ignored, so it can add more):

    step line (no "event" key, or "event": "step"), one per rollout batch:
        {"phase": "A", "step": 12, "reward": 3.41,
         "components": {"format": 1.8, "parseable": 0.9, ...},   # mean raw component
         "weights": {"format": 1.0, "parseable": 1.0, ...}}      # weights in force
        "step" counts rollout batches *within* the phase (= optimiser steps unless
        optim.updates_per_batch > 1); an optional "global_step" (on every step line) is
        used as the x axis instead, when present. The trainer also writes loss, kl,
        clip_low/high, zero_spread, adv_abs, entropy (the policy's mean token entropy),
        lengths, lr, grad_norm and timings (the first update's values); with
        optim.mask_truncated "masked_truncated" (the fraction of completions the loss
        dropped); with optim.updates_per_batch > 1 an "updates" list, one entry
        per optimiser step: {"update", "loss", "clip_low", "clip_high", "kl_old",
        "grad_norm", "lr"}; with sampling.dynamic_sampling a "dynamic" object:
        {"refills", "sampled_groups", "kept_groups", "dropped_frac", "fill"}; a "rollout"
        object, the sampler against the trainer: {"path", "correction", "mode", "cap",
        "level", "kl", "ratio_mean", "ratio_max", "over_frac"} (grpo/run/records.py step_record);
        a "prompts" object, what the step's draws put into the model (totals over ranks):
        {"n", "visual_tokens", "visual_tokens_max", "tokens", "tokens_max" (mean / max per
        prompt, visual tokens included in tokens), "resized_down", "resized_up" (images
        model.max_pixels shrank / model.min_pixels enlarged), "skipped_long", "skipped_image"
        (prompts over model.max_prompt_tokens / with a bad image, not trained on)}.
    gate line, one per controller rule that fired after a checkpoint eval:
        {"event": "gate", "phase": "A", "step": 20, "rule": "parseable_floor",
         "changes": {"parseable": [0.5, 0.75]}}                  # optional
    eval line, one per checkpoint-side evaluation:
        {"event": "eval", "phase": "A", "step": 20,
         "metrics": {"exact_match": 0.41, "parseable_rate": 0.93, ..., "composite": 0.52},
         "skipped": {"sampler_skipped": 1}}       # prompts not scored, by reason (may be empty)

The x axis is the run's step across phases: phases are laid end to end in the order
they first appear, each offset by the steps of the phases before it (so a phase that
restarts its step counter does not overlap the previous one). Phase boundaries are
dashed vertical lines labelled with the phase name.

    plot_rewards(log, path)             weighted reward (raw, faint + moving average) and
                                        each component's mean, two panels
    plot_weights(log, path)             controller weights (step functions), gate firings
                                        marked with a triangle and the rule name
    plot_checkpoint_metrics(log, path)  checkpoint-eval metrics and scores, markers per eval
    plot_run(log_path, out_dir)         all three; ``python -m eval.plots LOG --out DIR``
    plot_panels(specs, path)            any stack of panels (PanelSpec: series, axis labels,
                                        phase boundaries, named x ticks): the kit the three
                                        plots use, for other figures (bench/learning.py)

Bad lines (not JSON, not an object) are skipped and counted in ``TrainLog.skipped``.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

# Colour-blind-safe-ish categorical palette (Tableau 10).
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
           "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]
GATE_COLOR = "#222222"
CHECKPOINT_KEYS = ("exact_match", "tolerance_accuracy", "parseable_rate", "solution_tag_rate",
                   "reasoning_tag_rate", "truncation_rate", "structure", "correctness", "composite")


# ----------------------------------------------------------------------------- reading the log


@dataclass
class TrainLog:
    """The parsed log, with every point already placed on the run-wide x axis."""

    steps: list[dict[str, Any]] = field(default_factory=list)  # step lines, each with "x"
    gates: list[dict[str, Any]] = field(default_factory=list)  # gate lines, each with "x"
    evals: list[dict[str, Any]] = field(default_factory=list)  # eval lines, each with "x"
    phases: list[tuple[str, float]] = field(default_factory=list)  # (phase, x where it starts)
    skipped: int = 0  # lines that were not JSON objects


def parse_log(lines: Sequence[str]) -> TrainLog:
    """Parse log lines (see module docstring) and compute the run-wide x of every point."""
    log = TrainLog()
    rows: list[dict[str, Any]] = []
    for line in lines:
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            log.skipped += 1
            continue
        if not isinstance(row, dict) or "step" not in row:
            log.skipped += 1
            continue
        rows.append(row)
    step_rows = [r for r in rows if r.get("event", "step") == "step"]
    use_global = bool(step_rows) and all("global_step" in r for r in step_rows)
    order: list[str] = []
    last: dict[str, float] = {}
    # A phase with step lines but no reward (the SFT warm-up) takes no width on the axis:
    # its points sit at the phase's start instead of stretching the RL curves thin.
    no_reward = {str(r.get("phase", "")) for r in step_rows} - {str(r.get("phase", "")) for r in step_rows if "reward" in r}
    for r in rows:
        ph = str(r.get("phase", ""))
        if ph not in order:
            order.append(ph)
        last[ph] = 0.0 if ph in no_reward else max(last.get(ph, 0.0), float(r["step"]))
    offset, start = 0.0, {}
    for ph in order:
        start[ph] = offset
        offset += last[ph]
    for r in rows:
        ph = str(r.get("phase", ""))
        r["x"] = (float(r["global_step"]) if use_global and "global_step" in r
                  else start[ph] + (0.0 if ph in no_reward else float(r["step"])))
        bucket = {"step": log.steps, "gate": log.gates, "eval": log.evals}.get(r.get("event", "step"))
        if bucket is not None:  # other events (config, phase start, ...) are not plotted
            bucket.append(r)
    if use_global:  # a phase starts where its first step line is
        firsts: dict[str, float] = {}
        for r in log.steps:
            firsts.setdefault(str(r.get("phase", "")), r["x"])
        log.phases = [(ph, firsts.get(ph, start[ph])) for ph in order]
    else:
        log.phases = [(ph, start[ph]) for ph in order]
    return log


def read_log(path: str | Path) -> TrainLog:
    return parse_log(Path(path).read_text(encoding="utf-8").splitlines())


# ----------------------------------------------------------------------------- a tiny line-plot kit


def nice_ticks(lo: float, hi: float, n: int = 6) -> list[float]:
    """About n round tick values (1, 2, 5 x 10^k steps) covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return [0.0, 1.0]
    if hi <= lo:
        lo, hi = lo - 0.5, hi + 0.5
    raw = (hi - lo) / max(n, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step) * step
    ticks, t = [], first
    while t <= hi + step * 1e-9:
        ticks.append(round(t, 12))
        t += step
    if ticks[-1] < hi:
        ticks.append(round(t, 12))
    return ticks


def _font(size: int) -> Any:
    try:
        return ImageFont.load_default(size=size)  # scalable default font (FreeType builds)
    except (TypeError, OSError):
        return ImageFont.load_default()


def _fmt_tick(v: float) -> str:
    return f"{v:g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.1e}"


@dataclass
class Series:
    label: str
    xs: list[float]
    ys: list[float]
    color: str
    width: int = 2
    markers: bool = False
    step: bool = False  # draw as a step function (weights change at discrete times)
    dash: bool = False  # dashed line (a control beside the runs it controls)


class Panel:
    """One set of axes in a figure: data-to-pixel mapping, grid, ticks, labels, lines."""

    def __init__(self, img: Image.Image, box: tuple[int, int, int, int], title: str, xlabel: str, ylabel: str):
        self.img, self.draw = img, ImageDraw.Draw(img)
        self.x0, self.y0, self.x1, self.y1 = box  # plot area in pixels (left, top, right, bottom)
        self.title, self.xlabel, self.ylabel = title, xlabel, ylabel
        self.font, self.small = _font(15), _font(12)
        self.xr = self.yr = (0.0, 1.0)
        self.xtick_labels: dict[float, str] | None = None  # named x ticks (categories) instead of numbers

    def set_limits(self, xs: Sequence[float], ys: Sequence[float]) -> None:
        """Tight x range, y range padded by 5%; ticks are round values inside the range."""
        fx = [v for v in xs if math.isfinite(v)] or [0.0, 1.0]
        fy = [v for v in ys if math.isfinite(v)] or [0.0, 1.0]
        pad = 0.05 * ((max(fy) - min(fy)) or 1.0)
        self.xr = (min(fx), max(fx) if max(fx) > min(fx) else min(fx) + 1.0)
        self.yr = (min(fy) - pad, max(fy) + pad)
        inside = lambda ts, r: [t for t in ts if r[0] - 1e-9 <= t <= r[1] + 1e-9]  # noqa: E731
        self.xticks = inside(nice_ticks(*self.xr), self.xr)
        self.yticks = inside(nice_ticks(*self.yr), self.yr)

    def px(self, x: float, y: float) -> tuple[float, float]:
        (a, b), (c, d) = self.xr, self.yr
        u = (x - a) / ((b - a) or 1.0)
        v = (y - c) / ((d - c) or 1.0)
        return self.x0 + u * (self.x1 - self.x0), self.y1 - v * (self.y1 - self.y0)

    def axes(self) -> None:
        d = self.draw
        for t in self.yticks:
            _, y = self.px(self.xr[0], t)
            d.line([(self.x0, y), (self.x1, y)], fill="#e6e6e6")
            d.line([(self.x0 - 5, y), (self.x0, y)], fill="black")
            d.text((self.x0 - 8, y), _fmt_tick(t), fill="black", font=self.small, anchor="rm")
        named = self.xtick_labels
        for t in (sorted(named) if named else self.xticks):
            x, _ = self.px(t, self.yr[0])
            if self.x0 - 0.5 <= x <= self.x1 + 0.5:
                d.line([(x, self.y1), (x, self.y1 + 5)], fill="black")
                d.text((x, self.y1 + 8), named[t] if named else _fmt_tick(t), fill="black", font=self.small,
                       anchor="mt")
        d.rectangle([self.x0, self.y0, self.x1, self.y1], outline="black")
        d.text(((self.x0 + self.x1) / 2, self.y0 - 10), self.title, fill="black", font=self.font, anchor="md")
        d.text(((self.x0 + self.x1) / 2, self.y1 + 28), self.xlabel, fill="black", font=self.font, anchor="mt")
        # Rotated y label: draw on a scratch image, rotate it 90 degrees, paste left of the ticks.
        w = int(self.draw.textlength(self.ylabel, font=self.font)) + 4
        scratch = Image.new("RGBA", (max(w, 1), 20), (255, 255, 255, 0))
        ImageDraw.Draw(scratch).text((2, 10), self.ylabel, fill="black", font=self.font, anchor="lm")
        rot = scratch.rotate(90, expand=True)
        self.img.paste(rot, (self.x0 - 70, int((self.y0 + self.y1) / 2 - rot.height / 2)), rot)

    def phases(self, phases: Sequence[tuple[str, float]]) -> None:
        """Dashed boundaries at each phase start, the phase name just right of it."""
        for i, (name, x) in enumerate(phases):
            px, _ = self.px(x, self.yr[0])
            if i > 0:
                y = self.y0
                while y < self.y1:  # dashed: 6 px on, 4 px off
                    self.draw.line([(px, y), (px, min(y + 6, self.y1))], fill="#555555", width=2)
                    y += 10
            self.draw.text((px + 4, self.y0 + 4), f"phase {name}" if name else "", fill="#555555", font=self.small)

    def series(self, s: Series) -> None:
        pts: list[tuple[float, float]] = []
        prev_y = None
        for x, y in zip(s.xs, s.ys):
            if not (math.isfinite(x) and math.isfinite(y)):
                self._flush(pts, s)
                pts, prev_y = [], None
                continue
            if s.step and prev_y is not None:
                pts.append(self.px(x, prev_y))  # hold the old value until the change
            pts.append(self.px(x, y))
            prev_y = y
        self._flush(pts, s)
        if s.markers:
            for x, y in zip(s.xs, s.ys):
                if math.isfinite(x) and math.isfinite(y):
                    cx, cy = self.px(x, y)
                    self.draw.ellipse([cx - 3, cy - 3, cx + 3, cy + 3], fill=s.color)

    def _flush(self, pts: list[tuple[float, float]], s: Series) -> None:
        if len(pts) >= 2 and s.dash:
            for a, b in _dashes(pts):
                self.draw.line([a, b], fill=s.color, width=s.width)
        elif len(pts) >= 2:
            self.draw.line(pts, fill=s.color, width=s.width, joint="curve")
        elif len(pts) == 1:
            x, y = pts[0]
            self.draw.ellipse([x - 2, y - 2, x + 2, y + 2], fill=s.color)

    def legend(self, items: Sequence[tuple[str, str] | tuple[str, str, bool]], x: int) -> None:
        """Colour swatches and labels in a column starting at pixel x, top-aligned
        (an item's optional third value True draws its swatch dashed, like its line)."""
        y = self.y0
        for label, color, *dash in items:
            if dash and dash[0]:
                for a, b in _dashes([(x, y + 8), (x + 22, y + 8)], on=5.0, off=4.0):
                    self.draw.line([a, b], fill=color, width=3)
            else:
                self.draw.line([(x, y + 8), (x + 22, y + 8)], fill=color, width=3)
            self.draw.text((x + 28, y + 8), label, fill="black", font=self.small, anchor="lm")
            y += 20


def _dashes(pts: Sequence[tuple[float, float]], on: float = 9.0, off: float = 6.0
            ) -> list[tuple[tuple[float, float], tuple[float, float]]]:
    """The 'on' pieces of a polyline cut into on/off lengths in pixels (the pattern runs on
    across vertices, so a dense curve is still visibly dashed)."""
    out, pos, period = [], 0.0, on + off
    for (xa, ya), (xb, yb) in zip(pts, pts[1:]):
        seg = math.hypot(xb - xa, yb - ya)
        t = 0.0
        while t < seg:
            phase = pos % period
            step = min((on - phase) if phase < on else (period - phase), seg - t)
            if phase < on:
                f0, f1 = t / seg, (t + step) / seg
                out.append(((xa + f0 * (xb - xa), ya + f0 * (yb - ya)), (xa + f1 * (xb - xa), ya + f1 * (yb - ya))))
            t, pos = t + step, pos + step
    return out


def _figure(n_panels: int, width: int = 1100, panel_h: int = 330) -> tuple[Image.Image, list[tuple[int, int, int, int]]]:
    """A white image with n stacked plot areas; the right 230 px are kept for legends."""
    height = n_panels * (panel_h + 90) + 20
    img = Image.new("RGB", (width, height), "white")
    boxes = [(90, 40 + i * (panel_h + 90), width - 250, 40 + i * (panel_h + 90) + panel_h) for i in range(n_panels)]
    return img, boxes


def _draw_panel(img: Image.Image, box, title: str, ylabel: str, series: list[Series], log: TrainLog,
                legend: list[tuple[str, str]] | None = None, y_include: Sequence[float] = ()) -> Panel:
    p = Panel(img, box, title, "step (all phases)", ylabel)
    p.set_limits([x for s in series for x in s.xs] + [x for _, x in log.phases],
                 [y for s in series for y in s.ys] + list(y_include))
    p.axes()
    p.phases(log.phases)
    for s in series:
        p.series(s)
    p.legend(legend if legend is not None else [(s.label, s.color) for s in series], box[2] + 20)
    return p


def moving_average(ys: Sequence[float], window: int) -> list[float]:
    """Centered moving average over finite values (shorter windows at the ends)."""
    h = max(window, 1) // 2
    out = []
    for i in range(len(ys)):
        vals = [v for v in ys[max(0, i - h): i + h + 1] if math.isfinite(v)]
        out.append(sum(vals) / len(vals) if vals else math.nan)
    return out


def _num(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan


def _names(rows: Sequence[dict[str, Any]], key: str) -> list[str]:
    seen: list[str] = []
    for r in rows:
        for k in (r.get(key) or {}):
            if k not in seen:
                seen.append(k)
    return seen


# ----------------------------------------------------------------------------- the three plots


def _by_phase(steps: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Consecutive runs of step lines of one phase (lines break and smoothing restarts
    at a phase boundary: a new phase has new weights, so its reward is a new quantity)."""
    runs: list[list[dict[str, Any]]] = []
    for r in steps:
        if not runs or runs[-1][-1].get("phase") != r.get("phase"):
            runs.append([])
        runs[-1].append(r)
    return runs


def _joined(runs: Sequence[Sequence[float]]) -> list[float]:
    """Concatenate runs with a NaN between them (a gap in the drawn line)."""
    out: list[float] = []
    for i, run in enumerate(runs):
        out += ([math.nan] if i else []) + list(run)
    return out


def plot_rewards(log: TrainLog, path: str | Path) -> Path:
    """Weighted reward (faint raw + thick moving average) above each component's mean."""
    runs = _by_phase(log.steps)
    xs = _joined([[r["x"] for r in run] for run in runs])
    raw = [[_num(r.get("reward")) for r in run] for run in runs]
    window = max(1, len(log.steps) // 20)
    img, (top, bottom) = _figure(2)
    _draw_panel(img, top, "weighted reward per step", "reward",
                [Series("raw", xs, _joined(raw), "#9ecae1", 1),
                 Series(f"moving avg ({window})", xs, _joined([moving_average(r, window) for r in raw]), PALETTE[0], 3)],
                log)
    comps = [Series(name, xs, _joined([[_num((r.get("components") or {}).get(name)) for r in run] for run in runs]),
                    PALETTE[i % 10]) for i, name in enumerate(_names(log.steps, "components"))]
    _draw_panel(img, bottom, "reward components (mean over completions)", "component", comps, log)
    return _save(img, path)


def plot_weights(log: TrainLog, path: str | Path) -> Path:
    """Controller weights as step functions; each gate firing marked with a triangle + rule."""
    xs = [r["x"] for r in log.steps]
    names = _names(log.steps, "weights")
    series = [Series(n, xs, [_num((r.get("weights") or {}).get(n)) for r in log.steps], PALETTE[i % 10], step=True)
              for i, n in enumerate(names)]
    img, (box,) = _figure(1, panel_h=420)
    legend = [(s.label, s.color) for s in series] + [("gate fired (rule)", GATE_COLOR)]
    p = _draw_panel(img, box, "reward weights (controller)", "weight", series, log, legend)
    for i, g in enumerate(log.gates):
        x, _ = p.px(g["x"], p.yr[0])
        y = p.y1 - 4
        p.draw.polygon([(x, y - 12), (x - 7, y), (x + 7, y)], fill=GATE_COLOR)
        p.draw.line([(x, p.y0), (x, y - 12)], fill="#bbbbbb", width=1)
        # labels on three staggered rows so neighbouring firings stay readable
        p.draw.text((x + 3, y - 16 - 16 * (i % 3)), str(g.get("rule", "gate")), fill=GATE_COLOR, font=p.small, anchor="ld")
    return _save(img, path)


def plot_checkpoint_metrics(log: TrainLog, path: str | Path) -> Path:
    """Checkpoint-side eval metrics and scores across phases (one marker per eval)."""
    xs = [r["x"] for r in log.evals]
    present = [k for k in CHECKPOINT_KEYS if any(k in (r.get("metrics") or {}) for r in log.evals)]
    series = [Series(k, xs, [_num((r.get("metrics") or {}).get(k)) for r in log.evals], PALETTE[i % 10], markers=True)
              for i, k in enumerate(present)]
    img, (box,) = _figure(1, panel_h=420)
    _draw_panel(img, box, "checkpoint evaluations", "rate / score", series, log, y_include=(0.0, 1.0))
    return _save(img, path)


@dataclass
class PanelSpec:
    """One panel of ``plot_panels``: what to draw and how to label it."""

    title: str
    ylabel: str
    series: list[Series]
    xlabel: str = "step"
    phases: Sequence[tuple[str, float]] = ()  # (name, x) boundaries, dashed, as in the run plots
    y_include: Sequence[float] = ()  # values the y range must contain (0 for a gap, [0, 1] for rates)
    xtick_labels: dict[float, str] | None = None  # named ticks (e.g. checkpoints) instead of numbers


def plot_panels(specs: Sequence[PanelSpec], path: str | Path, panel_h: int = 300) -> Path:
    """A PNG of stacked panels drawn with the same axes, legend and line code as the run plots."""
    if not specs:
        raise ValueError("plot_panels: give at least one PanelSpec")
    img, boxes = _figure(len(specs), panel_h=panel_h)
    for spec, box in zip(specs, boxes):
        p = Panel(img, box, spec.title, spec.xlabel, spec.ylabel)
        xs = [x for s in spec.series for x in s.xs] + [x for _, x in spec.phases] + list(spec.xtick_labels or ())
        p.set_limits(xs, [y for s in spec.series for y in s.ys] + list(spec.y_include))
        if spec.xtick_labels:  # categories: a half-slot margin, so the outer points are not on the frame
            lo, hi = min(spec.xtick_labels), max(spec.xtick_labels)
            p.xr, p.xtick_labels = (lo - 0.3, hi + 0.3), dict(spec.xtick_labels)
        p.axes()
        p.phases(list(spec.phases))
        for s in spec.series:
            p.series(s)
        p.legend([(s.label, s.color, s.dash) for s in spec.series if s.label], box[2] + 20)
    return _save(img, path)


def _save(img: Image.Image, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, format="PNG")
    return path


def plot_run(log_path: str | Path, out_dir: str | Path) -> list[Path]:
    """rewards.png, weights.png and checkpoints.png of one training log."""
    log = read_log(log_path)
    if not (log.steps or log.evals):
        raise ValueError(f"{log_path}: no step or eval lines found ({log.skipped} unreadable lines); "
                         "is this the trainer's JSONL log?")
    out = Path(out_dir)
    return [plot_rewards(log, out / "rewards.png"), plot_weights(log, out / "weights.png"),
            plot_checkpoint_metrics(log, out / "checkpoints.png")]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.plots", description="PNG plots of a training log (JSONL).")
    ap.add_argument("log", help="the trainer's JSONL log")
    ap.add_argument("--out", default=None, help="output directory (default: next to the log)")
    args = ap.parse_args(argv)
    try:
        paths = plot_run(args.log, args.out or Path(args.log).parent)
    except (OSError, ValueError) as err:
        print(f"error: {err}")
        return 2
    for p in paths:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

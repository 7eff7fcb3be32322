"""bench.vs_trl --sweep: the step of both sides, and their ratio, against G, the visual tokens
per image or the completion length; a JSON of the points and a pillow plot.

Each point is one whole comparison (bench.vs_trl's warm-up and alternated rounds, both sides
rebuilt) with one setting changed. Beside the measured ratio, what the shared prefix alone
predicts: per group TRL's passes run the prompt in all G rows, G (P + T) tokens, ours runs it
once, P + G T (P: prompt tokens, visual ones included; T: completion tokens per row); if every
token cost the same in every pass, TRL / ours = G (P + T) / (P + G T). Where the measured ratio
is above it, the rest of our lead (decode, dequantisation, the training passes' code) is at
work; where it is below, the prompt tokens are cheaper than the completion tokens (a prefill
is one batched pass, a decode step is one token per row).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

SWEEPS = {  # name -> (bench.vs_trl's attribute, its flag, default values, axis label)
    "G": ("G", "--G", [4, 8, 16], "completions per prompt G"),
    "visual": ("image_px", "--image-px", [64, 256, 1024], "visual tokens per image"),
    "length": ("max_new_tokens", "--max-new-tokens", [64, 128, 256], "completion tokens per row"),
}


def image_px(visual_tokens: int) -> int:
    """The square image side whose 14 px patches, merged 2x2, give ``visual_tokens``."""
    side = round(visual_tokens ** 0.5)
    if side * side != visual_tokens:
        raise SystemExit(f"--sweep-values {visual_tokens}: visual tokens must be a square (64, 256, 1024)")
    return 28 * side


def predicted_ratio(P: float, T: float, G: int) -> float:
    """TRL / ours if every token cost the same: G (P + T) tokens per group against P + G T."""
    return G * (P + T) / (P + G * T)


def point(sides: dict[str, list[dict]], args, value: int) -> dict:
    """One point of the sweep: the swept value, the shapes and every side's medians."""
    ours = sides["ours"]
    P = statistics.median(r["prompt_tokens"] for r in ours)
    T = statistics.median(r["tokens"] for r in ours) / (args.B * args.G)
    out = {"value": value, "G": args.G, "image_px": args.image_px, "max_new_tokens": args.max_new_tokens,
           "prompt_tokens": P, "completion_tokens_per_row": T, "predicted_ratio": predicted_ratio(P, T, args.G)}
    for side, runs in sides.items():
        out[side] = {k: statistics.median(r[k] for r in runs) for k in runs[0] if runs[0][k] is not None}
        out[side]["rounds"] = [r["step"] for r in runs]
    if "trl" in sides:
        out["ratio"] = out["trl"]["step"] / out["ours"]["step"]
    return out


def run_sweep(args, argv: list[str], run_point, report) -> None:
    """Every value of the sweep in turn; the JSON after each point (a stopped sweep keeps its
    points), the plot at the end."""
    attr, flag, default, label = SWEEPS[args.sweep]
    values = [int(v) for v in args.sweep_values.split(",")] if args.sweep_values else default
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"vs_trl_{args.sweep}.json"
    points = []
    for value in values:
        setting = image_px(value) if args.sweep == "visual" else value
        setattr(args, attr, setting)
        print(f"# --- {label} = {value} ({flag} {setting})", flush=True)
        sides = run_point(args, [*argv, flag, str(setting)])
        report(sides, args.shape)
        points.append(point(sides, args, value))
        path.write_text(json.dumps({"sweep": args.sweep, "label": label, "shape": args.shape,
                                    "allocator": args.allocator, "points": points}, indent=1))
    png = plot(points, label, out_dir / f"vs_trl_{args.sweep}.png", args)
    rows = "; ".join(f"{p['value']}: ours {p['ours']['step']:.2f} s" + (f", TRL {p['trl']['step']:.2f} s, "
                     f"{p['ratio']:.2f}x" if "ratio" in p else "") + f" (prefix predicts {p['predicted_ratio']:.2f}x)"
                     for p in points)
    print(f"summary: sweep {args.sweep}: {rows}; wrote {path} and {png}")


def plot(points: list[dict], label: str, path: Path, args) -> Path:
    """Two panels: each side's step against the swept value; the ratio and the prefix's prediction."""
    from eval.plots import PanelSpec, Series, plot_panels

    xs = [float(i) for i in range(len(points))]  # evenly spaced, labelled with the values
    steps = [Series("ours", xs, [p["ours"]["step"] for p in points], "#1f77b4", markers=True)]
    ratios = [Series("shared prefix predicts", xs, [p["predicted_ratio"] for p in points], "#7f7f7f", dash=True,
                     markers=True)]
    if all("ratio" in p for p in points):
        steps.append(Series("TRL", xs, [p["trl"]["step"] for p in points], "#d62728", markers=True))
        ratios.insert(0, Series("TRL / ours", xs, [p["ratio"] for p in points], "#2ca02c", markers=True))
    shape = "tiny" if args.shape == "tiny" else f"7B widths, {args.layers}+{args.vision_layers} layers"
    ticks = {x: str(p["value"]) for x, p in zip(xs, points)}
    return plot_panels([PanelSpec(f"GRPO step time ({shape}, allocator {args.allocator})", "seconds", steps,
                                  xlabel=label, y_include=[0], xtick_labels=ticks),
                        PanelSpec("TRL step / our step", "ratio", ratios, xlabel=label, y_include=[1],
                                  xtick_labels=ticks)], path)

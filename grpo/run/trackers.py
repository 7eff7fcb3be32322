"""Experiment trackers (--run.report_to, TRL's name): the log's numbers, the resolved config
and, at each checkpoint evaluation, a table of sample completions with their images, sent to
TensorBoard, Weights & Biases or MLflow beside train_log.jsonl.

Each tracker is an optional package, imported when its first record arrives (a missing one
was refused by TrainConfig.validate before any model loaded). One tracker run per phase, as
each phase counts its steps from 1: TensorBoard's tensorboard/<phase>/, a wandb run and an
MLflow run named <run directory>/<phase>. Where a run writes unless the environment says
otherwise (WANDB_DIR, WANDB_MODE, WANDB_PROJECT, MLFLOW_TRACKING_URI are honoured): wandb
under <run_dir>/wandb, MLflow's local file store <run_dir>/mlruns (MLflow 3 keeps that store
in maintenance mode behind MLFLOW_ALLOW_FILE_STORE, which is set for it; a database or server
URI in MLFLOW_TRACKING_URI gets MLflow's newest features).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

SAMPLE_ROWS = 8  # completions per evaluation table: enough to see what the policy answers, small to upload
COLUMNS = ("pid", "image", "question", "gold", "completion", "answer", "exact")


def side_by_side(images: list) -> Any:
    """A prompt's images as one picture for a table cell: the one image itself, or several
    pasted left to right in the prompt's order on white (a tracker's cell holds one image)."""
    images = [im for im in images if im is not None]
    if len(images) <= 1:
        return images[0] if images else None
    from PIL import Image

    strip = Image.new("RGB", (sum(im.width for im in images), max(im.height for im in images)), "white")
    x = 0
    for im in images:
        strip.paste(im.convert("RGB"), (x, 0))
        x += im.width
    return strip


def sample_rows(records: list[dict], examples: list) -> list[dict]:
    """The evaluation's first SAMPLE_ROWS completions as table rows; ``image`` is the PIL image
    (a prompt of several images: all of them, side by side)."""
    by_pid = {ex.pid: ex for ex in examples}
    rows = []
    for r in records[:SAMPLE_ROWS]:
        ex = by_pid.get(r["pid"])
        image = side_by_side(ex.prompt_images) if ex is not None else None
        rows.append(dict(pid=str(r["pid"]), image=image, question=getattr(ex, "question", ""),
                         gold=str(r["gold"]), completion=r["text"], answer=str(r["answer"]), exact=bool(r["exact"])))
    return rows


def flat_config(config: dict) -> dict[str, Any]:
    """{'optim': {'lr': 1e-3}} -> {'optim.lr': 1e-3}: the hyperparameters, one per config key."""
    return {f"{sec}.{k}": v for sec, fields in config.items() for k, v in fields.items()}


class TensorBoard:
    """tensorboard/<phase>/: each number a scalar; the config and each sample table as text, the
    samples' images as images. The writer purges from the first step this process logs
    (purge_step), so the steps a resumed phase logs again are not shown twice."""

    def __init__(self, root: Path, phase: str, step: int, config: dict):
        from torch.utils.tensorboard import SummaryWriter  # optional package: imported only when asked for

        self.events = SummaryWriter(str(root / "tensorboard" / phase), purge_step=step)
        self.events.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", global_step=step)

    def log(self, step: int, scalars: list[tuple[str, float]]) -> None:
        for tag, value in scalars:
            self.events.add_scalar(tag, value, global_step=step)
        # one flush per record (a step takes seconds): a killed run's events are as complete as its JSONL
        self.events.flush()

    def samples(self, step: int, rows: list[dict]) -> None:
        import numpy as np

        head = "| " + " | ".join(c for c in COLUMNS if c != "image") + " |"
        lines = [head, "|" + "---|" * (len(COLUMNS) - 1)]
        for r in rows:
            lines.append("| " + " | ".join(_cell(r[c]) for c in COLUMNS if c != "image") + " |")
        self.events.add_text("eval/samples", "\n".join(lines), global_step=step)
        for i, r in enumerate(rows):
            if r["image"] is not None:
                self.events.add_image(f"eval/samples/{i}", np.asarray(r["image"].convert("RGB")), global_step=step,
                                      dataformats="HWC")
        self.events.flush()

    def close(self) -> None:
        self.events.close()


class Wandb:
    """One wandb run per phase (group: the run directory's name), config as its config,
    numbers at their step, each evaluation's samples as a wandb.Table with wandb.Image cells."""

    def __init__(self, root: Path, phase: str, step: int, config: dict):
        import wandb  # optional package: imported only when asked for

        self.wandb = wandb
        where = {} if os.environ.get("WANDB_DIR") else {"dir": str(root)}
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "vlgrpo"), group=root.name,
                              name=f"{root.name}/{phase}", config=config, reinit="create_new", **where)
        self.step = step

    def log(self, step: int, scalars: list[tuple[str, float]]) -> None:
        self.run.log(dict(scalars), step=step)

    def samples(self, step: int, rows: list[dict]) -> None:
        table = self.wandb.Table(columns=list(COLUMNS))
        for r in rows:
            image = self.wandb.Image(r["image"]) if r["image"] is not None else None
            table.add_data(*[image if c == "image" else r[c] for c in COLUMNS])
        self.run.log({"eval/samples": table}, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflow:
    """One MLflow run per phase in the experiment named after the run directory: the config
    as params, numbers as metrics at their step, each evaluation's samples as a table
    artifact samples/step_N.json (MLflow's columns/data layout) beside the images' PNGs."""

    def __init__(self, root: Path, phase: str, step: int, config: dict):
        from mlflow.entities import Metric, Param  # optional package: imported only when asked for
        from mlflow.tracking import MlflowClient

        self.Metric = Metric
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # the local file store, which MLflow 3 keeps (in maintenance mode) behind this opt-in
            uri = (root / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        name = str(root.resolve())
        exp = self.client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
        self.run_id = self.client.create_run(exp_id, run_name=phase, tags={"phase": phase}).info.run_id
        params = [Param(k, json.dumps(v) if not isinstance(v, str) else v) for k, v in flat_config(config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, step: int, scalars: list[tuple[str, float]]) -> None:
        now = int(time.time() * 1000)
        metrics = [self.Metric(tag, value, now, step) for tag, value in scalars]
        for i in range(0, len(metrics), 1000):  # and at most 1000 metrics
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def samples(self, step: int, rows: list[dict]) -> None:
        data = [[f"samples/step_{step}/{i}.png" if c == "image" and r["image"] is not None else
                 None if c == "image" else r[c] for c in COLUMNS] for i, r in enumerate(rows)]
        self.client.log_dict(self.run_id, {"columns": list(COLUMNS), "data": data}, f"samples/step_{step}.json")
        with tempfile.TemporaryDirectory() as tmp:
            for i, r in enumerate(rows):
                if r["image"] is not None:
                    r["image"].save(Path(tmp) / f"{i}.png")
            self.client.log_artifacts(self.run_id, tmp, f"samples/step_{step}")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


TRACKERS = {"tensorboard": TensorBoard, "wandb": Wandb, "mlflow": MLflow}


def _cell(value: Any) -> str:
    """A markdown table cell: one line, pipes escaped."""
    text = str(value) if not (isinstance(value, float) and math.isnan(value)) else "nan"
    return " ".join(text.split()).replace("|", "\\|")

"""--run.report_to wandb,mlflow: a tiny run's numbers, config and sample tables read back offline
(wandb's offline run file, MLflow's local file store); a tracker not installed is one line
with the pip command before any model loads."""

import glob
import importlib.util
import json
import struct

import pytest
from train_helpers import log_lines, run_main

from grpo.run.files import record_scalars

QUICK = ["--phase", "A", "--model.device", "cpu", "--phase.steps", "2", "--run.eval_every", "1", "--run.eval_size", "2",
         "--sampling.G", "2", "--sampling.max_new_tokens", "8", "--phase.prompts_per_step", "2",
         "--run.test_per_stage", "0", "--run.train_per_stage", "20"]


def wandb_history(path) -> dict[int, dict]:
    """step -> {key: value} from an offline run's .wandb file (LevelDB-style log blocks of
    wandb's protobuf Records after a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, buf, out = open(path, "rb").read(), 7, b"", {}
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        buf, pos = buf + data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            if rec.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                out.setdefault(int(rec.history.step.num), {}).update(items)
    return out


def test_wandb_and_mlflow_get_every_number_the_config_and_samples(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "wb").mkdir()
    run = tmp_path / "run"
    rc, _, err = run_main(run, *QUICK, "--run.report_to", "wandb,mlflow")
    assert rc == 0, err
    records = [r for r in log_lines(run) if r["phase"] == "A"]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    (mrun,) = client.search_runs([client.get_experiment_by_name(str(run.resolve())).experiment_id])
    assert mrun.data.params["optim.lr"] == "0.002" and mrun.data.params["phase.name"] == "A"
    n = 0
    for r in records:
        for tag, value in record_scalars(r):
            hist = {m.step: m.value for m in client.get_metric_history(mrun.info.run_id, tag)}
            assert hist[r["step"]] == pytest.approx(value, rel=1e-6, abs=1e-7) or value != value, tag
            n += 1
    assert n > 50
    table = json.loads((run / "mlruns" / mrun.info.experiment_id / mrun.info.run_id / "artifacts" / "samples"
                        / "step_1.json").read_text())
    assert table["columns"][:2] == ["pid", "image"] and len(table["data"]) == 2
    assert (run / "mlruns" / mrun.info.experiment_id / mrun.info.run_id / "artifacts" / table["data"][0][1]).is_file()

    (wfile,) = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    history = wandb_history(wfile)
    for r in records:
        for tag, value in record_scalars(r):
            assert history[r["step"]][tag] == pytest.approx(value, rel=1e-6, abs=1e-7) or value != value, tag
    (table_file,) = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*" / "files" / "media" / "table" / "eval"
                                  / "samples_1_*.table.json"))
    table = json.loads(open(table_file).read())
    assert table["columns"][:3] == ["pid", "image", "question"] and len(table["data"]) == 2


def test_a_tracker_not_installed_is_one_line_before_any_model_loads(tmp_path, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    rc, _, err = run_main(tmp_path / "run", *QUICK, "--run.report_to", "wandb")
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "pip install 'vlgrpo[wandb]'" in err and not (tmp_path / "run" / "train_log.jsonl").exists()
    rc, _, err = run_main(tmp_path / "run", *QUICK, "--run.report_to", "comet")
    assert rc == 2 and "trackers are tensorboard, wandb or mlflow" in err


def test_a_sample_row_shows_every_image_of_its_prompt():
    """A one-image prompt's cell is its image; a prompt of several shows them all, left to
    right in the prompt's order (a tracker's table cell holds one image)."""
    from PIL import Image

    from data.schema import Example
    from grpo.run.trackers import sample_rows

    red, blue = Image.new("RGB", (3, 2), (255, 0, 0)), Image.new("RGB", (4, 5), (0, 0, 255))
    examples = [Example("one", "q", "1", image=red), Example("two", "q", "2", image=red, images=[red, blue])]
    records = [dict(pid=p, gold=g, text="t", answer=g, exact=True) for p, g in (("one", "1"), ("two", "2"), ("gone", "3"))]
    one, two, gone = sample_rows(records, examples)
    assert one["image"] is red and gone["image"] is None
    strip = two["image"]
    assert strip.size == (7, 5)
    assert strip.getpixel((2, 1)) == (255, 0, 0) and strip.getpixel((3, 4)) == (0, 0, 255)
    assert strip.getpixel((0, 4)) == (255, 255, 255)  # below the shorter image: the white ground

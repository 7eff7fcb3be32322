"""The evaluation engine end to end on a tiny run: scoring, stages, reports, CLI, plots."""

import json
import math
import types

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from data.schema import Example
from eval.plots import GATE_COLOR, PALETTE, parse_log, plot_run
from eval.report import render_markdown, write_report
from eval.results import EvalProtocol, evaluate_completions
from grpo.evaluation.evaluate import main
from grpo.evaluation.model_eval import evaluate_model

R, S = "<REASONING>r</REASONING>", "<SOLUTION>{}</SOLUTION>"


def ex(pid, answer, context, skills, answer_type="integer", precision=None):
    return Example(pid=pid, question=f"q{pid}", answer=answer, answer_type=answer_type, precision=precision,
                   metadata={"context": context, "skills": skills, "language": "english"})


@pytest.fixture
def tiny_run():
    examples = [
        ex("s1", "4", "synthetic scene", ["arithmetic reasoning"]),          # stage 1
        ex("s2", "2.5", "bar chart", ["statistical reasoning"], "float", 1),  # stage 2
        ex("s3", "9", "line plot", ["algebraic reasoning"]),                  # stages 2 and 3
        ex("gone", "", "table", ["arithmetic reasoning"]),                     # no gold: skipped
    ]
    completions = [
        [R + S.format("4"), R + S.format("5")],          # exact, wrong
        [R + S.format("2.54"), "<SOLUTION>2.5</SOLUTION>"],  # tolerant-wrong, missing reasoning tag
        [R + "and so on and so on", "x " * 30],          # missing solution tag, truncated
        [R + S.format("1"), R + S.format("1")],
    ]
    tokens = [[6, 6], [7, 4], [9, 30], [5, 5]]
    return examples, completions, tokens


def test_evaluate_completions_overall_stages_and_skips(tiny_run):
    res = evaluate_completions(*tiny_run, max_new_tokens=30)
    o = res.overall
    assert (o.n_prompts, o.n_completions) == (3, 6)
    assert res.skipped == {"no_numeric_gold": 1}
    # exact match needs only the one SOLUTION block: "<SOLUTION>2.5</SOLUTION>" counts
    assert o.metrics["exact_match"] == pytest.approx(2 / 6)
    assert o.metrics["tolerance_accuracy"] == pytest.approx(3 / 6)  # + 2.54 for 2.5 at precision 1
    assert o.metrics["truncation_rate"] == pytest.approx(1 / 6)
    assert o.failure_modes == {"truncation": 1, "missing_solution_tag": 1, "missing_reasoning_tag": 1,
                               "malformed": 0, "unparseable": 0, "wrong": 2, "exact": 1}
    assert res.stages["stage1"].n_prompts == 1 and res.stages["stage1"].metrics["exact_match"] == 0.5
    assert res.stages["stage2"].n_prompts == 2 and res.stages["stage3"].n_prompts == 1
    assert res.stages["stage3"].metrics["parseable_rate"] == 0.0
    # every metric and score has an interval that contains its value
    for key in list(o.metrics) + list(o.scores):
        lo, hi = o.intervals[key]
        value = o.scores.get(key, o.metrics.get(key))
        assert lo - 1e-12 <= value <= hi + 1e-12, key
    flat = res.flat()
    assert flat["n"] == 3 and {"structure", "correctness", "composite", "exact_match"} <= set(flat)
    assert [r["pid"] for r in res.records].count("s3") == 2 and res.records[0]["stages"] == [1]


def test_shape_mismatch_is_one_clear_error(tiny_run):
    examples, completions, tokens = tiny_run
    with pytest.raises(ValueError, match="pid s1.*2 completions but 1 token counts"):
        evaluate_completions(examples, completions, [[6]] + tokens[1:], 30)
    with pytest.raises(ValueError, match="4 examples but 3 completion lists"):
        evaluate_completions(examples, completions[:3], tokens, 30)


def test_write_report_markdown_json_samples(tiny_run, tmp_path):
    res = evaluate_completions(*tiny_run, max_new_tokens=30)
    empty = evaluate_completions([], [], [], 30)  # a model with nothing scored: NaNs, not a crash
    proto = {"samples_per_prompt": 2, "max_new_tokens": 30, "seed": 0}
    md_path, js_path = write_report({"base": res, "A:best_structure": empty}, proto, tmp_path, title="Tiny", data="fixture")
    md = md_path.read_text()
    for needle in ("# Tiny", "| max_new_tokens | 30 |", "## Headline metrics", "## 95% intervals",
                   "## Failure modes", "## Stage-wise diagnostics", "| base | stage2 | 2 |", "no_numeric_gold"):
        assert needle in md
    head = next(line for line in md.splitlines() if line.startswith("| base | 3 |"))
    assert "| 0.333 |" in head  # EM 2/6
    report = json.loads(js_path.read_text())  # standard JSON: NaN became null
    assert report["protocol"] == proto
    assert report["models"]["base"]["overall"]["failure_modes"]["truncation"] == 1
    assert report["models"]["A:best_structure"]["overall"]["metrics"]["exact_match"] is None
    samples = (tmp_path / "samples_base.jsonl").read_text().splitlines()
    assert len(samples) == 6 and json.loads(samples[5])["failure_mode"] == "truncation"
    assert (tmp_path / "samples_A_best_structure.jsonl").exists()
    assert render_markdown({"base": res}, proto, "t", "d").count("| base |") >= 4


def _fake_grpo(monkeypatch, calls):
    """Stand-ins for grpo.model.prompts.encode_prompts / grpo.rollout.sampler.sample: image-less examples are
    skipped by the encoder; each kept prompt gets G completions answering its own pid."""
    import grpo.model.load
    import grpo.model.prompts
    import grpo.rollout.sampler

    def encode_prompts(bundle, items, on_bad_image="raise"):
        kept = [i for i, e in enumerate(items) if e.image is not None]
        if not kept:
            raise ValueError("every image failed")
        obj = types.SimpleNamespace(kept=kept, items=[items[i] for i in kept])
        obj.to = lambda device: obj
        return obj

    def sample(bundle, prompts, *, G, max_new_tokens, temperature, top_k, top_p, seed):
        calls.append(dict(G=G, seed=seed, n=len(prompts.kept), temperature=temperature))
        texts = [R + S.format(e.answer) for e in prompts.items for _ in range(G)]
        n = len(texts)
        return types.SimpleNamespace(texts=texts, lengths=torch.full((n,), 5), finished=torch.ones(n, dtype=torch.bool))

    monkeypatch.setattr(grpo.model.prompts, "encode_prompts", encode_prompts)
    monkeypatch.setattr(grpo.rollout.sampler, "sample", sample)


def test_evaluate_model_plumbing(monkeypatch):
    calls = []
    _fake_grpo(monkeypatch, calls)
    img = Image.new("RGB", (8, 8))
    examples = [ex(str(i), str(i), "synthetic scene", ["arithmetic reasoning"]) for i in range(5)]
    for e in examples:
        e.image = img
    examples[1].image = None  # the encoder drops it
    proto = EvalProtocol(samples_per_prompt=2, temperature=1.0, seed=7, batch_size=2, max_new_tokens=30,
                         image_control=False)  # one pass: the seeds below are the protocol's
    res = evaluate_model(bundle=types.SimpleNamespace(device="cpu"), examples=examples, protocol=proto)
    assert [c["seed"] for c in calls] == [7, 9, 11] and all(c["G"] == 2 for c in calls)
    assert res.skipped == {"sampler_skipped": 1}
    assert res.overall.n_prompts == 4 and res.metrics["exact_match"] == 1.0
    assert res.metrics["mean_completion_tokens"] == 4.0  # the stop token is not counted
    assert {r["pid"] for r in res.records} == {"0", "2", "3", "4"}
    with pytest.raises(ValueError, match="greedy decoding gives identical copies"):
        evaluate_model(None, examples, EvalProtocol(samples_per_prompt=2, temperature=0.0))


def test_cli_scores_completion_files_against_mathvista(tmp_path, capsys):
    from test_mathvista import SCHEMA, make_row, meta

    rows = [make_row("1", answer="3"), make_row("2", answer="2.5", answer_type="float", precision=1.0,
                                                 metadata=meta("bar chart", ["statistical reasoning"])),
            make_row("3", question_type="multi_choice", answer_type="text", answer="A", choices=["A", "B"]),
            make_row("4", decoded_image={"bytes": b"junk", "path": None})]
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), tmp_path / "testmini-0.parquet")
    comp = tmp_path / "mine.jsonl"
    comp.write_text(json.dumps({"pid": "1", "completions": [R + S.format("3")], "token_counts": [6]}) + "\n"
                    + json.dumps({"pid": "2", "completions": [R + S.format("7")], "token_counts": [6]}) + "\n")
    out = tmp_path / "report"
    rc = main(["--data", str(tmp_path / "testmini-0.parquet"), "--completions", f"mine={comp}", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    m = report["models"]["mine"]
    assert m["overall"]["n_prompts"] == 2 and m["overall"]["metrics"]["exact_match"] == 0.5
    assert m["skipped"] == {"load:corrupt_image": 1}  # the loader's skip is shown with the model
    assert main(["--data", str(tmp_path / "missing"), "--completions", f"mine={comp}", "--out", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_unknown_selector_lists_what_exists(tmp_path, capsys, monkeypatch):
    from test_mathvista import SCHEMA, make_row

    pq.write_table(pa.Table.from_pylist([make_row("1", answer="3")], schema=SCHEMA), tmp_path / "testmini-0.parquet")
    import grpo.model.load
    import grpo.model.prompts

    monkeypatch.setattr(grpo.model.load, "load_bundle", lambda *a, **k: pytest.fail("no model should load"))
    (tmp_path / "run").mkdir()
    rc = main(["A:best_structure", "--run-dir", str(tmp_path / "run"), "--data", str(tmp_path / "testmini-0.parquet"),
               "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and "names nothing" in err and "A: no checkpoints" in err


# ----------------------------------------------------------------------------- plots


def _log_lines():
    lines = []
    for phase, n in (("A", 10), ("B", 6)):
        for s in range(1, n + 1):
            lines.append(json.dumps({"phase": phase, "step": s, "reward": s / n,
                                     "components": {"format": 1.0, "correctness": s / n},
                                     "weights": {"format": 1.0, "correctness": 2.0 if phase == "A" else 4.0}}))
        lines.append(json.dumps({"event": "eval", "phase": phase, "step": n,
                                 "metrics": {"exact_match": 0.3, "parseable_rate": 0.9, "composite": 0.5}}))
    lines.insert(5, json.dumps({"event": "gate", "phase": "A", "step": 5, "rule": "parseable_floor"}))
    lines += ["{not json", "[1, 2]", json.dumps({"event": "config", "step": 0, "phase": "A"})]
    return lines


def test_parse_log_places_phases_end_to_end():
    log = parse_log(_log_lines())
    assert log.phases == [("A", 0.0), ("B", 10.0)]
    assert [r["x"] for r in log.steps][9:11] == [10.0, 11.0]  # B's step 1 follows A's step 10
    assert [g["x"] for g in log.gates] == [5.0] and [e["x"] for e in log.evals] == [10.0, 16.0]
    assert log.skipped == 2 and len(log.steps) == 16  # the config event is neither plotted nor an error
    glob = parse_log([json.dumps({"phase": "A", "step": 1, "global_step": 41, "reward": 0})])
    assert glob.steps[0]["x"] == 41.0


def test_plot_run_writes_pngs_with_gate_markers(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join(_log_lines()))
    files = plot_run(path, tmp_path / "plots")
    assert [f.name for f in files] == ["rewards.png", "weights.png", "checkpoints.png"]
    for f in files:
        px = np.asarray(Image.open(f).convert("RGB"))
        assert px.shape[1] >= 800 and px.shape[0] >= 400
        blue = [int(PALETTE[0][i:i + 2], 16) for i in (1, 3, 5)]
        assert (px == blue).all(-1).sum() > 100  # the first series' line (and legend swatch)
        assert (px.sum(-1) < 100).sum() > 1000  # black axes, ticks and text
    gate_rgb = [int(GATE_COLOR[i:i + 2], 16) for i in (1, 3, 5)]
    no_gate = tmp_path / "nogate.jsonl"
    no_gate.write_text("\n".join(line for line in _log_lines() if '"gate"' not in line))
    plain = plot_run(no_gate, tmp_path / "plain")[1]

    def gate_pixels(f):
        return (np.asarray(Image.open(f).convert("RGB")) == gate_rgb).all(-1).sum()

    assert gate_pixels(files[1]) - gate_pixels(plain) > 40  # the triangle (and its rule label) is drawn
    with pytest.raises(ValueError, match="no step or eval lines"):
        empty = tmp_path / "empty.jsonl"
        empty.write_text("garbage\n")
        plot_run(empty, tmp_path)


def test_plot_panels_draws_solid_and_dashed_series_with_named_ticks(tmp_path):
    from eval.plots import PanelSpec, Series, _dashes, plot_panels

    solid = Series("run", [0, 1, 2, 3], [0.1, 0.2, 0.3, 0.4], PALETTE[0])
    dashed = Series("control", [0, 1, 2, 3], [0.4, 0.3, 0.2, 0.1], PALETTE[1], dash=True)
    specs = [PanelSpec("curves", "reward", [solid, dashed], phases=[("A", 0.0), ("B", 2.0)]),
             PanelSpec("per checkpoint", "EM", [solid], xlabel="checkpoint", y_include=(0.0, 1.0),
                       xtick_labels={0: "warm-up", 1: "A", 2: "B best", 3: "B last"})]
    f = plot_panels(specs, tmp_path / "fig.png")
    px = np.asarray(Image.open(f).convert("RGB"))
    assert px.shape == (2 * (300 + 90) + 20, 1100, 3)
    rgb = [int(PALETTE[1][i:i + 2], 16) for i in (1, 3, 5)]
    assert (px == rgb).all(-1).sum() > 50  # the dashed control is drawn
    pieces = _dashes([(0.0, 0.0), (30.0, 0.0)])  # 9 px on, 6 off: 0-9, 15-24
    assert pieces == [((0.0, 0.0), (9.0, 0.0)), ((15.0, 0.0), (24.0, 0.0))]
    with pytest.raises(ValueError, match="at least one PanelSpec"):
        plot_panels([], tmp_path / "none.png")


def test_no_nan_leaks_into_flat_metrics(tiny_run):
    assert all(not math.isnan(v) for v in evaluate_completions(*tiny_run, max_new_tokens=30).flat().values())

"""Own data: the three formats, the column map, the pseudo-stage all, the held-out test rows,
MathVista's convert command, the contamination warning, and each bad input as one line."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_mathvista import ROWS, SCHEMA, make_row, meta
from train_helpers import log_lines, run_main

from data.holdout import TEST_EVERY, shared_pids, split_test
from data.mixture import MixtureStream
from data.rows import SkipRow, example_from_row, infer_answer_type
from data.sources import load_source
from data.stages import select_stage
from data.synthetic import generate

ROOT = Path(__file__).resolve().parent.parent
QUICK = ["--phase", "A", "--model.device", "cpu", "--phase.steps", "2", "--run.eval_every", "2", "--run.eval_size", "2",
         "--sampling.G", "2", "--sampling.max_new_tokens", "8", "--phase.prompts_per_step", "2",
         "--run.test_per_stage", "1"]
FALLBACK = "has MathVista metadata (context, skills) for the stage filters; phase A trains on every usable row"


def minimal_rows(n=40):
    """n synthetic stage-1 questions as bare {pid, question, answer, image} rows + their PIL images."""
    return [({"pid": f"q{i}", "question": ex.question, "answer": ex.answer, "image": f"img/q{i}.png"}, ex.image)
            for i, ex in enumerate(generate("train", 1, n, seed=0))]


@pytest.fixture(scope="module")
def minimal_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("minimal")
    (root / "img").mkdir()
    lines = []
    for row, image in minimal_rows():
        image.save(root / row["image"])
        lines.append(json.dumps(row))
    (root / "data.jsonl").write_text("\n".join(lines) + "\n")
    return root


def one_line_error(rc, err, text):
    assert rc == 2 and err.startswith("error: ") and text in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


# ----------------------------------------------------------------------------- rows and splits


def test_answer_type_inferred_from_the_gold():
    assert [infer_answer_type(a) for a in ("12", "-3", "1,000", "2.5", "1e3", "2.0")] == \
        ["integer", "integer", "integer", "float", "float", "float"]
    for bad in ("five", "", "3/4"):
        with pytest.raises(SkipRow, match="non_numeric_answer"):
            infer_answer_type(bad)
    ex = example_from_row({"pid": "1", "question": "q", "answer": "7"}, with_image=False)
    assert (ex.answer_type, ex.question_type, ex.metadata.get("language", "english")) == ("integer", "free_form", "english")
    stated = example_from_row({"pid": "1", "question": "q", "answer": "7", "answer_type": "float"}, with_image=False)
    assert stated.answer_type == "float"  # a stated type is kept


def test_test_rows_are_a_tenth_by_pid_hash_and_never_train():
    rows = [example_from_row({"pid": f"p{i}", "question": "q", "answer": str(i)}, with_image=False) for i in range(95)]
    rows.append(example_from_row({"pid": "p3", "question": "dup", "answer": "1"}, with_image=False))
    train, test = split_test(rows)
    assert len({ex.pid for ex in test}) == 96 // TEST_EVERY
    assert not {ex.pid for ex in train} & {ex.pid for ex in test} and len(train) + len(test) == 96
    again = split_test(list(reversed(rows)))[1]  # the row order does not move the test rows
    assert {ex.pid for ex in again} == {ex.pid for ex in test}
    assert shared_pids(["p0", "p1", "x"], rows[:3]) == 2


def test_all_is_a_stage_of_the_mixture_and_resumes_through_json():
    rows = [example_from_row({"pid": f"p{i}", "question": "q", "answer": str(i)}, with_image=False) for i in range(6)]
    rows.append(example_from_row({"pid": "t", "question": "q", "answer": "x", "answer_type": "text"}, with_image=False))
    assert [ex.pid for ex in select_stage(rows, "all")] == [f"p{i}" for i in range(6)]  # numeric rows, any metadata
    stream = MixtureStream({"all": rows[:6]}, {"all": 1.0}, seed=1)
    stream.next_batch(5)
    state = json.loads(json.dumps(stream.state_dict()))
    other = MixtureStream({"all": rows[:6]}, {"all": 1.0}, seed=1)
    other.load_state_dict(state)
    assert [ex.pid for ex in other.next_batch(4)] == [ex.pid for ex in stream.next_batch(4)]


# ----------------------------------------------------------------------------- formats


def test_parquet_with_plain_columns_and_image_bytes(tmp_path):
    rows = []
    for row, image in minimal_rows(6):
        path = tmp_path / f"{row['pid']}.png"
        image.save(path)
        rows.append({"question": row["question"], "label": row["answer"],
                     "image": {"bytes": path.read_bytes(), "path": path.name}})
    rows[1]["image"] = {"bytes": None, "path": "q1.png"}  # a path next to the file
    rows[2]["label"] = "many"
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "own.parquet")
    examples, skipped = load_source(tmp_path / "own.parquet", {"answer": "label"})
    assert [ex.pid for ex in examples] == ["0", "1", "3", "4", "5"]  # no pid column: the row number
    assert skipped == {"non_numeric_answer": 1}
    assert examples[1].image.size == examples[0].image.size and examples[0].answer == rows[0]["label"]
    with pytest.raises(ValueError, match=r"--data.columns answer=nope: .*own.parquet has no column 'nope'; "
                                         r"its columns: image, label, question"):
        load_source(tmp_path / "own.parquet", {"answer": "nope"})


def test_minimal_jsonl_trains_with_one_command(minimal_dir, tmp_path, capsys):
    run = tmp_path / "run"
    rc, out, err = run_main(run, *QUICK, "--run.data", str(minimal_dir))
    assert rc == 0, err
    assert out.count(FALLBACK) == 1
    assert json.loads((run / "config_A.json").read_text())["phase"]["mixture"] == {"all": 1.0}
    assert [r["step"] for r in log_lines(run) if "loss" in r] == [1, 2]
    report = json.loads((run / "report" / "report.json").read_text())
    assert "held-out test rows" in json.dumps(report) and "[test] base" in out
    # the report's rows are the held-out tenth, which no phase trained on
    from grpo.overrides import from_json
    from grpo.run.phase_data import load_training_data, report_examples

    cfg = from_json((run / "config_A.json").read_text())
    test, _ = report_examples(cfg)
    train, val = load_training_data(cfg)
    assert len(test) == 3 and not {ex.pid for ex in test} & {ex.pid for ex in train["all"] + val["all"]}
    # evaluating the run on its own data: one warning with the count (the held-out rows do not count)
    from data.sources import load_source as load
    from grpo.evaluation.evaluate import warn_contamination

    everything, _ = load(minimal_dir)
    capsys.readouterr()
    assert warn_contamination(run, everything) == 40 - 4  # 40 // 10 rows were held out
    assert capsys.readouterr().out == f"warning: 36 of 40 evaluation prompts have a pid that {run} trained on " \
                                      f"({minimal_dir}): their scores are not held-out scores\n"
    assert warn_contamination(run, test) == 0 and capsys.readouterr().out == ""


def test_datasets_directory_with_other_columns_trains_with_the_map(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = minimal_rows(20)
    data = datasets.Dataset.from_dict(
        {"id": [r["pid"] for r, _ in rows], "query": [r["question"] for r, _ in rows],
         "label": [r["answer"] for r, _ in rows], "img": [im for _, im in rows]},
        features=datasets.Features({"id": datasets.Value("string"), "query": datasets.Value("string"),
                                    "label": datasets.Value("string"), "img": datasets.Image()}))
    data.save_to_disk(str(tmp_path / "hf"))
    run = tmp_path / "run"
    args = [*QUICK, "--run.data", str(tmp_path / "hf"), "--phase.steps", "1", "--run.test_per_stage", "0"]
    rc, out, err = run_main(run, *args, "--data.columns", "question=query,answer=label,image=img,pid=id")
    assert rc == 0, err
    assert FALLBACK in out and [r["step"] for r in log_lines(run) if "loss" in r] == [1]
    rc, _, err = run_main(tmp_path / "run2", *args, "--data.columns", "question=query,answer=answer_text")
    one_line_error(rc, err, "--data.columns answer=answer_text: ")
    assert "has no column 'answer_text'; its columns: id, img, label, query" in err


# ----------------------------------------------------------------------------- several images a prompt


def several_image_rows(n=24):
    """n rows, every third of one image, the rest of two (TRL's ``images`` list): (row, images)."""
    pics = [ex.image for ex in generate("train", 1, 2 * n, seed=1)]
    out = []
    for i, (row, image) in enumerate(minimal_rows(n)):
        images = [image] if i % 3 == 0 else [image, pics[i]]
        out.append(({k: v for k, v in row.items() if k != "image"}, images))
    return out


def write_images_jsonl(root: Path, rows) -> None:
    (root / "img").mkdir(parents=True)
    lines = []
    for row, images in rows:
        names = [f"img/{row['pid']}-{k}.png" for k in range(len(images))]
        for name, image in zip(names, images):
            image.save(root / name)
        lines.append(json.dumps(dict(row, images=names)))
    (root / "data.jsonl").write_text("\n".join(lines) + "\n")


def test_an_images_list_reads_in_every_format_and_its_bad_lengths_are_counted(tmp_path):
    rows = several_image_rows(6)
    rows.append(({"pid": "none", "question": "q", "answer": "1"}, []))
    rows.append(({"pid": "five", "question": "q", "answer": "1"}, rows[0][1] * 5))
    write_images_jsonl(tmp_path / "jsonl", rows)
    examples, skipped = load_source(tmp_path / "jsonl")
    assert skipped == {"empty_images": 1, "too_many_images": 1}
    assert [len(ex.prompt_images) for ex in examples] == [1, 2, 2, 1, 2, 2]
    assert examples[1].image is examples[1].images[0] and examples[0].images is None  # a list of one: one image
    assert examples[1].images[1].tobytes() == rows[1][1][1].tobytes()
    _, skipped = load_source(tmp_path / "jsonl", max_images=6)
    assert skipped == {"empty_images": 1}
    # parquet: a list column of {bytes, path} structs (what datasets writes for a Sequence of Image)
    table = []
    for row, images in rows:
        structs = []
        for k, image in enumerate(images):
            image.save(tmp_path / "x.png")
            structs.append({"bytes": (tmp_path / "x.png").read_bytes(), "path": f"{k}.png"})
        table.append(dict(row, images=structs))
    pq.write_table(pa.Table.from_pylist(table), tmp_path / "own.parquet")
    from_parquet, skipped = load_source(tmp_path / "own.parquet")
    assert skipped == {"empty_images": 1, "too_many_images": 1}
    assert [len(ex.prompt_images) for ex in from_parquet] == [1, 2, 2, 1, 2, 2]
    # save_jsonl writes a several-image example as an images list and reads back the same
    from data.jsonl import save_jsonl

    save_jsonl(examples, tmp_path / "again")
    back, skipped = load_source(tmp_path / "again")
    assert not skipped and [len(ex.prompt_images) for ex in back] == [1, 2, 2, 1, 2, 2]
    assert back[4].images[1].tobytes() == examples[4].images[1].tobytes()
    datasets = pytest.importorskip("datasets")
    hf = datasets.Dataset.from_dict({"question": [r["question"] for r, _ in rows[:6]],
                                     "answer": [r["answer"] for r, _ in rows[:6]], "images": [im for _, im in rows[:6]]},
                                    features=datasets.Features({"question": datasets.Value("string"),
                                                                "answer": datasets.Value("string"),
                                                                "images": datasets.Sequence(datasets.Image())}))
    hf.save_to_disk(str(tmp_path / "hf"))
    from_hf, skipped = load_source(tmp_path / "hf")
    assert not skipped and [len(ex.prompt_images) for ex in from_hf] == [1, 2, 2, 1, 2, 2]


def test_rows_of_two_images_beside_rows_of_one_train_with_one_command(tmp_path):
    """Mixed prompts in every draw, the checkpoint evaluation and its shuffled-image control,
    and the report; a row over --data.max_images is skipped and counted, and data whose
    every row is over it is one line naming the option."""
    rows = several_image_rows()
    rows.append(({"pid": "three", "question": "q", "answer": "1"}, rows[0][1] + rows[1][1]))  # 3 images
    write_images_jsonl(tmp_path / "data", rows)
    run = tmp_path / "run"
    rc, out, err = run_main(run, *QUICK, "--run.data", str(tmp_path / "data"), "--data.max_images", "2")
    assert rc == 0, err
    assert "data: 1 rows of" in out and "(too_many_images 1; a row may show --data.max_images=2 images" in out
    steps = [r for r in log_lines(run) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2] and any(r["prompts"]["visual_tokens_max"] == 32 for r in steps)
    assert "[test] base" in out and (run / "report" / "report.json").is_file()
    from grpo.errors import ConfigError
    from grpo.overrides import apply_overrides
    from grpo.presets import phase_preset
    from grpo.run.phase_data import load_own_data

    write_images_jsonl(tmp_path / "pairs", [r for r in rows if len(r[1]) == 2])
    cfg = apply_overrides(phase_preset("A"), {"run.data": str(tmp_path / "pairs"), "data.max_images": "1"}).validate()
    with pytest.raises(ConfigError, match=r"has no usable rows: 16 skipped \(too_many_images 16; a row may show "
                                          r"--data.max_images=1 images: raise it to train on more\)$"):
        load_own_data(cfg)
    rc, _, err = run_main(tmp_path / "run3", *QUICK, "--run.data", str(tmp_path / "data"), "--data.max_images", "0")
    one_line_error(rc, err, "data.max_images=0: must be >= 1")


def test_evaluate_reads_a_set_of_several_images_under_its_own_bound(tmp_path, capsys):
    """python -m grpo.evaluate --data DIR: --max-images as the trainer's --data.max_images
    (a row over it skipped and counted); below 1 it is one line."""
    from eval.inputs import load_examples
    from grpo.evaluation.evaluate import build_parser, main

    rows = several_image_rows(6)
    rows.append(({"pid": "three", "question": "q", "answer": "1"}, rows[0][1] + rows[1][1]))  # 3 images
    write_images_jsonl(tmp_path / "data", rows)
    args = build_parser().parse_args(["--data", str(tmp_path / "data"), "--subset", "all"])
    examples, _, skipped = load_examples(args)
    assert not skipped and [len(ex.prompt_images) for ex in examples] == [1, 2, 2, 1, 2, 2, 3]
    args.max_images = 2
    examples, _, skipped = load_examples(args)
    assert skipped == {"too_many_images": 1} and len(examples) == 6
    assert main(["--data", str(tmp_path / "data"), "--max-images", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--max-images 0: must be >= 1" in err


# ----------------------------------------------------------------------------- bad inputs


def test_no_numeric_gold_is_one_line(tmp_path):
    (tmp_path / "data").mkdir()
    lines = []
    for row, image in minimal_rows(5):
        image.save(tmp_path / "data" / "x.png")
        lines.append(json.dumps(dict(row, answer="a red circle", image="x.png")))
    (tmp_path / "data" / "data.jsonl").write_text("\n".join(lines))
    rc, _, err = run_main(tmp_path / "run", *QUICK, "--run.data", str(tmp_path / "data"))
    one_line_error(rc, err, "has no usable rows: 5 skipped (non_numeric_answer 5), 0 kept and none has a numeric "
                            "gold answer")
    assert not (tmp_path / "run" / "A").exists()


def test_column_map_naming_an_unknown_field_is_one_line(tmp_path, minimal_dir):
    rc, _, err = run_main(tmp_path / "run", *QUICK, "--run.data", str(minimal_dir), "--data.columns", "answr=label")
    one_line_error(rc, err, "data.columns names the field 'answr', which no row has: fields are pid, question")
    rc, _, err = run_main(tmp_path / "run", *QUICK, "--run.data", str(minimal_dir), "--data.columns", "answer=label")
    one_line_error(rc, err, "--data.columns answer=label: ")
    assert "data.jsonl has no column 'label'; its columns: answer, image, pid, question" in err


def test_a_stage_mixture_on_data_without_metadata_says_to_use_all(tmp_path, minimal_dir):
    rc, _, err = run_main(tmp_path / "run", *QUICK, "--run.data", str(minimal_dir), "--phase.mixture", "2=1")
    one_line_error(rc, err, "stage 2 has no training examples")
    assert "use --phase.mixture all=1.0" in err


# ----------------------------------------------------------------------------- MathVista convert


@pytest.fixture(scope="module")
def mathvista_parquet(tmp_path_factory):
    """The MathVista fixture's layout: 24 stage-1 rows, 6 stage-2 charts, and rows skipped or left out."""
    root = tmp_path_factory.mktemp("mv")
    rows = [make_row(str(i), answer=str(i % 7)) for i in range(24)]
    rows += [make_row(f"c{i}", answer=f"{i}.5", answer_type="float", metadata=meta("bar chart", ["statistical reasoning"]))
             for i in range(6)]
    rows += [make_row("m", answer="B", question_type="multi_choice", answer_type="text", choices=["A", "B"]),
             make_row("f", answer="five"), make_row("k", decoded_image={"bytes": b"\x89PNG no", "path": "k.png"})]
    path = root / "testmini.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), path)
    return path


def convert(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "data.mathvista", "convert", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_mathvista_converts_and_trains(mathvista_parquet, tmp_path):
    out = tmp_path / "mv"
    proc = convert(mathvista_parquet, out)
    assert proc.returncode == 0, proc.stderr
    assert f"read 33 rows of {mathvista_parquet} (split testmini); skipped 2: corrupt_image 1, non_numeric_answer 1" \
        in proc.stdout
    assert "numeric subset: 30 rows (1 loaded rows are multi-choice" in proc.stdout
    assert "stage filters: stage1 24, stage2 6, stage3 0" in proc.stdout
    assert len((out / "data.jsonl").read_text().splitlines()) == 30 and len(list((out / "images").iterdir())) == 30
    assert [p.name for p in tmp_path.iterdir()] == ["mv"]  # no temporary directory left
    run = tmp_path / "run"
    rc, stdout, err = run_main(run, *QUICK, "--run.data", str(out), "--run.test_per_stage", "0", "--phase.steps", "1")
    assert rc == 0, err
    assert "MathVista metadata" not in stdout  # the stage filters apply
    assert json.loads((run / "config_A.json").read_text())["phase"]["mixture"] == {"1": 1.0}


def test_convert_refuses_a_non_empty_out_and_says_so_in_help(mathvista_parquet, tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    proc = convert(mathvista_parquet, tmp_path / "full")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == f"error: {tmp_path / 'full'} exists and is not an empty directory: name a new " \
                                  "directory (convert never writes into existing data)"
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    helped = convert("--help")
    assert helped.returncode == 0 and "numeric subset" in helped.stdout and "130 / 143" in helped.stdout


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_convert_stopped_mid_write_leaves_nothing(mathvista_parquet, tmp_path, monkeypatch, capsys, signum, code):
    import data.jsonl
    from data.mathvista import convert as run_convert

    real = data.jsonl.save_jsonl

    def write_then_signal(examples, directory):
        real(examples[:3], directory)  # some files are on disk when the signal lands
        os.kill(os.getpid(), signum)

    monkeypatch.setattr(data.jsonl, "save_jsonl", write_then_signal)
    handlers = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    assert run_convert(str(mathvista_parquet), tmp_path / "out") == code
    err = capsys.readouterr().err
    assert err.strip() == f"convert stopped on {signal.Signals(signum).name}; nothing was written to {tmp_path / 'out'}"
    assert list(tmp_path.iterdir()) == []  # neither OUT nor the temporary directory
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers


def test_convert_reads_the_hub_layout_and_a_datasets_directory(tmp_path, capsys):
    from data.mathvista import convert as run_convert

    hub_dir = tmp_path / "MathVista"  # tests/test_mathvista.py's fixture rows in the hub's layout
    (hub_dir / "data").mkdir(parents=True)
    (hub_dir / "images").mkdir()
    generate("train", 1, 1, seed=0)[0].image.save(hub_dir / "images" / "12.png")
    rows = [make_row(pid, **over) for pid, over in ROWS.items()]
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), hub_dir / "data" / "testmini-00000-of-00001.parquet")

    assert run_convert(str(hub_dir), tmp_path / "hub") == 0
    out = capsys.readouterr().out
    assert "skipped 5: corrupt_image 1, missing_image 1, non_numeric_answer 1, unknown_answer_type 1, " \
           "unknown_language 1" in out
    assert "numeric subset: 5 rows" in out and "stage filters: stage1 3, stage2 3, stage3 1" in out
    written, _ = load_source(tmp_path / "hub")
    assert sorted(ex.pid for ex in written) == ["1", "12", "2", "3", "4"]
    assert written[0].metadata["context"] and written[0].image is not None  # metadata kept: the stages apply

    datasets = pytest.importorskip("datasets")
    rows = minimal_rows(4)
    datasets.Dataset.from_dict({"q": [r["question"] for r, _ in rows], "answer": ["3", "2.5", "x", "4"],
                                "image": [im for _, im in rows]},
                               features=datasets.Features({"q": datasets.Value("string"), "answer": datasets.Value("string"),
                                                           "image": datasets.Image()})).save_to_disk(str(tmp_path / "hf"))
    assert run_convert(str(tmp_path / "hf"), tmp_path / "from_hf", columns={"question": "q"}) == 0
    out = capsys.readouterr().out
    assert "read 4 rows" in out and "skipped 1: non_numeric_answer 1" in out and "numeric subset: 3 rows" in out
    assert [(ex.pid, ex.answer_type) for ex in load_source(tmp_path / "from_hf")[0]] == \
        [("0", "integer"), ("1", "float"), ("3", "integer")]


def test_stage_all_parses_and_a_datasets_directory_without_the_package_is_one_line(tmp_path, monkeypatch):
    from grpo.errors import ConfigError
    from grpo.overrides import apply_overrides
    from grpo.presets import phase_preset

    cfg = apply_overrides(phase_preset("A"), {"phase.mixture": "1=0.5,all=0.5", "run.data": "x"}).validate()
    assert cfg.phase.mixture == {1: 0.5, "all": 0.5}
    with pytest.raises(ConfigError, match="expected name=value"):
        apply_overrides(phase_preset("A"), {"phase.mixture": "every=1"})
    for marker in ("dataset_info.json", "state.json"):
        (tmp_path / marker).write_text("{}")
    monkeypatch.setitem(sys.modules, "datasets", None)  # what an environment without the package imports
    with pytest.raises(ValueError, match=r"was written by datasets' save_to_disk, and reading it needs the datasets "
                                         r"package: pip install 'datasets>=3'"):
        load_source(tmp_path)


@pytest.mark.parametrize("n,extra,text", [
    (1, [], "has 1 usable rows, too few for the end-of-run report"),
    (1, ["--run.test_per_stage", "0"], "has 1 training rows, too few for the checkpoint evaluation"),
])
def test_too_few_rows_for_the_held_out_rows_is_one_line(tmp_path, n, extra, text):
    root = tmp_path / "few"
    (root / "img").mkdir(parents=True)
    lines = []
    for row, image in minimal_rows(n):
        image.save(root / row["image"])
        lines.append(json.dumps(row))
    (root / "data.jsonl").write_text("\n".join(lines) + "\n")
    rc, _, err = run_main(tmp_path / "run", *QUICK, "--run.data", str(root), *extra)
    one_line_error(rc, err, text)

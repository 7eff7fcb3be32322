"""Layers point one way and nothing imports in a circle.

The order is kernels, lora < data < eval < grpo < bench: a package may import its own
modules and those of lower layers only (kernels and lora share the bottom and import
neither each other). Every import statement counts, the lazy ones inside functions too:
a lazy import hides an upward dependency from a reader, it does not remove it. Read with
ast, so nothing is executed (and no model or torch is needed).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYER = {"kernels": 0, "lora": 0, "data": 1, "eval": 2, "grpo": 3, "bench": 4}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _project_modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in LAYER for p in sorted((ROOT / pkg).rglob("*.py"))}


def _imported(node: ast.AST) -> list[str]:
    """Dotted names an import statement may load (``from a.b import c``: a.b and a.b.c)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return []


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its body."""
    modules = _project_modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _imported(node):
                while target and target not in modules:  # `from grpo.model.load import X`: X is a name
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_layers_point_one_way():
    upward = []
    for src, targets in import_graph().items():
        for dst in targets:
            a, b = src.split(".")[0], dst.split(".")[0]
            if a != b and LAYER[b] >= LAYER[a]:
                upward.append(f"{src} -> {dst}")
    assert not upward, "imports against the layer order kernels, lora < data < eval < grpo < bench: " + \
        ", ".join(sorted(upward))


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_eval_imports_nothing_from_grpo():
    graph = import_graph()
    assert not [(m, t) for m, ts in graph.items() if m.startswith("eval") for t in ts if t.startswith("grpo")]


def test_the_walker_sees_lazy_imports_and_cycles():
    graph = import_graph()
    assert "grpo.rollout.sampler" in graph["grpo.model_eval"]  # a module-top import
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    lazy = ast.parse("def f():\n    from grpo.model.load import load_bundle\n")
    assert [t for n in ast.walk(lazy) for t in _imported(n)] == ["grpo.model.load", "grpo.model.load.load_bundle"]


# Inside grpo: sub-packages by concept. Each may import grpo.config, grpo.errors and
# grpo.batches (which import nothing else of grpo, but config reads batches' rule) and the units listed here, nothing else of grpo; the rest of
# grpo's top level (train, cli, evaluate, final_report, pretrain, distributed) is the harness and
# the commands, which may import anything below them. grpo.step is the algorithm: it knows
# nothing of checkpoints, processes, evaluation or the command line.
GRPO_BASE = {"grpo.config", "grpo.errors", "grpo.batches"}
GRPO_ALLOWED = {
    "grpo.config": {"grpo.batches"},
    "grpo.batches": set(),  # the levels of a step's batch: the partition rule, the loss share
    "grpo.errors": set(),
    "grpo.run": set(),  # files, log records, progress, schedule, guard, stops, prefetch, phase data
    "grpo.rewards": set(),  # the reward terms
    "grpo.controller": set(),  # the metric-gated reward-weight controller
    "grpo.state": {"grpo.run"},  # checkpoints and the training state
    "grpo.model": {"grpo.state"},  # loading, prompts, the policy, log-probs
    "grpo.rollout": {"grpo.model"},  # sampling
    "grpo.step": {"grpo.model", "grpo.rewards", "grpo.rollout", "grpo.run"},  # one GRPO step
    "grpo.warmup": {"grpo.model", "grpo.run", "grpo.state", "grpo.model_eval"},  # the SFT warm-up
}


def _grpo_unit(module: str) -> str:
    """grpo.<sub-package or top-level module> a module belongs to."""
    return ".".join(module.split(".")[:2])


def test_grpo_sub_packages_point_one_way():
    graph = import_graph()
    units = {_grpo_unit(m) for m in graph if m.startswith("grpo.")}
    assert {"grpo.run", "grpo.state", "grpo.model", "grpo.rollout", "grpo.warmup", "grpo.rewards"} <= units
    bad = []
    for src, targets in graph.items():
        unit = _grpo_unit(src)
        if unit not in GRPO_ALLOWED:
            continue
        allowed = GRPO_ALLOWED[unit] | ({unit} if unit in GRPO_BASE else GRPO_BASE | {unit})
        bad += [f"{src} -> {dst}" for dst in targets
                if dst.startswith("grpo.") and _grpo_unit(dst) not in allowed]
    assert not bad, "imports against grpo's sub-package order: " + ", ".join(sorted(bad))


def test_the_step_core_stays_small_and_plain():
    """The file a learner reads first: one GRPO step in at most 320 lines (300 before the training
    micro-batches), with no harness in it."""
    step = ROOT / "grpo" / "step.py"
    assert len(step.read_text().splitlines()) <= 320
    harness = {"grpo.distributed", "grpo.state", "grpo.evaluate", "grpo.model_eval", "grpo.train", "grpo.cli", "grpo.run.stop",
               "grpo.run.guard", "grpo.run.files"}
    assert not {t for t in import_graph()["grpo.step"] if t in harness or _grpo_unit(t) in harness}


# What each file of the README's reading path must hold inside the ranges it names, and what
# must stay outside them (the fast paths a first read skips).
READING_ANCHORS = {
    "grpo/step.py": (["def grpo_step(", "def advantage_source(", "def sample_and_score("], []),
    "grpo/rollout/sampler.py": (["def sample_token(", "def decode_n_tokens(", "def sample("], []),
    "kernels/grpo_advantages.py": (["class AdvantageSource:", "class Advantages:", "def group_zscore_reference(", "def group_advantages("],
                                   ["@triton.jit"]),
    "grpo/model/logprobs.py": (["def completion_logprobs(", "def reference_logprobs("], []),
    "kernels/grpo_loss.py": (["class LossOptions:", "def grpo_loss_reference(", "pg_t       = -min("], ["@triton.jit"]),
}


def test_the_readme_reading_path_is_true_and_short():
    """The README's "How one GRPO step runs" table: at most 5 files and 1,200 lines, every
    range inside its file, each file's line count the sum of its ranges, the stated total
    right, the named functions inside the ranges and the Triton kernels outside them."""
    import re

    text = (ROOT / "README.md").read_text()
    section = text[text.index("## How one GRPO step runs"):]
    section = section[:section.index("\n## ", 4)]
    rows = re.findall(r"^\| \d \| (\S+) \| ([\d, -]+) \| (\d+) \|", section, re.M)
    assert 1 <= len(rows) <= 5
    total = 0
    for path, ranges, count in rows:
        lines = (ROOT / path).read_text().splitlines()
        spans = [tuple(int(x) for x in r.split("-")) for r in ranges.split(", ")]
        assert all(1 <= a <= b <= len(lines) for a, b in spans), (path, spans, len(lines))
        # every range is a whole block: blank (or nothing) just before it and just after it
        assert all((a == 1 or not lines[a - 2].strip()) and (b == len(lines) or not lines[b].strip())
                   for a, b in spans), (path, spans)
        assert sum(b - a + 1 for a, b in spans) == int(count), path
        read = "\n".join(line for a, b in spans for line in lines[a - 1:b])
        must, must_not = READING_ANCHORS[path]
        assert all(m in read for m in must) and not any(m in read for m in must_not), path
        total += int(count)
    assert total <= 1200
    assert f"{total:,} lines" in section

"""Layers point one way and nothing imports in a circle.

The order is grpo_infra, grpo_kernels, lora < data < eval < grpo < bench: a package may import
its own modules and those of lower layers only (grpo_infra, grpo_kernels and lora share the
bottom and import none of each other). Every import statement counts, the lazy ones inside functions too:
a lazy import hides an upward dependency from a reader, it does not remove it. Read with
ast, so nothing is executed (and no model or torch is needed).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYER = {"grpo_infra": 0, "grpo_kernels": 0, "lora": 0, "data": 1, "eval": 2, "grpo": 3, "bench": 4}


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
    assert not upward, "imports against the layer order grpo_infra, grpo_kernels, lora < data < eval < grpo < bench: " + \
        ", ".join(sorted(upward))


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_eval_imports_nothing_from_grpo():
    graph = import_graph()
    assert not [(m, t) for m, ts in graph.items() if m.startswith("eval") for t in ts if t.split(".")[0] == "grpo"]


def test_the_walker_sees_lazy_imports_and_cycles():
    graph = import_graph()
    assert "grpo.rollout.sampler" in graph["grpo.evaluation.model_eval"]  # a module-top import
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    lazy = ast.parse("def f():\n    from grpo.model.load import load_bundle\n")
    assert [t for n in ast.walk(lazy) for t in _imported(n)] == ["grpo.model.load", "grpo.model.load.load_bundle"]


# Inside grpo: sub-packages by concept. Each may import the configuration (grpo.config and
# beside it grpo.config_checks, grpo.overrides, grpo.presets), grpo.errors and grpo.batches
# (which import only each other, downwards) and the units listed here, nothing else of grpo; the rest of
# grpo's top level (train, cli, evaluate, evaluation, pretrain, distributed) is the harness and
# the commands, which may import anything below them. grpo.step is the algorithm: it knows
# nothing of checkpoints, processes, evaluation or the command line.
GRPO_BASE = {"grpo.config", "grpo.config_checks", "grpo.overrides", "grpo.presets", "grpo.errors", "grpo.batches"}
GRPO_ALLOWED = {
    "grpo.config_checks": {"grpo.batches", "grpo.errors"},  # what a config may hold (config imports it)
    "grpo.config": {"grpo.config_checks"},
    "grpo.overrides": {"grpo.config", "grpo.errors"},
    "grpo.presets": {"grpo.config", "grpo.config_checks", "grpo.overrides", "grpo.errors"},
    "grpo.batches": set(),  # the levels of a step's batch: the partition rule, the loss share
    "grpo.errors": set(),
    "grpo.run": set(),  # files, log records, progress, schedule, guard, stops, prefetch, phase data
    "grpo.rewards": set(),  # the reward terms
    "grpo.controller": set(),  # the metric-gated reward-weight controller
    "grpo.state": {"grpo.run"},  # checkpoints and the training state
    "grpo.model": {"grpo.state"},  # loading, prompts, the policy, log-probs
    "grpo.rollout": {"grpo.model"},  # sampling
    "grpo.step": {"grpo.model", "grpo.rewards", "grpo.rollout", "grpo.run"},  # one GRPO step
    "grpo.warmup": {"grpo.model", "grpo.run", "grpo.state", "grpo.evaluation"},  # the SFT warm-up
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
    harness = {"grpo.distributed", "grpo.state", "grpo.evaluate", "grpo.evaluation", "grpo.train", "grpo.cli", "grpo.run.stop",
               "grpo.run.guard", "grpo.run.files"}
    assert not {t for t in import_graph()["grpo.step"] if t in harness or _grpo_unit(t) in harness}


# ----------------------------------------------------------------------------- the reading path

# The files of the README's reading path, in its order: grpo/step.py and the path files it imports from.
PATH_FILES = ("grpo/step.py", "grpo/batches.py", "grpo/rollout/sampler.py", "grpo_kernels/grpo_advantages.py",
              "grpo/model/logprobs.py", "grpo_kernels/grpo_loss.py")
# What the harness (grpo/train.py) hands or calls in grpo/step.py: the step, its draw, its two objects.
PATH_ENTRIES = ("grpo_step", "sample_and_score", "Learner", "Hooks")
PATH_CAP = 1000
RANGES_CAP, FILE_RANGES_CAP = 12, 3  # the path in few pieces


class _Unit:
    """One top-level def, class or assignment of a path file, or one method of a class in it."""

    def __init__(self, path: str, name: str, node: ast.AST, text: list[str], owner: str | None = None):
        self.path, self.name, self.node, self.owner = path, name, node, owner
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        own = set(range(start, node.end_lineno + 1))
        if isinstance(node, ast.ClassDef):  # a class owns its fields and docstring, not its methods' lines
            for m in node.body:
                if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    own -= set(range(min([m.lineno] + [d.lineno for d in m.decorator_list]), m.end_lineno + 1))
        self.lines = {i for i in own if text[i - 1].strip()}  # its non-blank lines
        text = ast.unparse(node)
        self.triton = ("triton" in name.lower() or name.startswith("_Fused") or "tl.constexpr(" in text[:200]
                       or any("triton" in ast.unparse(d) for d in getattr(node, "decorator_list", [])))

    def __repr__(self) -> str:
        return f"{self.path}:{self.name} (lines {min(self.lines)}-{max(self.lines)})"


def _path_units(sources: dict[str, str]) -> tuple[dict, dict]:
    """(path -> {name: _Unit}, path -> {local name: (module, name)}) of every path file."""
    units, imports = {}, {}
    for path, text in sources.items():
        u, imp = units.setdefault(path, {}), imports.setdefault(path, {})
        lines = text.splitlines()
        for n in ast.parse(text).body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                u[n.name] = _Unit(path, n.name, n, lines)
                for m in n.body if isinstance(n, ast.ClassDef) else []:
                    if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        u[f"{n.name}.{m.name}"] = _Unit(path, f"{n.name}.{m.name}", m, lines, owner=n.name)
            elif isinstance(n, (ast.Assign, ast.AnnAssign)):
                for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
                    if isinstance(t, ast.Name) and t.id != "__all__":
                        u[t.id] = _Unit(path, t.id, n, lines)
            elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
                imp.update({a.asname or a.name: (n.module, a.name) for a in n.names})
    return units, imports


def _refs(node: ast.AST) -> tuple[set[str], set[str], set[tuple[str, str]]]:
    """(names loaded, attributes read, (name, attribute) pairs) in node's code: its body,
    decorators, defaults and a class's field types; not a function's annotations (types the
    code never calls) and not the methods of a class (units of their own)."""
    names, attrs, pairs = set(), set(), set()

    def walk(n: ast.AST, in_class: bool) -> None:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for c in n.decorator_list + n.args.defaults + [d for d in n.args.kw_defaults if d is not None] + n.body:
                walk(c, False)
        elif isinstance(n, ast.ClassDef):
            for c in n.decorator_list + n.bases:
                walk(c, False)
            for c in n.body:
                if not isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    walk(c, True)
        elif isinstance(n, ast.AnnAssign):
            for c in [n.value] + ([n.annotation] if in_class else []):  # a field's type: data the code holds
                if c is not None:
                    walk(c, in_class)
        else:
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
                names.add(n.id)
            elif isinstance(n, ast.Attribute):
                attrs.add(n.attr)
                if isinstance(n.value, ast.Name):
                    pairs.add((n.value.id, n.attr))
            elif isinstance(n, ast.Constant) and isinstance(n.value, str) and in_class:
                names.update(n.value.replace("|", " ").split())  # a field type written as a string
            for c in ast.iter_child_nodes(n):
                walk(c, in_class)

    walk(node, isinstance(node, ast.ClassDef))
    return names, attrs, pairs


def _resolve(units: dict, imports: dict, path: str, name: str) -> "_Unit | None":
    """The path unit ``name`` means in ``path``: its own, or one imported from another path file."""
    seen = set()
    while (path, name) not in seen:
        seen.add((path, name))
        if name in units[path]:
            return units[path][name]
        module, orig = imports[path].get(name, (None, None))
        target = module and module.replace(".", "/") + ".py"
        if target not in units:
            return None
        path, name = target, orig
    return None


def _reached(units: dict, imports: dict) -> dict[tuple[str, str], _Unit]:
    """The plain path's code the step runs: the static call graph from PATH_ENTRIES."""
    todo = [units["grpo/step.py"][e] for e in PATH_ENTRIES]
    done, attrs = {}, set()
    while todo:
        while todo:
            u = todo.pop()
            if (u.path, u.name) in done or u.triton:
                continue
            done[(u.path, u.name)] = u
            if u.owner:
                todo.append(units[u.path][u.owner])
            names, a, _ = _refs(u.node)
            attrs |= a
            todo += [t for t in (_resolve(units, imports, u.path, nm) for nm in names) if t is not None]
        todo = [u for file in units.values() for u in file.values()
                if u.owner and (u.path, u.owner) in done and (u.path, u.name) not in done
                and (u.name.split(".")[1] in attrs or u.name.split(".")[1].startswith("__"))]
    return done


def _autograd_function(cls: _Unit) -> bool:
    """A torch.autograd.Function: autograd calls its forward / backward, not the step (step.py's
    ``loss.backward()`` is the tensor's method, not ``_EntropyWithGrad.backward``)."""
    return any(ast.unparse(b).endswith("autograd.Function") for b in getattr(cls.node, "bases", []))


def _direct(units: dict, imports: dict, reached: dict) -> set[_Unit]:
    """What grpo/step.py calls directly in the path files: every unit of its own; every name it
    loads that resolves through its imports to a path unit; ``Cls.method`` of such a class;
    and the methods of a reached class whose name step.py reads as an attribute
    (``r.out.loss_mask(...)``: SampleOutput.loss_mask; not an autograd.Function's), with the
    class each method sits in."""
    step = "grpo/step.py"
    names, attrs, pairs = _refs(ast.parse("\n".join(ast.unparse(u.node) for u in units[step].values()
                                                     if not u.owner)))
    found = {u for u in units[step].values()}
    found |= {t for t in (_resolve(units, imports, step, n) for n in names) if t is not None}
    for n, a in pairs:
        cls = _resolve(units, imports, step, n)
        if cls is not None and f"{cls.name}.{a}" in units[cls.path]:
            found.add(units[cls.path][f"{cls.name}.{a}"])
    found |= {u for u in reached.values() if u.owner and u.path != step and u.name.split(".")[1] in attrs
              and not u.name.split(".")[1].startswith("__") and not _autograd_function(units[u.path][u.owner])}
    return found | {units[u.path][u.owner] for u in found if u.owner}


def reading_path_problems(table: list[tuple[str, str, str]], sources: dict[str, str], stated_total: str) -> list[str]:
    """What is untrue in the README's reading path ``table`` of (file, ranges, line count) rows
    against ``sources`` (path -> text):

    - the files are PATH_FILES in order; every range "a-b" lies inside its file and is a whole
      block (blank or nothing just before and just after it); each row's count is the sum of
      its ranges; the total is at most PATH_CAP and is the one the README states; at most
      RANGES_CAP ranges in all and FILE_RANGES_CAP in one file;
    - (a) everything grpo/step.py calls directly in the path files (``_direct``) lies inside
      the read ranges; its callees' callees may sit outside, reached through the named function;
    - (b) nothing inside the read ranges is code the trainer's plain path never runs: every
      def, class, method or top-level assignment whose lines meet a range is in ``_reached``,
      the static call graph from PATH_ENTRIES in grpo/step.py. What counts as reached: a name
      the reached code loads, resolved through its file's imports (path files only); the class
      of a reached method; a reached class's fields' types; a method of a reached class that is
      a dunder or whose name the reached code reads as an attribute (``x.loss_mask``). Triton
      code (a @triton.jit or *triton* function, the autograd.Function around it, tl.constexpr
      constants) is never followed: it is the fast path a first read skips. Imports, comments
      and docstrings between units may sit in a range.
    """
    problems = []
    if [path for path, _, _ in table] != list(PATH_FILES):
        return [f"the table's files {[p for p, _, _ in table]} are not {list(PATH_FILES)}"]
    units, imports = _path_units(sources)
    read: dict[str, set[int]] = {}
    total = 0
    for path, ranges, count in table:
        lines = sources[path].splitlines()
        spans = [tuple(int(x) for x in r.split("-")) for r in ranges.split(", ")]
        for a, b in spans:
            if not 1 <= a <= b <= len(lines):
                problems.append(f"{path}: range {a}-{b} is outside its {len(lines)} lines")
            elif not ((a == 1 or not lines[a - 2].strip()) and (b == len(lines) or not lines[b].strip())):
                problems.append(f"{path}: range {a}-{b} is not a whole block (no blank line around it)")
        if sum(b - a + 1 for a, b in spans) != int(count):
            problems.append(f"{path}: {count} lines stated, its ranges hold {sum(b - a + 1 for a, b in spans)}")
        read[path] = {i for a, b in spans for i in range(a, b + 1)}
        total += int(count)
    if total > PATH_CAP or stated_total != f"{total:,}":
        problems.append(f"the path is {total:,} lines (the README says {stated_total}; the cap is {PATH_CAP:,})")
    pieces = {path: len(ranges.split(", ")) for path, ranges, _ in table}
    if sum(pieces.values()) > RANGES_CAP or max(pieces.values()) > FILE_RANGES_CAP:
        problems.append(f"the path is in {sum(pieces.values())} ranges, {max(pieces.values())} in one file "
                        f"(caps: {RANGES_CAP}, {FILE_RANGES_CAP} a file)")
    reached = _reached(units, imports)
    direct = sorted(_direct(units, imports, reached), key=repr)
    problems += [f"step.py calls {u} directly, outside the read lines" for u in direct if not u.lines <= read[u.path]]
    problems += [f"{u} is read but the step never runs it" for file in units.values() for u in file.values()
                 if u.lines & read[u.path] and (u.path, u.name) not in reached]
    return problems


def _readme_path() -> tuple[list[tuple[str, str, str]], str]:
    import re

    text = (ROOT / "README.md").read_text()
    section = text[text.index("## How one GRPO step runs"):]
    section = section[:section.index("\n## ", 4)]
    table = re.findall(r"^\| \d \| (\S+) \| ([\d, -]+) \| (\d+) \|", section, re.M)
    stated = re.search(r"in this order: ([\d,]+) lines", section)
    return table, stated.group(1) if stated else "?"


def test_the_readme_reading_path_is_true_and_short():
    """The README's "How one GRPO step runs" table against the code (``reading_path_problems``)."""
    table, stated = _readme_path()
    sources = {path: (ROOT / path).read_text() for path in PATH_FILES}
    assert reading_path_problems(table, sources, stated) == []


def test_the_reading_path_check_fails_where_it_should():
    """The check above catches a range cut short, a new direct call outside the ranges and a
    range grown over code the step never runs (each on a copy of the README's table)."""
    table, stated = _readme_path()
    sources = {path: (ROOT / path).read_text() for path in PATH_FILES}

    def problems(row: int, ranges: str, **edit: str) -> list[str]:
        t = [list(r) for r in table]
        old = [tuple(int(x) for x in r.split("-")) for r in t[row][1].split(", ")]
        new = [tuple(int(x) for x in r.split("-")) for r in ranges.split(", ")]
        t[row][1] = ranges
        t[row][2] = str(int(t[row][2]) + sum(b - a + 1 for a, b in new) - sum(b - a + 1 for a, b in old))
        total = sum(int(r[2]) for r in t)
        return reading_path_problems([tuple(r) for r in t], {**sources, **edit}, f"{total:,}")

    step_rows, batch_rows = table[0][1], table[1][1]
    step = sources["grpo/step.py"].splitlines()
    last = next(i for i, line in enumerate(step, 1) if line.startswith("def batch_stats(")) - 1
    while not step[last - 1].strip():
        last -= 1
    cut = problems(0, f"1-{last}")  # the step read up to batch_stats, not through it
    assert any("batch_stats" in p and "directly" in p for p in cut), cut
    # a direct call of a path function the ranges skip (a sampler helper)
    call = "    filter_logits(None, 0, 1.0)\n    return result\n"
    called = sources["grpo/step.py"].replace("    return result\n", call, 1)
    called = called.replace("sampler import Rollout,", "sampler import Rollout, filter_logits,")
    assert any("filter_logits" in p for p in problems(0, step_rows, **{"grpo/step.py": called}))
    # batches.py read whole: its config helpers are code the step never runs
    n = len(sources["grpo/batches.py"].splitlines())
    grown = problems(1, f"1-{n}")
    assert any("micro_batch_rows_fit" in p and "never runs" in p for p in grown), grown
    assert problems(1, batch_rows) == []


# What the path's prose says of other files, checked where a machine can: a file it names
# exists, a ``name`` it places in a file is defined there, and a module a comment says
# "reads" a constant imports it.
_FILE = r"\b(?:grpo|grpo_kernels|lora|data|eval|bench|docs|tests)/[\w/]+\.(?:py|md)\b"


def _defines(path: Path, name: str) -> bool:
    """Whether ``path`` defines ``name`` (or ``Cls.method``) at its top level."""
    tree = ast.parse(path.read_text())
    head, _, method = name.partition(".")
    for n in tree.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == head:
            return not method or any(getattr(m, "name", None) == method for m in n.body)
        if isinstance(n, (ast.Assign, ast.AnnAssign)) and not method:
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            if any(isinstance(t, ast.Name) and t.id == head for t in targets):
                return True
    return False


def prose_problems(path: str, text: str, root: Path = ROOT) -> list[str]:
    """What ``text`` (the source of ``path``) says of other files that is not so."""
    import re

    problems = []
    for m in re.finditer(rf"({_FILE})(?: ``([\w.]+)``)?", text):
        target = root / m.group(1)
        if not target.exists():
            problems.append(f"{path} names {m.group(1)}, which does not exist")
        elif m.group(2) and target.suffix == ".py" and not _defines(target, m.group(2)):
            problems.append(f"{path} places ``{m.group(2)}`` in {m.group(1)}, which does not define it")
    module = path.removesuffix(".py").replace("/", ".")
    for line in text.splitlines():
        assigned = re.match(r"^([A-Z_][A-Z0-9_]*) = .*#(.*)\bread(?:s)? it\b", line)
        if not assigned:
            continue
        for reader in re.findall(_FILE, assigned.group(2)):
            tree = ast.parse((root / reader).read_text())
            if not any(isinstance(n, ast.ImportFrom) and n.module == module and
                       assigned.group(1) in [a.name for a in n.names] for n in ast.walk(tree)):
                problems.append(f"{path}: {reader} is said to read {assigned.group(1)} but does not import it")
    return problems


def test_the_path_says_true_things_of_other_files():
    assert [p for path in PATH_FILES for p in prose_problems(path, (ROOT / path).read_text())] == []


def test_the_prose_check_fails_where_it_should():
    loss = "grpo_kernels/grpo_loss.py"
    text = (ROOT / loss).read_text()
    wrong = text.replace("grpo/batches.py read it", "grpo/distributed.py read it", 1)
    assert any("distributed.py is said to read LOSS_TYPES" in p for p in prose_problems(loss, wrong))
    assert any("does not exist" in p for p in prose_problems(loss, "see grpo/nowhere.py"))
    assert any("does not define" in p for p in prose_problems(loss, "grpo/step.py ``no_such_name``"))

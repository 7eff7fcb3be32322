"""Where a trained policy misreads: its wrong answers on the synthetic test split, by what the question needs.

    python -m bench.misreads RUN_DIR [RUN_DIR ...] [--model B:latest]

Reads each run's end-of-run report (``RUN_DIR/report/samples_<model>.jsonl``: one greedy answer
a test figure) and regenerates every test example from its pid (data/synthetic.py's
``syn-test-s<stage>-<seed>-<index>``), so the readings each question needs (its
``intermediates``: "red circles: 1", "purple bar: 8", ...) are known.

A *misread* is an answer that parses, is wrong, follows its own reasoning (``answer_follows``)
and whose every equation is right (``arithmetic_right`` true, or no equation to check): the
reasoning did the right sums on the wrong numbers (or on the wrong plan). Each is charged to
one quantity, the first of the example's intermediates that the reasoning gets wrong:

    by name    the reasoning writes "<name>: <number>" (the curriculum's own phrasing; for a
               computed quantity the number after the clause's last "=", as in "full
               rectangle: 5 x 3 = 15") with another number than the gold's;
    by value   else, the first intermediate whose gold value is not among the reasoning's
               numbers (a reasoning that names things differently);
    plan       every intermediate's value is there: the numbers were read right and combined
               wrongly, or the question was misunderstood.

Printed: the misread share over all answers, and the misreads by stage, by family, by
(family, quantity) with that quantity's misread rate over the answers that needed it, and by
the figure's object count (its drawn marks). Pair it with ``python -m bench.tower_probe
--quantities N``: a quantity misread often that the probe cannot read is the tower's limit.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

from data.contract import is_exact, normalize_number, parse_response
from data.schema import Example
from eval.reasoning import NUMBER

PID = re.compile(r"^syn-test-s(?P<stage>[123])-(?P<seed>\d+)-(?P<index>\d+)$")


def test_examples(pids: list[str]) -> dict[str, Example]:
    """pid -> the synthetic test example it names (each (stage, seed) generated once, up to its largest index)."""
    from data.synthetic import generate

    wanted: dict[tuple[int, int], int] = {}
    for pid in pids:
        m = PID.match(pid)
        if m is None:
            raise ValueError(f"pid {pid!r} is not a synthetic test figure (syn-test-s<stage>-<seed>-<index>): "
                             "bench.misreads reads runs on the synthetic curriculum")
        key = (int(m["stage"]), int(m["seed"]))
        wanted[key] = max(wanted.get(key, 0), int(m["index"]) + 1)
    return {ex.pid: ex for (stage, seed), n in wanted.items() for ex in generate("test", stage, n, seed)}


def is_misread(record: dict) -> bool:
    return (bool(record.get("parseable")) and not record.get("exact") and record.get("answer_follows") is True
            and record.get("arithmetic_right") is not False)


def misread_quantity(text: str, example: Example) -> tuple[str, str]:
    """(the quantity a misread answer got wrong, how it was found: name | value | plan)."""
    reasoning = (parse_response(text).reasoning or "").lower()
    items = list(example.intermediates or [])
    for item in items:
        written = _written_value(reasoning, item.name.lower())
        if written is not None and not is_exact(written, item.value):
            return item.name, "name"
    numbers = {normalize_number(n) for n in NUMBER.findall(reasoning)}
    for item in items:
        if normalize_number(item.value) not in numbers:
            return item.name, "value"
    return "(plan)", "plan"


def _written_value(reasoning: str, name: str) -> str | None:
    """The number a reasoning gives for "<name>: ..." up to the clause's end: after its last "="
    where the clause computes it ("full rectangle: 5 x 3 = 15" -> 15), else its first number."""
    m = re.search(re.escape(name) + r"\s*:(.*?)(?:[.;](?=\s|$)|$)", reasoning)
    if m is None:
        return None
    clause = m.group(1)
    found = NUMBER.findall(clause[clause.rfind("=") + 1:] if "=" in clause else clause)
    return found[0] if found else None


def breakdown(records: list[dict], examples: dict[str, Example]) -> dict:
    """Counters of answers and misreads by stage, family, (family, quantity) and object count."""
    answers, misreads = Counter(), Counter()
    needed, how = Counter(), Counter()
    for r in records:
        ex = examples[r["pid"]]
        family, stage, marks = ex.metadata["family"], ex.metadata["stage"], len(ex.marks or [])
        keys = [("stage", stage), ("family", family), ("objects", marks), ("all", "")]
        answers.update(keys)
        needed.update((family, item.name) for item in ex.intermediates or [])
        if is_misread(r):
            quantity, found = misread_quantity(r["text"], ex)
            misreads.update(keys + [("quantity", (family, quantity))])
            how[found] += 1
    return {"answers": answers, "misreads": misreads, "needed": needed, "how": how}


def report(b: dict) -> str:
    answers, misreads, needed = b["answers"], b["misreads"], b["needed"]
    total, miss = answers[("all", "")], misreads[("all", "")]
    lines = [f"misread: {miss} of {total} answers ({miss / max(1, total):.1%}); charged by name "
             f"{b['how']['name']}, by value {b['how']['value']}, plan {b['how']['plan']}"]
    for kind, title in (("stage", "stage"), ("family", "family"), ("objects", "objects drawn")):
        lines.append(f"\n{title:<16} {'answers':>7} {'misread':>7} {'share':>6}")
        for (k, v), n in sorted((k, n) for k, n in answers.items() if k[0] == kind):
            lines.append(f"{str(v):<16} {n:>7} {misreads[(k, v)]:>7} {misreads[(k, v)] / n:>6.1%}")
    lines.append(f"\n{'family':<14} {'quantity':<22} {'misread':>7} {'needed':>6} {'rate':>6}")
    for (family, quantity), n in sorted(((k[1], n) for k, n in misreads.items() if k[0] == "quantity"),
                                        key=lambda kn: -kn[1]):
        need = needed.get((family, quantity), 0)
        rate = f"{n / need:>6.1%}" if need else f"{'-':>6}"
        lines.append(f"{family:<14} {quantity[:22]:<22} {n:>7} {need:>6} {rate}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.misreads", description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories on the synthetic curriculum, with a report")
    ap.add_argument("--model", default="B:latest", help="the report's model whose answers to read (default B:latest)")
    a = ap.parse_args(argv)
    records = []
    for run in a.runs:
        path = run / "report" / f"samples_{a.model.replace(':', '_')}.jsonl"
        if not path.is_file():
            ap.error(f"{path} does not exist: run the phase to its end-of-run report (or name another --model)")
        records += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    try:
        examples = test_examples([r["pid"] for r in records])
    except ValueError as err:
        ap.error(str(err))
    print(report(breakdown(records, examples)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

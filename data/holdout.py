"""Own data's test rows, kept out of training, and the count of evaluation rows a run trained on.

The synthetic curriculum has its own test split (disjoint by content hash); a dataset given
with ``--run.data`` has one split only, so its test rows are chosen from it: a tenth of the
usable rows (at most TEST_MAX), the ones whose pid hashes lowest. A hash, not the file's
tail: a file sorted by source or difficulty would make its tail unlike the rest. The choice
depends on the pids alone -- not on the config, the row order or the phase -- so every phase
of a run, and a resume, hold out the same rows; a row sharing a test row's pid is held out too.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from data.schema import Example

TEST_EVERY = 10  # one usable row in ten is a test row
TEST_MAX = 500  # more would only slow the report: 500 rows give EM within about +-0.04


def _rank(pid: str) -> str:
    return hashlib.sha256(pid.encode("utf-8")).hexdigest()


def split_test(rows: list[Example]) -> tuple[list[Example], list[Example]]:
    """(rows to train on, test rows), each in input order (see the module doc)."""
    k = min(len(rows) // TEST_EVERY, TEST_MAX)
    test_pids = set(sorted({ex.pid for ex in rows}, key=_rank)[:k])
    return ([ex for ex in rows if ex.pid not in test_pids],
            [ex for ex in rows if ex.pid in test_pids])


def shared_pids(trained: Iterable[Example | str], evaluated: Iterable[Example]) -> int:
    """How many evaluated rows have a pid that also names a training row."""
    pids = {x if isinstance(x, str) else x.pid for x in trained}
    return sum(ex.pid in pids for ex in evaluated)

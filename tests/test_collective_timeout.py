"""A collective that waits too long for a rank (grpo/collective_watchdog.py) ends every rank with one line.

Two real gloo ranks (this file run as a script, RANK / WORLD_SIZE / MASTER_* set by hand, as
torchrun sets them): both meet at one all-reduce, then rank 1 sleeps (a hung rank) while
rank 0 enters the next one. Both must exit 1 within twice run.collective_timeout_s of rank 0
entering, each with one line on stderr naming rank 1 and no traceback. The watchdog's own
logic is checked first in one process, with an in-memory store shared by two watches.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist

from grpo.collective_watchdog import CollectiveWatch, late_ranks

TIMEOUT = 4.0  # run.collective_timeout_s of the two-rank run
SLEEP = 60.0  # the hung rank's sleep: far longer than the timeout


def test_late_ranks_are_those_with_a_lower_count():
    assert late_ranks({0: 7, 1: 6, 2: 7, 3: 5}, 7) == [1, 3]
    assert late_ranks({0: 7, 1: 7}, 7) == []


def test_watch_names_the_rank_that_never_arrives_and_ends_both():
    store = dist.HashStore()
    ended: dict[int, str] = {}
    done = threading.Event()

    def end_of(rank):
        def end(message):
            ended[rank] = message
            if len(ended) == 2:
                done.set()
        return end

    watches = [CollectiveWatch(store, r, 2, timeout_s=0.3, poll_s=0.02, end=end_of(r)) for r in range(2)]
    try:
        with watches[1].collective("first"):  # both ranks pass collective 1...
            pass
        with watches[0].collective("first"):
            pass
        with watches[0].collective("all_reduce"):  # ...rank 0 waits in its second, rank 1 never comes
            assert done.wait(10.0), ended
    finally:
        for w in watches:
            w.close()
    assert ended[0] == ended[1]
    assert ended[0].startswith("rank 1 of 2 did not arrive at collective #"), ended[0]
    assert "(all_reduce)" in ended[0] and "run.collective_timeout_s" in ended[0]


def test_a_collective_broken_by_a_peer_that_ended_waits_for_the_line():
    # The first rank to end closes its connections, so the waiting rank's collective fails
    # ("connection closed by peer") before its own thread has printed the line. That failure
    # must wait for the thread (which ends the process) rather than escape as a traceback.
    store = dist.HashStore()
    ended: dict[int, str] = {}
    peer_ended = threading.Event()

    def end_of(rank):
        def end(message):
            ended[rank] = message
            if rank == 1:
                peer_ended.set()
        return end

    watches = [CollectiveWatch(store, r, 2, timeout_s=0.3, poll_s=0.02, end=end_of(r)) for r in range(2)]
    try:
        for w in watches:
            with w.collective("first"):
                pass
        try:
            with watches[0].collective("all_reduce"):
                assert peer_ended.wait(10.0), ended
                raise RuntimeError("Connection closed by peer")  # what gloo raises once rank 1 is gone
        except RuntimeError:
            escaped_with = dict(ended)
        else:
            raise AssertionError("the collective's error was swallowed")
    finally:
        for w in watches:
            w.close()
    assert 0 in escaped_with, "the collective's error escaped before rank 0's line (a traceback, not one line)"
    assert escaped_with[0] == escaped_with[1] and escaped_with[0].startswith("rank 1 of 2 did not arrive")


def test_a_collective_that_fails_on_its_own_raises_at_once():
    store = dist.HashStore()
    ended = []
    w = CollectiveWatch(store, 0, 1, timeout_s=5.0, poll_s=0.02, end=ended.append)
    try:
        t0 = time.monotonic()
        try:
            with w.collective("all_reduce"):
                raise RuntimeError("a real fault")
        except RuntimeError as e:
            assert str(e) == "a real fault"
        assert time.monotonic() - t0 < 1.0 and ended == []  # nothing was ending: no wait, no line
    finally:
        w.close()


def test_watch_stays_quiet_while_collectives_finish_in_time():
    store = dist.HashStore()
    ended = []
    w = CollectiveWatch(store, 0, 1, timeout_s=0.5, poll_s=0.02, end=ended.append)
    try:
        for _ in range(5):
            with w.collective("all_reduce"):
                time.sleep(0.05)
        time.sleep(0.6)  # idle between collectives is not waiting
    finally:
        w.close()
    assert ended == []


_EXIT_WITHOUT_CLOSE = """
import time
from torch.distributed import TCPStore
from grpo.collective_watchdog import CollectiveWatch
store = TCPStore("127.0.0.1", 0, 1, True)
CollectiveWatch(store, 0, 1, timeout_s=60.0, poll_s=0.0)  # poll 0: the thread is almost always in a store call
time.sleep(0.05)
"""


def test_a_process_that_ends_without_close_exits_cleanly():
    # Without the exit hook the thread is inside a TCPStore call while the interpreter finalises
    # and the C++ side aborts the process (-6, "terminate called without an active exception"):
    # 10 of 10 runs of this script did before the hook; a two-rank gloo script that never closed
    # its watch, 3 of 16 (how one run of tests/test_distributed.py failed).
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(repo))
    proc = subprocess.run([sys.executable, "-c", _EXIT_WITHOUT_CLOSE], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "terminate" not in proc.stderr, (proc.returncode, proc.stderr[-2000:])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_hung_rank_ends_every_rank_with_one_line(tmp_path):
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(repo), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()))
    env.pop("TRITON_INTERPRET", None)
    if sys.platform == "linux":  # gloo on loopback: the hostname may resolve to an unreachable address
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    procs, errs = [], []
    for rank in range(2):
        err = tmp_path / f"rank{rank}.err"
        errs.append(err)
        with err.open("w") as f:
            procs.append(subprocess.Popen([sys.executable, __file__, str(tmp_path)], cwd=repo, stderr=f,
                                          stdout=subprocess.DEVNULL,
                                          env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank))))
    ended = {}
    t_limit = time.time() + 120
    while len(ended) < 2 and time.time() < t_limit:
        for rank, p in enumerate(procs):
            if rank not in ended and p.poll() is not None:
                ended[rank] = time.time()
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
    assert len(ended) == 2, [e.read_text()[-2000:] for e in errs]
    entered = float((tmp_path / "entered0").read_text())  # rank 0 entering the collective rank 1 never reaches
    for rank, p in enumerate(procs):
        text = errs[rank].read_text()
        lines = [x for x in text.splitlines() if x.strip()]
        assert p.returncode == 1, (rank, p.returncode, text[-2000:])
        assert len(lines) == 1 and "Traceback" not in text, text[-2000:]
        assert lines[0].startswith("error: rank 1 of 2 did not arrive at collective #2 (all_reduce)"), lines[0]
        assert ended[rank] - entered < 2 * TIMEOUT, (rank, ended[rank] - entered)


def _worker(out: Path) -> None:
    from grpo.distributed import init_distributed

    dp = init_distributed("cpu", quiet=False, collective_timeout_s=TIMEOUT)
    assert dp.all_reduce_sum(1.0) == 2.0  # collective #1: both arrive
    if dp.rank == 1:
        time.sleep(SLEEP)  # hung: never reaches collective #2
    (out / "entered0").write_text(repr(time.time()))
    dp.all_reduce_sum(1.0)
    print("collective #2 returned", file=sys.stderr)  # never: the watchdog ends the process


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))

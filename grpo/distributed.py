"""Data-parallel GRPO over processes: ``torchrun --nproc_per_node W -m grpo.train ...``.

What is implemented
-------------------
Plain data parallelism on the existing engine, written out (no DDP wrapper, no FSDP).
Every process ("rank") holds the whole policy -- frozen (4-bit) base + LoRA -- and one GRPO
step of B prompts (``phase.prompts_per_step`` is the GLOBAL batch) is split over W ranks:

    prompts  every rank reads the same seeded stream and keeps positions r, r+W, r+2W, ...
             of the step's B prompts (B must be a multiple of W): the union over ranks is
             exactly the batch one process would take
    sample   G completions per kept prompt with the rank's own generator, seeded from
             (seed, rank); a group never straddles ranks, so group advantages stay local
    loss     each rank scales each micro-batch's loss to its *share* of the global loss (table
             below); the LoRA gradients are then SUMMED over ranks: one all-reduce of the
             flattened gradients (20M fp32 numbers = 80 MB for the 7B's rank-8 LoRA, about a
             millisecond over NVLink, so there is no bucketing or overlap with backward)
    step     identical summed gradients -> identical clipping and AdamW update everywhere:
             replicas stay equal with no weight broadcast (``check_replicas`` verifies it,
             exactly, at every checkpoint)
    log      rank 0 writes the log and checkpoints; logged statistics are averaged over
             ranks; other ranks' stdout is silenced (stderr, i.e. errors, is kept)
    eval     rank r greedy-decodes eval prompts r, r+W, ...; the completions are gathered so
             that every rank scores the same list: the controller must move the reward
             weights identically on every rank, or the ranks would train different objectives

Loss normalisation: why W ranks equal one process on the global batch
---------------------------------------------------------------------
Rank r's part of a rollout batch has n_r rows (completions) and m_r active tokens; N = sum_r n_r
and M = sum_r m_r are the global rollout batch's counts. ``grpo_kernels.grpo_loss`` returns the loss
of the rows it is given; the global loss is a weighted sum of those per-rank losses
(grpo/batches.py ``loss_share``, which also folds in the micro-batches and the accumulation;
``counts_over_ranks`` is its one all-reduce):

    loss_type  one process, global rollout batch       share of rank r (times its local loss)
    grpo       (1/N) sum_i (1/n_i) sum_t l_it           n_r / N
    dr_grpo    (1/(N L)) sum_it l_it                     n_r / N
    bnpo       (1/M) sum_it l_it                         m_r / M
    dapo       (1/M_step) sum_it l_it                    1, and the kernel is given M_step = the
                                                         active tokens of every rollout batch
                                                         of every rank (one all-reduce)

Summing the shared-out gradients over ranks then gives the gradient of the global loss.
adv_scale="batch" (one std over the whole rollout batch, TRL's option) would otherwise use each
rank's own std: ``global_batch_std`` computes the global std with two all-reduces, and the
advantage kernel, given it (``AdvantageSource.batch_std``), centres r / (std + eps) within
each group, which is the same advantage ((r - mean_g) / (std + eps) = r/(std + eps) - mean_g(r/(std + eps))).

What is exact and what is not
-----------------------------
- Exact in real arithmetic: given the same rollouts, the summed gradient equals a single
  process's gradient on the global micro-batch for all four loss types, both advantage scales
  and gradient accumulation. In floats the sums run in another order (and prompts are padded
  to another length), so results agree to ~1e-6 relative, not bit for bit. tests/
  test_distributed.py checks this with fixed rollouts, and checks that a naive average of
  per-rank losses would NOT match (so the check has teeth).
- Not the same draws: W ranks sample with W generators, a single process with one, so a
  W-rank run is a run on the same prompts with other random completions. Equality of whole
  training runs is therefore not claimed; equality of updates given rollouts is.
- Logged diagnostics (KL, clip fractions, lengths, reward) are means of per-rank means:
  exact when ranks hold equal row/token counts. The logged loss and grad norm are exact.
- The SFT warm-up is not data-parallel: rank 0 runs it while the others wait at a barrier
  (the process group is created with a 2-hour timeout for that reason; every other collective
  is watched: one that waits longer than run.collective_timeout_s for a rank ends every rank
  with one line naming it, grpo/collective_watchdog.py).

Backends: NCCL on GPUs (rank r uses cuda:LOCAL_RANK), gloo on CPUs. A run without torchrun's
environment (WORLD_SIZE unset or 1) gets a single-process ``DataParallel`` whose methods are
identities, so the trainer has one code path.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from grpo.collective_watchdog import CollectiveWatch
from grpo.errors import ConfigError
from grpo_kernels.grpo_advantages import batch_std


class DistributedError(ConfigError):
    """A distributed setting that cannot work; the message says which value and what to do."""


# ----------------------------------------------------------------------------- the pure parts


def shard_positions(n: int, rank: int, world: int) -> list[int]:
    """Positions of a batch of n that rank ``rank`` of ``world`` keeps: rank, rank+W, ..."""
    return list(range(rank, n, world))


def sampling_seed(seed: int, rank: int, world: int) -> int:
    """The rank's sampler seed. A single process keeps ``seed`` (runs stay reproducible
    against older single-process runs); with W > 1 every rank gets an independent stream
    derived from (seed, rank) by numpy's SeedSequence (not seed + rank, which would make
    rank 1 of seed 0 draw what rank 0 of seed 1 draws)."""
    if world == 1:
        return seed
    return int(np.random.SeedSequence([seed, rank]).generate_state(1, dtype=np.uint64)[0] >> 1)


# ----------------------------------------------------------------------------- the process group


@dataclass
class DataParallel:
    """This process's place in a data-parallel run; world 1 = a plain single process."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: str = "cpu"
    owns_group: bool = False  # we created the process group (so we destroy it)
    watch: Any = None  # the collective watchdog (grpo/collective_watchdog.py CollectiveWatch) of a data-parallel run

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that prints, logs and checkpoints."""
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1

    # -------------------------------------------------------------- batch and sampling

    def check_batch(self, B: int, adv_scale: str = "group", prefix_rubrics: bool = False,
                    dynamic_sampling: bool = False) -> None:
        """Refuse settings the split cannot honour, before any work is done."""
        if B % self.world != 0:
            raise DistributedError(
                f"phase.prompts_per_step={B} is the global batch and must split evenly over {self.world} "
                f"processes; use a multiple of {self.world} (e.g. {self.world * max(1, B // self.world)}) "
                f"or change --nproc_per_node")
        if self.enabled and prefix_rubrics and adv_scale == "batch":
            raise DistributedError(
                "optim.adv_scale='batch' with rewards.rubric_mode='prefix' is not supported across processes "
                "(the batch std of every rubric column would need gathering); use adv_scale group or none")
        if self.enabled and dynamic_sampling:
            raise DistributedError(
                f"sampling.dynamic_sampling is not supported across {self.world} processes (each rank would refill "
                "a different number of times and the ranks' data streams and micro-batches would part ways); "
                "run it in one process or set --sampling.dynamic_sampling false")

    def shard(self, examples: Sequence[Any]) -> list[Any]:
        """This rank's prompts of a global batch (positions rank, rank+W, ...)."""
        return [examples[i] for i in shard_positions(len(examples), self.rank, self.world)]

    def sampling_seed(self, seed: int) -> int:
        return sampling_seed(seed, self.rank, self.world)

    # -------------------------------------------------------------- loss normalisation

    def counts_over_ranks(self, counts: torch.Tensor) -> torch.Tensor:
        """(rows, active tokens) of each rollout batch [batches, 2] summed over ranks: one
        all-reduce gives what every loss share needs (grpo/batches.py ``loss_share``)."""
        return self._all_reduce(counts.clone())

    def global_batch_std(self, columns: torch.Tensor, std_floor: float = 0.0) -> torch.Tensor | None:
        """scale="batch"'s std of each reward column [N, C] over every rank's rows (float64,
        floored at std_floor; two all-reduces: the mean, then the squared deviations, which
        avoids the cancellation of a sum of squares); None in a single process, where the
        kernel takes the batch's own std. The advantage kernel then centres r / (std + eps)
        within each group: the same advantages as one process on the global batch (module doc)."""
        if not self.enabled:
            return None
        return batch_std(columns.double(), std_floor=std_floor, all_reduce=self._all_reduce)

    # -------------------------------------------------------------- collectives

    def _watched(self, name: str):
        """Every collective runs inside this: the watchdog times it (none in one process)."""
        return self.watch.collective(name) if self.watch is not None else contextlib.nullcontext()

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """In-place SUM all-reduce through this rank's device (NCCL needs CUDA tensors); returns x."""
        if not self.enabled:
            return x
        y = x.to(self.device)
        with self._watched("all_reduce"):
            dist.all_reduce(y, op=dist.ReduceOp.SUM)
        if y is not x:
            x.copy_(y.to(x.device))
        return x

    def all_reduce_sum(self, value: float) -> float:
        """Sum of a Python number over ranks (NaN anywhere -> NaN everywhere)."""
        return float(self._all_reduce(torch.tensor([value], dtype=torch.float64))[0])

    def all_reduce_gradients(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Sum the gradients of ``params`` over ranks, in place: one flat all-reduce per dtype.

        A rank whose loss was not finite skipped backward and may hold no gradient: it
        contributes zeros (the caller's NaN guard then skips the step on every rank).
        """
        if not self.enabled:
            return
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            by_dtype.setdefault(p.grad.dtype, []).append(p)
        for group in by_dtype.values():
            flat = torch.cat([p.grad.reshape(-1) for p in group])  # one copy: ~80 MB for the 7B's LoRA
            with self._watched("gradient all_reduce"):
                dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            for p, g in zip(group, flat.split([p.numel() for p in group])):
                p.grad.copy_(g.view_as(p.grad))

    def broadcast_parameters(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Start every rank from rank 0's values (seeded inits agree anyway; this makes sure)."""
        if not self.enabled:
            return
        with torch.no_grad(), self._watched("broadcast of rank 0's parameters"):
            for p in params:
                dist.broadcast(p.data, src=0)

    def check_replicas(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Raise if any parameter differs between ranks, bit for bit.

        Elementwise max and min over ranks are equal iff every rank holds the same value:
        two all-reduces of the flattened parameters, run at checkpoints only.
        """
        if not self.enabled:
            return
        with torch.no_grad():
            flat = torch.cat([p.detach().float().reshape(-1) for p in params])
            hi = flat.clone()
            with self._watched("replica check"):
                dist.all_reduce(hi, op=dist.ReduceOp.MAX)
                dist.all_reduce(flat, op=dist.ReduceOp.MIN)
            bad = int((hi != flat).sum())
        if bad:
            raise RuntimeError(f"rank {self.rank}: {bad} LoRA parameters differ between ranks; the replicas "
                               "drifted apart (a rank took a different step) -- this is a bug, please report it")

    def totals_over_ranks(self, counts: dict[str, int], maxima: Sequence[str] = ()) -> dict[str, int]:
        """Integer counts summed over ranks, the keys in ``maxima`` maxed instead (two small
        all-reduces): the totals of what every rank drew, where ``mean_over_ranks`` would
        pass ints through as rank 0's own."""
        if not self.enabled:
            return dict(counts)
        keys = list(counts)
        summed = self._all_reduce(torch.tensor([float(counts[k]) for k in keys], dtype=torch.float64))
        peak = torch.tensor([float(counts[k]) for k in keys], dtype=torch.float64, device=self.device)
        with self._watched("all_reduce max"):
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return {k: int(peak[i] if k in maxima else summed[i]) for i, k in enumerate(keys)}

    def mean_over_ranks(self, record: dict[str, Any]) -> dict[str, Any]:
        """The same dict with every float leaf averaged over ranks (nested dicts too).

        Strings, bools and None pass through; values that are equal on every rank (the
        learning rate, the weights, the global loss) come back unchanged up to rounding.
        """
        if not self.enabled:
            return record
        keys: list[tuple[str, ...]] = []

        def walk(d: dict, path: tuple[str, ...]) -> None:
            for k, v in d.items():
                if isinstance(v, dict):
                    walk(v, path + (k,))
                elif isinstance(v, float):  # ints (the step) and bools are the same on every rank
                    keys.append(path + (k,))

        walk(record, ())

        def get(path):
            d = record
            for k in path:
                d = d[k]
            return d

        vals = self._all_reduce(torch.tensor([float(get(p)) for p in keys], dtype=torch.float64)) / self.world
        out = _deep_copy_dicts(record)
        for path, v in zip(keys, vals.tolist()):
            d = out
            for k in path[:-1]:
                d = d[k]
            d[path[-1]] = v
        return out

    def gather_objects(self, obj: Any) -> list[Any]:
        """[obj of rank 0, obj of rank 1, ...] on every rank (pickled; small objects only)."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world
        with self._watched("all_gather_object"):
            dist.all_gather_object(out, obj)
        return out

    def from_main(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (pickled; small objects only), unwatched: rank 0 may be
        waiting for the run directory's lock (--lock-wait) first, so only the process group's
        2-hour timeout bounds it, as the patient barrier."""
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def agree(self, signum: int, due: bool) -> tuple[int, bool]:
        """(stop signal, periodic save due) combined over ranks at a step boundary: the largest
        signal number (0 = none) and whether any rank's clock is due -- one all-reduce MAX of
        two numbers per step, so a signal to any one rank stops every rank at the same step."""
        if not self.enabled:
            return signum, due
        flags = torch.tensor([float(signum), float(due)], dtype=torch.float64, device=self.device)
        with self._watched("step-boundary agreement"):
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return int(flags[0]), bool(flags[1])

    def lost_rank_message(self, err: BaseException, grace: float = 3.0) -> str:
        """One line for a collective that failed because a peer went away, naming the rank(s).

        gloo and NCCL name a peer's address, not its rank: every surviving rank answers a
        roll call in the process group's store (the torchrun agent's, which outlives the
        workers) and, after ``grace`` seconds, the ranks that did not answer are named.
        Without a reachable store the line says it could not tell which rank it was.
        """
        lost = None
        try:  # a private accessor: the process group keeps its store nowhere public
            from torch.distributed.distributed_c10d import _get_default_store

            store = _get_default_store()
            store.set(f"vlgrpo/alive/{self.rank}", "1")
            time.sleep(grace)
            lost = [r for r in range(self.world) if not store.check([f"vlgrpo/alive/{r}"])]
        except Exception:  # noqa: BLE001 -- the store went with the dead rank: say so below
            pass
        who = (f"rank {', '.join(map(str, lost))} of {self.world}" if lost
               else f"another rank of {self.world} (which one could not be told)")
        cause = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
        return (f"{who} died or stopped responding ({cause}); rank {self.rank} stopped too. Checkpoints up to the "
                "last one saved are intact: the same command resumes from it")

    def barrier(self, patient: bool = False) -> None:
        """Wait for every rank. ``patient``: not watched, bounded by the process group's
        2-hour timeout only (ranks > 0 waiting while rank 0 runs the warm-up)."""
        if not self.enabled:
            return
        with contextlib.nullcontext() if patient else self._watched("barrier"):
            dist.barrier()

    # -------------------------------------------------------------- checkpoint pieces

    @staticmethod
    def _rank_key(key: str, rank: int) -> str:
        return key if rank == 0 else f"{key}.rank{rank}"

    def generator_key(self, key: str) -> str:
        """Checkpoint key of this rank's sampler generator state (rank 0 keeps ``key``)."""
        return self._rank_key(key, self.rank)

    def generator_states(self, key: str, gen: torch.Generator) -> dict[str, torch.Tensor]:
        """{key: rank 0's state, key.rank1: rank 1's, ...}: what rank 0 saves, so a resumed
        W-rank run draws what a straight one draws (a collective: call it on every rank)."""
        states = self.gather_objects(gen.get_state())
        return {self._rank_key(key, r): s for r, s in enumerate(states)}

    # -------------------------------------------------------------- evaluation

    def evaluate(self, bundle: Any, examples: Sequence[Any], protocol: Any) -> Any:
        """grpo.evaluation.model_eval.evaluate_model, with each sampling pass split over ranks and the
        completions gathered: every rank returns the same EvalResult (control included).

        Each rank decodes its share in batches seeded like evaluate_model's (seed + batch
        start within the share): greedy results equal a single process's; sampled ones
        (temperature > 0) are other draws.
        """
        from grpo.evaluation.model_eval import evaluate_model, sample_completions

        if not self.enabled:
            return evaluate_model(bundle, examples, protocol)

        def sharded_pass(bundle, examples, protocol):
            mine = shard_positions(len(examples), self.rank, self.world)
            texts, counts = sample_completions(bundle, [examples[i] for i in mine], protocol)
            completions: list[list[str]] = [[] for _ in examples]
            token_counts: list[list[int]] = [[] for _ in examples]
            for positions, (t, c) in self.gather_objects((mine, (texts, counts))):
                for k, i in enumerate(positions):
                    completions[i], token_counts[i] = t[k], c[k]
            return completions, token_counts

        return evaluate_model(bundle, examples, protocol, sample_pass=sharded_pass)

    def close(self) -> None:
        """Stop the watchdog; destroy the process group if this object created it."""
        if self.watch is not None:
            self.watch.close()
            self.watch = None
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_group = False


def peer_lost(err: BaseException) -> bool:
    """Whether a collective failed because another rank went away (its connection closed)."""
    if isinstance(err, getattr(dist, "DistBackendError", ())):
        return True
    text = str(err).lower()
    return any(s in text for s in ("connection closed by peer", "connection reset by peer", "broken pipe",
                                   "connection refused", "socket closed", "nccl communicator was aborted"))


def _deep_copy_dicts(d: dict) -> dict:
    return {k: _deep_copy_dicts(v) if isinstance(v, dict) else v for k, v in d.items()}


def init_distributed(device: str, quiet: bool = True, collective_timeout_s: float = 300.0) -> DataParallel:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*).

    Without those variables (or WORLD_SIZE=1): a single-process DataParallel on ``device``.
    With them: NCCL and cuda:LOCAL_RANK when ``device`` is a CUDA device, gloo otherwise,
    and the collective watchdog (grpo/collective_watchdog.py) with ``collective_timeout_s``.
    ``quiet``: silence stdout on ranks > 0 (every rank runs the same prints).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DataParallel(device=device)
    try:
        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    except KeyError as e:
        raise DistributedError(f"WORLD_SIZE={world} but {e.args[0]} is not set; launch with "
                               "`torchrun --nproc_per_node N -m grpo.train ...`") from None
    if device.startswith("cuda"):
        n_gpus = torch.cuda.device_count()
        if local_rank >= n_gpus:
            raise DistributedError(f"LOCAL_RANK={local_rank} but this machine has {n_gpus} CUDA device(s); "
                                   f"use --nproc_per_node {n_gpus} or fewer")
        device, backend = f"cuda:{local_rank}", "nccl"
        torch.cuda.set_device(local_rank)
    else:
        backend = "gloo"
    owns = False
    if not dist.is_initialized():
        # 2 hours: ranks > 0 wait at a barrier while rank 0 runs the (not data-parallel) warm-up;
        # every other collective is bounded by run.collective_timeout_s (the watchdog).
        extra = {"device_id": torch.device(device)} if backend == "nccl" else {}
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(hours=2), **extra)
        owns = True
    if quiet and rank != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 -- lives as long as the process
    from torch.distributed.distributed_c10d import _get_default_store  # private: the group keeps its store nowhere public

    watch = CollectiveWatch(_get_default_store(), rank, world, collective_timeout_s)
    return DataParallel(rank=rank, world=world, local_rank=local_rank, device=device, owns_group=owns, watch=watch)

"""Data-parallel GRPO (grpo/distributed.py) with 2 gloo processes on the CPU.

What is compared, exactly:

1. Updates given fixed rollouts. Both ranks build the same tiny policy (seeded, non-zero
   LoRA), hold the SAME global batch of rollouts (4 prompts x G=2, fixed token ids that differ
   between the rows of a group, ragged masks so ranks hold different token counts, and fixed
   rewards with spread), and each keeps its share of the prompts. Nothing in the batch comes
   from a random draw, so every run on every CPU tests the same numbers. The step the trainer
   runs -- loss shares, global dapo count, batch-std advantages, gradient all-reduce -- is
   compared with one process computing the same loss on the whole global batch: loss and LoRA
   gradients must agree to float rounding for grpo, bnpo, dr_grpo and dapo, with accumulation
   and the batch std. Rounding is measured against what the sums add up (n float32 eps times
   the magnitude summed, ``tolerances``), not against the result, which cancels. A naive
   average of per-rank losses (what plain DDP averaging would give) must miss by a thousand
   such tolerances for bnpo / dapo / batch std, so the comparison can fail. The same for
   per-component advantages (optim.adv_mode components: one batch std per column, over ranks)
   with a std floor (optim.adv_std_floor). After an AdamW step the replicas must be
   bit-identical, and the replica check must catch a perturbed rank.
2. The trainer end to end: ``grpo.train.main`` in both processes (exactly what
   ``torchrun -m grpo.train`` runs: torchrun only sets the environment): a 2-step warm-up
   on rank 0 while rank 1 waits, then phase A from it, 3 steps, 2 prompts per rank, G=2,
   8 new tokens, eval on 4 prompts split 2/2, with the tests' text-dependent reward bonus
   (tests/train_helpers.py) so that groups have a spread. It must finish (the trainer
   checks replica equality, bit for bit, before every checkpoint), rank 0 alone must write
   one log line per step, and the checkpoint must hold the gathered eval and both ranks'
   sampler generators. Then phase B from it with two optimiser steps per rollout batch
   (optim.updates_per_batch 2): the replica check at its checkpoint must pass after six
   updates. Whole runs are NOT compared with a single process: each rank samples
   with its own generator, so the completions are other draws (see grpo/distributed.py).

Both parts run in ONE torchrun launch of this file as a script (import costs dominate);
the pytest functions below assert on what the two ranks wrote.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo.batches import loss_share
from grpo.distributed import DataParallel, DistributedError, sampling_seed, shard_positions

G, L = 2, 8
EPS32 = torch.finfo(torch.float32).eps
CASES = [  # (loss_type, adv_scale, accumulation, beta)
    ("grpo", "group", 1, 0.0),
    ("bnpo", "group", 1, 0.04),
    ("dr_grpo", "group", 1, 0.0),
    ("dapo", "group", 2, 0.0),
    ("bnpo", "batch", 2, 0.0),
    ("grpo", "batch", 1, 0.0),
]
# per-component advantages with the batch std over ranks and a std floor that binds on one column:
# (loss_type, adv_scale, accumulation, beta, adv_std_floor)
COMPONENT_CASES = [("bnpo", "batch", 2, 0.0, 0.9), ("grpo", "group", 1, 0.0, 0.9)]
MICRO_CASES = [("grpo", "group"), ("bnpo", "group"), ("dapo", "batch")]  # training micro-batches: (loss_type, adv_scale)
TRAIN_ARGS = ["--phase", "A", "--model.name", "tiny-random",  # rank 0 runs the from-scratch warm-up, then A on 2 ranks
              "--warmup.phase.steps", "2", "--warmup.phase.perception_steps", "2", "--warmup.phase.prompts_per_step", "4",
              "--model.device", "cpu", "--run.train_per_stage", "16",
              "--run.eval_size", "4", "--sampling.G", "2", "--sampling.max_new_tokens", "8",
              "--phase.prompts_per_step", "4", "--phase.steps", "3", "--run.eval_every", "3",
              "--run.test_per_stage", "0"]


# ----------------------------------------------------------------------------- pure parts (no processes)


def test_shares_sum_to_one_and_match_the_table():
    rows, tokens = [3, 5], [10.0, 30.0]
    for loss_type in ("grpo", "dr_grpo", "bnpo"):
        s = [loss_share(loss_type, n, m, sum(rows), sum(tokens), 1) for n, m in zip(rows, tokens)]
        assert sum(s) == pytest.approx(1.0)
    assert loss_share("bnpo", 3, 10.0, 8, 40.0, 1) == pytest.approx(0.25)
    assert loss_share("grpo", 3, 10.0, 8, 40.0, 1) == pytest.approx(3 / 8)
    assert loss_share("dapo", 3, 10.0, 8, 40.0, 2) == 1.0  # the kernel gets the global count instead
    with pytest.raises(ValueError, match="loss_type='mean'"):
        loss_share("mean", 1, 1, 1, 1, 1)


def test_shards_partition_the_batch_and_seeds_differ():
    assert sorted(shard_positions(8, 0, 2) + shard_positions(8, 1, 2)) == list(range(8))
    assert shard_positions(6, 2, 3) == [2, 5]
    assert sampling_seed(7, 0, 1) == 7  # one process: the configured seed, as before
    seeds = {sampling_seed(7, r, 4) for r in range(4)} | {sampling_seed(8, r, 4) for r in range(4)}
    assert len(seeds) == 8


def test_single_process_is_the_identity():
    dp = DataParallel()
    masks = [torch.tensor([[1, 1, 0], [1, 0, 0]]), torch.ones(2, 3)]
    total, shares = _shares(dp, "bnpo", masks)
    assert total == 9.0 and shares == [0.5, 0.5]
    counts = torch.tensor([[2.0, 3.0], [2.0, 6.0]], dtype=torch.float64)
    assert torch.equal(dp.counts_over_ranks(counts), counts)
    r = torch.tensor([1.0, 0.0, 2.0, 2.0])
    assert dp.global_batch_std(r[:, None]) is None
    rec = {"loss": 0.5, "step": 3, "time": {"step": 1.5}}
    assert dp.mean_over_ranks(rec) == rec
    assert dp.totals_over_ranks({"n": 3, "top": 7}, ("top",)) == {"n": 3, "top": 7}
    assert dp.shard(list("abcd")) == list("abcd")


def test_bad_batch_split_is_one_clear_error():
    with pytest.raises(DistributedError, match="prompts_per_step=5 .* 2 processes"):
        DataParallel(rank=0, world=2).check_batch(5)
    with pytest.raises(DistributedError, match="adv_scale='batch' with rewards.rubric_mode='prefix'"):
        DataParallel(rank=0, world=2).check_batch(4, "batch", prefix_rubrics=True)


# ----------------------------------------------------------------------------- two processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One torchrun launch of this file with 2 gloo processes; returns [rank0, rank1] results."""
    out = tmp_path_factory.mktemp("dist")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    env.pop("TRITON_INTERPRET", None)
    if sys.platform == "linux":  # gloo on loopback: the hostname may resolve to an unreachable address
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), __file__, str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)], out


def tolerances(r: dict) -> tuple[float, float]:
    """(loss, gradient) tolerances of one case: n eps32 times the magnitude summed.

    Both paths add the same n per-token terms (n = 40 active tokens) in another grouping: each
    rank its rows, micro-batch by micro-batch, the share factors applied before the all-reduce
    rather than once. A reordered float sum of n terms moves by at most (n - 1) eps sum |terms|,
    whatever order a CPU's kernels choose, so the loss may differ by n eps r["loss_abs"] (the
    loss with every term made non-negative; the KL terms' log-probs, from forwards over 4 and
    8 rows, differ by a few eps too, which beta = 0.04 keeps far inside that). The gradient
    sums the n per-token contributions c_it d logp_it / d theta, so the same bound holds with
    r["grad_abs"] = max over parameters of sum_it |c_it| |d logp_it / d theta|. It is applied
    to the largest error against the largest magnitude rather than element by element,
    because each contribution is itself computed by backward GEMMs that block a 4-row and an
    8-row batch differently, and their rounding is relative to the largest activations they
    mix, not to that element's own size.
    Measured (n = 40): losses agree to <= 0.6 eps r["loss_abs"] and gradients to <= 4 eps
    r["grad_abs"], while the naive average misses by >= 5e5 eps r["grad_abs"].
    """
    n = r["tokens"] * EPS32
    return n * r["loss_abs"], n * r["grad_abs"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-acc{c[2]}-beta{c[3]}")
def test_update_equals_single_process_on_the_global_batch(two_ranks, case):
    results, _ = two_ranks
    key = "/".join(map(str, case))
    for rank, res in enumerate(results):
        r = res["cases"][key]
        loss_tol, grad_tol = tolerances(r)
        assert r["grad_scale"] > 1e3 * grad_tol, "the gradient is within rounding of 0: the comparison would be vacuous"
        assert r["loss_err"] <= loss_tol, (rank, r)
        assert r["grad_err"] <= grad_tol, (rank, r)
        assert r["replicas_equal"], (rank, r)
    loss_type, adv_scale = case[0], case[1]
    if loss_type in ("bnpo", "dapo") or adv_scale == "batch":
        # ranks hold different token counts / reward spreads: plain averaging would be wrong, and the tolerance says so
        assert results[0]["cases"][key]["naive_err"] > 1e3 * tolerances(results[0]["cases"][key])[1]


@pytest.mark.parametrize("case", COMPONENT_CASES, ids=lambda c: f"components-{c[0]}-{c[1]}-floor{c[4]}")
def test_component_advantages_equal_single_process(two_ranks, case):
    results, _ = two_ranks
    key = "components/" + "/".join(map(str, case))
    for rank, res in enumerate(results):
        r = res["cases"][key]
        loss_tol, grad_tol = tolerances(r)
        assert r["grad_scale"] > 1e3 * grad_tol
        assert r["loss_err"] <= loss_tol, (rank, r)
        assert r["grad_err"] <= grad_tol, (rank, r)
        assert r["replicas_equal"], (rank, r)
    if case[1] == "batch":
        assert results[0]["cases"][key]["naive_err"] > 1e3 * tolerances(results[0]["cases"][key])[1]


def test_several_updates_per_batch_keep_replicas_equal(two_ranks):
    results, out = two_ranks
    assert [res["train_mu2_rc"] for res in results] == [0, 0]  # check_replicas ran at the checkpoint
    lines = [json.loads(x) for x in (out / "run" / "train_log.jsonl").read_text().splitlines()]
    steps = [r for r in lines if r.get("phase") == "B" and "event" not in r]
    assert [r["step"] for r in steps] == [1, 2, 3] and all(len(r["updates"]) == 2 for r in steps)
    assert any(u["kl_old"] > 0 for r in steps for u in r["updates"][1:]), "the policy never moved"
    assert any(r["guided"]["share"] > 0 for r in steps), "no group was guided: guided rows under data parallel untested"


def test_replica_check_catches_a_perturbed_rank(two_ranks):
    results, _ = two_ranks
    for res in results:
        assert res["replica_check_caught"] is True


@pytest.mark.parametrize("case", MICRO_CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_training_micro_batches_under_data_parallel_equal_one_pass(two_ranks, case):
    """The same rollouts on two ranks, one pass vs a group at a time: the all-reduced gradient
    agrees (a few float32 eps of its magnitude: only the order of the sums changes)."""
    results, _ = two_ranks
    for res in results:
        r = res["micro"]["/".join(case)]
        assert r["grad_scale"] > 0, "no gradient: nothing is compared"
        assert r["grad_err"] <= 64 * torch.finfo(torch.float32).eps * r["grad_scale"], (res["rank"], case, r)


def test_trainer_runs_data_parallel_end_to_end(two_ranks):
    results, out = two_ranks
    assert [res["train_rc"] for res in results] == [0, 0]
    run = out / "run"
    lines = [json.loads(x) for x in (run / "train_log.jsonl").read_text().splitlines()]
    steps = [r for r in lines if r.get("phase") == "A" and "event" not in r]
    assert [r["step"] for r in steps] == [1, 2, 3]  # rank 0 alone writes: one line per step
    assert [r["step"] for r in lines if r.get("phase") == "warmup" and "event" not in r] == [1, 2, 3, 4]  # 2 caption + 2 SFT
    assert any(r["adv_abs"] > 0 for r in steps), "no step had reward spread: replicas were never tested moving"
    # what entered the model: summed over ranks (2 prompts each), not rank 0's own
    assert all(r["prompts"]["n"] == 4 and r["prompts"]["visual_tokens_max"] == 16 for r in steps)
    assert [res["totals"] for res in results] == [{"n": 3, "top": 10}] * 2  # ranks' 1 + 2 and max(0, 10)
    evals = [r for r in lines if r.get("event") == "eval" and r["phase"] == "A"]
    assert len(evals) == 1 and evals[0]["metrics"]["n"] == 4.0  # 2 + 2 prompts gathered
    from grpo.state.checkpoint import load_checkpoint
    from grpo.state.registry import resolve

    ckpt = load_checkpoint(resolve(run, "A:latest"))
    assert {"sampler_generator_state", "sampler_generator_state.rank1"} <= set(ckpt.tensors)
    assert not torch.equal(ckpt.tensors["sampler_generator_state"], ckpt.tensors["sampler_generator_state.rank1"])


# ----------------------------------------------------------------------------- the worker (run by torchrun)


def _rollouts(bundle, examples):
    """The global batch's rollouts, identical on every rank, in every run and on every CPU:
    fixed token ids, ragged masks (ranks get different token counts), fixed rewards with spread.

    The ids come from integer arithmetic, not from the sampler. A sample of the pretrained
    tiny model is its confident continuation: both completions of a group were the same text
    at p ~ 1 per token, so d log p = onehot - softmax ~ 0, and under a token-sum loss (bnpo,
    dr_grpo, dapo) the opposite advantages of two identical rows cancel on every token they
    share. What was left (~1e-5) hung on which near-certain tokens fell in a ragged tail and
    on the random LoRA init, and a draw depends on the CPU's random and float kernels too.
    Here row n's token at position t is (37 n + 101 t + 11) mod the number of ordinary ids:
    tokens the model does not expect (d log p of order 1), and rows n, n+1 differ by 37 at
    every position, so no row cancels another.
    """
    N, T = len(examples) * G, L
    ordinary = min(bundle.tokenizer.added_tokens_decoder)  # ids below the first special / added token
    rows, cols = torch.arange(N)[:, None], torch.arange(T)[None, :]
    ids = (37 * rows + 101 * cols + 11) % ordinary
    lengths = torch.tensor([8, 2, 5, 8, 1, 6, 3, 7])[:N].clamp(max=T)
    mask = (cols < lengths[:, None]).long()
    rewards = torch.tensor([1.0, 0.0, 2.0, 0.5, 0.0, 0.0, 3.0, 1.0])[:N]  # prompt 2's group: zero spread
    return ids, mask, rewards


def _shares(dp, loss_type, masks):
    """(active tokens of the step over ranks, each rollout batch's loss share), as grpo/step.py forms them."""
    from grpo.batches import loss_share

    counts = dp.counts_over_ranks(torch.tensor([[m.shape[0], float(m.sum())] for m in masks], dtype=torch.float64))
    shares = [loss_share(loss_type, m.shape[0], float(m.sum()), n, t, len(masks))
              for m, (n, t) in zip(masks, counts.tolist())]
    return max(1.0, float(counts[:, 1].sum())), shares


def _advantages(r, weights, adv_scale, floor, dp):
    """The step's advantages of rewards r [N] or components [N, K] (+ weights): with ``dp``, its
    global batch std for scale="batch", as grpo/step.py ``advantages`` asks the hook for it."""
    from grpo_kernels.grpo_advantages import AdvantageSource, group_advantages

    src = AdvantageSource(r[:, None]) if r.dim() == 1 else AdvantageSource(r, weights=weights)
    if dp is not None and adv_scale == "batch":
        src.batch_std = dp.global_batch_std(src.columns, floor)
    return group_advantages(src, G, scale=adv_scale, adv_std_floor=floor)


def _micro_loss(logp, mask, r, ref, share, loss_type, adv_scale, beta, dp, naive, floor, weights, active):
    """One micro-batch's part of the global loss, as the trainer's step forms it."""
    from grpo_kernels.grpo_loss import LossOptions, grpo_loss

    adv = _advantages(r, weights, adv_scale, floor, None if naive else dp)
    loss, _ = grpo_loss(logp, mask.float(), adv, ref_logp=ref, num_active_tokens=active,
                        options=LossOptions(beta=beta, loss_type=loss_type, max_len=L))
    return loss * share


def _logprobs(model, prompts, ids, mask, beta):
    """(log-probs with their graph, reference log-probs or None) of one micro-batch."""
    from grpo.model.logprobs import completion_logprobs, reference_logprobs
    from grpo.model.prompt_context import build_prompt_context
    from lora import disable_adapters

    ctx = build_prompt_context(model, prompts)
    ref = None
    if beta > 0:
        ref = reference_logprobs(model, ctx, ids, mask, G, ref_context=lambda: disable_adapters(model))
    return completion_logprobs(model, ctx, ids, mask, G), ref


def _step_grads(model, micro_batches, loss_type, adv_scale, beta, dp, naive=False, floor=0.0, weights=None):
    """The trainer's step 3-5 (grpo/train.py) on given rollouts: (global loss, summed grads).
    Rewards [N, K] with ``weights`` [K]: per-component advantages, as adv_mode components."""
    from lora import lora_parameters

    params = lora_parameters(model)
    for p in params:
        p.grad = None
    active, shares = _shares(dp, loss_type, [m for _, _, m, _ in micro_batches])
    if naive:  # what averaging per-rank losses would do: local counts, local std, mean over ranks
        active = float(sum(float(m.sum()) for _, _, m, _ in micro_batches))
        shares = [1.0 / dp.world / (1 if loss_type == "dapo" else len(micro_batches))] * len(micro_batches)
    total = 0.0
    for (prompts, ids, mask, r), share in zip(micro_batches, shares):
        logp, ref = _logprobs(model, prompts, ids, mask, beta)
        loss = _micro_loss(logp, mask, r, ref, share, loss_type, adv_scale, beta, dp, naive, floor, weights, active)
        loss.backward()
        total += float(loss)
    total = dp.all_reduce_sum(total)
    dp.all_reduce_gradients(params)
    return total, torch.cat([p.grad.reshape(-1) for p in params])


def _token_jacobian(model, bundle, examples, ids, mask, prompt_ids):
    """|d logp_it / d theta| over the LoRA parameters for the active tokens of these prompts'
    rows: ([tokens, P] in row-major order, [N, T] bool marking those tokens). One forward per
    prompt and one backward per token, on a one-prompt graph (a quarter of the batch's cost)."""
    from grpo.model.prompts import encode_prompts
    from lora import lora_parameters

    params = lora_parameters(model)
    mine = torch.zeros(mask.shape, dtype=torch.bool)
    out = []
    for b in prompt_ids:
        rows = slice(b * G, (b + 1) * G)
        logp, _ = _logprobs(model, encode_prompts(bundle, [examples[b]]), ids[rows], mask[rows], 0.0)
        for i, t in mask[rows].nonzero().tolist():
            grads = torch.autograd.grad(logp[i, t], params, retain_graph=True)
            out.append(torch.cat([g.reshape(-1) for g in grads]).abs())
        mine[rows] = mask[rows].bool()
    return torch.stack(out), mine


def _magnitudes(model, micro_batches, jacobian, mine, dp, loss_type, adv_scale, beta, floor=0.0, weights=None):
    """What the single-process loss and gradient add up, in absolute value: (loss, [P] gradient).

    The loss is a weighted sum of per-token terms pg_it + beta kl_it; its magnitude is the same
    loss with every term made non-negative (advantages -|A|, so that the policy term is |A| at
    ratio 1; k3 >= 0 already). The gradient is sum_it c_it d logp_it / d theta with
    c_it = d loss / d logp_it (advantage, loss weight, share and KL slope in one number, read off
    by autograd on a detached copy of the log-probs); its magnitude is
    sum_it |c_it| |d logp_it / d theta|, each rank summing the tokens of ``jacobian`` (those
    ``mine`` marks) and one all-reduce adding the ranks' parts.
    """
    from grpo_kernels.grpo_advantages import Advantages
    from grpo_kernels.grpo_loss import LossOptions, grpo_loss

    single = DataParallel()
    active, shares = _shares(single, loss_type, [m for _, _, m, _ in micro_batches])
    loss_abs, coefs = 0.0, []
    for (prompts, ids, mask, r), share in zip(micro_batches, shares):
        with torch.no_grad():
            logp, ref = _logprobs(model, prompts, ids, mask, beta)
        leaf = logp.detach().requires_grad_()
        loss = _micro_loss(leaf, mask, r, ref, share, loss_type, adv_scale, beta, single, False, floor, weights,
                           active)
        coefs.append(torch.autograd.grad(loss, leaf)[0])
        adv = _advantages(r, weights, adv_scale, floor, None)
        flipped = Advantages(G, "row", coef=-adv.coef.abs(), constant=adv.constant)
        term_abs, _ = grpo_loss(logp, mask.float(), flipped, ref_logp=ref, num_active_tokens=active,
                                options=LossOptions(beta=beta, loss_type=loss_type, max_len=L))
        loss_abs += float(term_abs) * share
    grad_abs = torch.cat(coefs)[mine].abs() @ jacobian  # micro-batches hold the rows in order
    if dp.enabled:
        torch.distributed.all_reduce(grad_abs)
    return loss_abs, grad_abs


def _micro_batches(bundle, examples, ids, mask, rewards, prompt_ids, accumulation, dp):
    """This process's micro-batches: global micro-batch a = prompts a*B_a .. (a+1)*B_a - 1,
    of which the process keeps its shard (rows b*G .. b*G+G-1 of each kept prompt b)."""
    from grpo.model.prompts import encode_prompts

    per = len(prompt_ids) // accumulation
    out = []
    for a in range(accumulation):
        chunk = prompt_ids[a * per : (a + 1) * per]
        mine = dp.shard(chunk)
        rows = torch.tensor([b * G + g for b in mine for g in range(G)])
        out.append((encode_prompts(bundle, [examples[b] for b in mine]), ids[rows], mask[rows], rewards[rows]))
    return out


def _report(ref_loss, dp_loss, ref_grad, dp_grad, naive_grad, loss_abs, grad_abs, tokens, equal) -> dict:
    """One case's numbers for the pytest side (which derives the tolerances from them)."""
    return dict(loss_ref=ref_loss, loss_err=abs(dp_loss - ref_loss), loss_abs=loss_abs, tokens=tokens,
                grad_scale=float(ref_grad.abs().max()), grad_abs=float(grad_abs.max()),
                grad_err=float((dp_grad - ref_grad).abs().max()), naive_err=float((naive_grad - ref_grad).abs().max()),
                replicas_equal=equal)


def _micro_batch_cases(dp, bundle, examples) -> dict:
    """grpo_step under the data-parallel hooks, the same rollouts (2 prompts x G = 4 per rank)
    trained in one pass and a group at a time: the all-reduced gradients must agree."""
    import copy

    from grpo.presets import phase_preset
    from grpo.rewards import RewardModel
    from grpo.rewards.compose import RewardBatch
    from grpo.step import Hooks, Learner, grpo_step, sample_and_score
    from lora import lora_parameters

    class DPHooks(Hooks):  # grpo/train.py's PhaseHooks without the guard and timing
        def __init__(self, params):
            self.params, self.grads = params, []

        def counts_over_ranks(self, counts):
            return dp.counts_over_ranks(counts)

        def batch_std(self, columns, std_floor):
            return dp.global_batch_std(columns, std_floor)

        def global_loss(self, loss):
            return dp.all_reduce_sum(loss)

        def reduce_gradients(self, params):
            dp.all_reduce_gradients(params)

        def optimizer_step(self, opt, update, loss):  # record, do not step: both runs start alike
            self.grads.append(torch.cat([p.grad.reshape(-1) for p in self.params]))
            return True

    out = {}
    for loss_type, adv_scale in MICRO_CASES:
        cfg = phase_preset("A")
        cfg.model.device, cfg.sampling.G, cfg.sampling.max_new_tokens, cfg.phase.prompts_per_step = "cpu", 4, 8, 2
        cfg.optim.loss_type, cfg.optim.adv_scale, cfg.optim.beta = loss_type, adv_scale, 0.04
        params = lora_parameters(bundle.model)
        rewards = RewardModel(cfg.rewards, cfg.sampling.max_new_tokens, tokenizer=bundle.tokenizer)
        ln = Learner(bundle, torch.optim.SGD(params, lr=0.0), rewards, cfg, torch.Generator().manual_seed(dp.rank),
                     backend="torch")
        mine = examples[2 * dp.rank: 2 * dp.rank + 2]  # each rank its own prompts
        rollout = sample_and_score(ln, mine, temperature=1.0)
        total = torch.tensor([0.0, 1.0, 2.5, -1.0, 1.0, 0.0, 0.5, 3.0])[:rollout.out.completion_ids.shape[0]] + dp.rank
        rollout.scores = RewardBatch(total=total, components={"correctness": total}, weights={"correctness": 1.0})
        grads = []
        for rows in (0, cfg.sampling.G):
            cfg.optim.micro_batch_rows = rows
            hooks = DPHooks(params)
            grpo_step(ln, lambda n, r=rollout: copy.deepcopy(r), step=0, temperature=1.0, hooks=hooks)
            grads.append(hooks.grads[0])
        out[f"{loss_type}/{adv_scale}"] = dict(grad_scale=float(grads[0].abs().max()),
                                                grad_err=float((grads[1] - grads[0]).abs().max()))
    return out


def _worker(out_dir: Path) -> None:
    from data.synthetic import generate
    from grpo.config import TrainConfig
    from grpo.distributed import init_distributed
    from grpo.model.policy import build_policy
    from lora import lora_parameters

    torch.set_num_threads(1)
    dp = init_distributed("cpu")
    single = DataParallel()
    cfg = TrainConfig()
    cfg.model.device = "cpu"
    # The LoRA init (kaiming_uniform_ on A) draws from the global generator, which a fresh
    # process seeds at random: unseeded, every run would test another policy.
    torch.manual_seed(0)
    bundle = build_policy(cfg, "cpu", verbose=False)
    model = bundle.model
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)  # a non-zero LoRA: gradients reach A as well as B
        for p in lora_parameters(model):
            p.add_(0.05 * torch.randn_like(p))
    dp.broadcast_parameters(lora_parameters(model))
    examples = generate("train", 1, 4, seed=0, image_size=112)
    ids, mask, rewards = _rollouts(bundle, examples)
    prompt_ids = list(range(len(examples)))
    jacobian, mine = _token_jacobian(model, bundle, examples, ids, mask, dp.shard(prompt_ids))
    result = {"rank": dp.rank, "cases": {}}
    for loss_type, adv_scale, acc, beta in CASES:
        ref_mbs = _micro_batches(bundle, examples, ids, mask, rewards, prompt_ids, acc, single)
        ref_loss, ref_grad = _step_grads(model, ref_mbs, loss_type, adv_scale, beta, single)
        loss_abs, grad_abs = _magnitudes(model, ref_mbs, jacobian, mine, dp, loss_type, adv_scale, beta)
        mbs = _micro_batches(bundle, examples, ids, mask, rewards, prompt_ids, acc, dp)
        naive_loss, naive_grad = _step_grads(model, mbs, loss_type, adv_scale, beta, dp, naive=True)
        dp_loss, dp_grad = _step_grads(model, mbs, loss_type, adv_scale, beta, dp)
        # one AdamW step on a copy: replicas must stay bit-identical
        params = [p.detach().clone().requires_grad_() for p in lora_parameters(model)]
        for p, g in zip(params, dp_grad.split([p.numel() for p in params])):
            p.grad = g.view_as(p).clone()
        torch.optim.AdamW(params, lr=1e-3).step()
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        equal = all(torch.equal(flat, other) for other in dp.gather_objects(flat))
        result["cases"]["/".join(map(str, (loss_type, adv_scale, acc, beta)))] = _report(
            ref_loss, dp_loss, ref_grad, dp_grad, naive_grad, loss_abs, grad_abs, int(mask.sum()), equal)
    components = torch.stack([rewards, torch.tensor([0.0, 1.0, 1.0, 0.5, 0.0, 2.0, 1.0, 1.0])[:len(rewards)]], 1)
    weights = torch.tensor([0.8, 0.2])
    for loss_type, adv_scale, acc, beta, floor in COMPONENT_CASES:
        kw = dict(floor=floor, weights=weights)
        ref_mbs = _micro_batches(bundle, examples, ids, mask, components, prompt_ids, acc, single)
        ref_loss, ref_grad = _step_grads(model, ref_mbs, loss_type, adv_scale, beta, single, **kw)
        loss_abs, grad_abs = _magnitudes(model, ref_mbs, jacobian, mine, dp, loss_type, adv_scale, beta, **kw)
        mbs = _micro_batches(bundle, examples, ids, mask, components, prompt_ids, acc, dp)
        _, naive_grad = _step_grads(model, mbs, loss_type, adv_scale, beta, dp, naive=True, **kw)
        dp_loss, dp_grad = _step_grads(model, mbs, loss_type, adv_scale, beta, dp, **kw)
        equal = all(torch.equal(dp_grad, other) for other in dp.gather_objects(dp_grad))
        result["cases"]["components/" + "/".join(map(str, (loss_type, adv_scale, acc, beta, floor)))] = _report(
            ref_loss, dp_loss, ref_grad, dp_grad, naive_grad, loss_abs, grad_abs, int(mask.sum()), equal)
    # the replica check must notice one perturbed parameter on rank 1
    params = lora_parameters(model)
    with torch.no_grad():
        if dp.rank == 1:
            params[0].view(-1)[0] += 1e-6
        try:
            dp.check_replicas(params)
            result["replica_check_caught"] = False
        except RuntimeError:
            result["replica_check_caught"] = True
        if dp.rank == 1:
            params[0].view(-1)[0] -= 1e-6

    result["totals"] = dp.totals_over_ranks({"n": dp.rank + 1, "top": 10 * dp.rank}, ("top",))
    result["micro"] = _micro_batch_cases(dp, bundle, examples)

    # the trainer, as torchrun -m grpo.train runs it (the process group is reused). The warmed-up
    # tiny-random model writes garbage that the verifier mostly scores alike; the text-dependent
    # bonus gives groups a spread, so that steps have advantages and the replicas move.
    from train_helpers import reward_spread

    from grpo.train import main

    with reward_spread():
        result["train_rc"] = main(["--run.run_dir", str(out_dir / "run"), *TRAIN_ARGS])
        dp.barrier()  # rank 0 has written A's checkpoints: every rank must plan phase B alone
        args_b = [("B" if a == "A" else a) for a in TRAIN_ARGS]  # phase B from A:best_structure, mu = 2
        # with guided groups and LUFFY's shaping: each rank guides its own groups (a budget the
        # demonstrations fit), and the replicas must stay equal all the same
        result["train_mu2_rc"] = main(["--run.run_dir", str(out_dir / "run"), *args_b, "--optim.updates_per_batch",
                                       "2", "--optim.lr", "5e-2", "--sampling.guided", "true",
                                       "--optim.guided_gamma", "0.1", "--sampling.max_new_tokens", "64"])
    (out_dir / f"rank{dp.rank}.json").write_text(json.dumps(result))
    dp.barrier()
    dp.close()  # the watchdog first, then the process group this script created


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))

"""Data-parallel GRPO (grpo/distributed.py) with 2 gloo processes on the CPU.

What is compared, exactly:

1. Updates given fixed rollouts. Both ranks build the same tiny policy (non-zero LoRA), draw
   the SAME global batch of rollouts (4 prompts x G=2, one seeded sample of the whole batch,
   then ragged masks so ranks hold different token counts, and fixed rewards with spread),
   and each keeps its share of the prompts. The step the trainer runs -- loss shares, global
   dapo count, batch-std advantages, gradient all-reduce -- is compared with one process
   computing the same loss on the whole global batch: loss and LoRA gradients must agree to
   float rounding for grpo, bnpo, dr_grpo and dapo, with accumulation and the batch std.
   A naive average of per-rank losses (what plain DDP averaging would give) must NOT agree
   for bnpo / dapo / batch std, so the comparison can fail. The same for per-component
   advantages (optim.adv_mode components: one batch std per column, over ranks) with a
   std floor (optim.adv_std_floor). After an AdamW step the
   replicas must be bit-identical, and the replica check must catch a perturbed rank.
2. The trainer end to end: ``grpo.train.main`` in both processes (exactly what
   ``torchrun -m grpo.train`` runs: torchrun only sets the environment): a 2-step warm-up
   on rank 0 while rank 1 waits, then phase A from it, 3 steps, 2 prompts per rank, G=2,
   8 new tokens, eval on 4 prompts split 2/2. It must finish (the trainer
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

from grpo.distributed import DataParallel, DistributedError, loss_share, sampling_seed, shard_positions

G, L = 2, 8
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
        s = [loss_share(loss_type, n, m, sum(rows), sum(tokens)) for n, m in zip(rows, tokens)]
        assert sum(s) == pytest.approx(1.0)
    assert loss_share("bnpo", 3, 10.0, 8, 40.0) == pytest.approx(0.25)
    assert loss_share("grpo", 3, 10.0, 8, 40.0) == pytest.approx(3 / 8)
    assert loss_share("dapo", 3, 10.0, 8, 40.0) == 1.0  # the kernel gets the global count instead
    with pytest.raises(DistributedError, match="loss_type='mean'"):
        loss_share("mean", 1, 1, 1, 1)


def test_shards_partition_the_batch_and_seeds_differ():
    assert sorted(shard_positions(8, 0, 2) + shard_positions(8, 1, 2)) == list(range(8))
    assert shard_positions(6, 2, 3) == [2, 5]
    assert sampling_seed(7, 0, 1) == 7  # one process: the configured seed, as before
    seeds = {sampling_seed(7, r, 4) for r in range(4)} | {sampling_seed(8, r, 4) for r in range(4)}
    assert len(seeds) == 8


def test_single_process_is_the_identity():
    dp = DataParallel()
    masks = [torch.tensor([[1, 1, 0], [1, 0, 0]]), torch.ones(2, 3)]
    total, shares = dp.loss_shares("bnpo", masks)
    assert total == 9.0 and shares == [1.0, 1.0]
    r = torch.tensor([1.0, 0.0, 2.0, 2.0])
    assert dp.advantage_inputs(r, "batch") == (r, "batch")
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


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-acc{c[2]}-beta{c[3]}")
def test_update_equals_single_process_on_the_global_batch(two_ranks, case):
    results, _ = two_ranks
    key = "/".join(map(str, case))
    for rank, res in enumerate(results):
        r = res["cases"][key]
        assert r["grad_scale"] > 1e-4, "the gradient is ~0: the comparison would be vacuous"
        assert r["loss_err"] <= 1e-5 * max(1.0, abs(r["loss_ref"])), (rank, r)
        assert r["grad_err"] <= 1e-4 * r["grad_scale"], (rank, r)
        assert r["replicas_equal"], (rank, r)
    loss_type, adv_scale = case[0], case[1]
    if loss_type in ("bnpo", "dapo") or adv_scale == "batch":
        # ranks hold different token counts / reward spreads: plain averaging would be wrong
        assert results[0]["cases"][key]["naive_err"] > 1e-3 * results[0]["cases"][key]["grad_scale"]


@pytest.mark.parametrize("case", COMPONENT_CASES, ids=lambda c: f"components-{c[0]}-{c[1]}-floor{c[4]}")
def test_component_advantages_equal_single_process(two_ranks, case):
    results, _ = two_ranks
    key = "components/" + "/".join(map(str, case))
    for rank, res in enumerate(results):
        r = res["cases"][key]
        assert r["grad_scale"] > 1e-4
        assert r["loss_err"] <= 1e-5 * max(1.0, abs(r["loss_ref"])), (rank, r)
        assert r["grad_err"] <= 1e-4 * r["grad_scale"], (rank, r)
        assert r["replicas_equal"], (rank, r)
    if case[1] == "batch":
        assert results[0]["cases"][key]["naive_err"] > 1e-3 * results[0]["cases"][key]["grad_scale"]


def test_several_updates_per_batch_keep_replicas_equal(two_ranks):
    results, out = two_ranks
    assert [res["train_mu2_rc"] for res in results] == [0, 0]  # check_replicas ran at the checkpoint
    lines = [json.loads(x) for x in (out / "run" / "train_log.jsonl").read_text().splitlines()]
    steps = [r for r in lines if r.get("phase") == "B" and "event" not in r]
    assert [r["step"] for r in steps] == [1, 2, 3] and all(len(r["updates"]) == 2 for r in steps)
    assert any(u["kl_old"] > 0 for r in steps for u in r["updates"][1:]), "the policy never moved"


def test_replica_check_catches_a_perturbed_rank(two_ranks):
    results, _ = two_ranks
    for res in results:
        assert res["replica_check_caught"] is True


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
    """The global batch's rollouts, identical on every rank: one seeded sample of all prompts,
    then ragged masks (ranks get different token counts) and fixed rewards with spread."""
    from grpo.model.prompts import encode_prompts
    from grpo.rollout.sampler import sample

    prompts = encode_prompts(bundle, examples)
    out = sample(bundle, prompts, G=G, max_new_tokens=L, temperature=1.0, seed=0, compact=False)
    N, T = out.completion_ids.shape
    lengths = torch.tensor([8, 2, 5, 8, 1, 6, 3, 7])[:N].clamp(max=T)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    rewards = torch.tensor([1.0, 0.0, 2.0, 0.5, 0.0, 0.0, 3.0, 1.0])[:N]  # prompt 2's group: zero spread
    return out.completion_ids, mask, rewards


def _step_grads(model, micro_batches, loss_type, adv_scale, beta, dp, naive=False, floor=0.0, weights=None):
    """The trainer's step 3-5 (grpo/train.py) on given rollouts: (global loss, summed grads).
    Rewards [N, K] with ``weights`` [K]: per-component advantages, as adv_mode components."""
    from grpo.model.logprobs import completion_logprobs, reference_logprobs
    from grpo.model.prompt_context import build_prompt_context
    from kernels.grpo_loss import grpo_loss
    from lora import disable_adapters, lora_parameters

    params = lora_parameters(model)
    for p in params:
        p.grad = None
    active, shares = dp.loss_shares(loss_type, [m for _, _, m, _ in micro_batches])
    if naive:  # what averaging per-rank losses would do: local counts, local std, mean over ranks
        active = float(sum(float(m.sum()) for _, _, m, _ in micro_batches))
        shares = [1.0 / dp.world] * len(micro_batches)
    total = 0.0
    for (prompts, ids, mask, r), share in zip(micro_batches, shares):
        ctx = build_prompt_context(model, prompts)
        ref = None
        if beta > 0:
            ref = reference_logprobs(model, ctx, ids, mask, G, ref_context=lambda: disable_adapters(model))
        logp = completion_logprobs(model, ctx, ids, mask, G)
        rr, scale = (r, adv_scale) if naive else dp.advantage_inputs(r, adv_scale, std_floor=floor)
        source = dict(rewards=rr) if r.dim() == 1 else dict(reward_components=rr, component_weights=weights)
        loss, _ = grpo_loss(logp, mask.float(), G=G, ref_logp=ref, beta=beta, loss_type=loss_type,
                            scale=scale, max_len=L, num_active_tokens=active,
                            adv_std_floor=floor if scale == adv_scale else 0.0, **source)
        loss = loss * share
        if loss_type != "dapo":
            loss = loss / len(micro_batches)
        loss.backward()
        total += float(loss)
    total = dp.all_reduce_sum(total)
    dp.all_reduce_gradients(params)
    return total, torch.cat([p.grad.reshape(-1) for p in params])


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
    result = {"rank": dp.rank, "cases": {}}
    for loss_type, adv_scale, acc, beta in CASES:
        ref_loss, ref_grad = _step_grads(model, _micro_batches(bundle, examples, ids, mask, rewards, prompt_ids, acc,
                                                              single), loss_type, adv_scale, beta, single)
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
        result["cases"]["/".join(map(str, (loss_type, adv_scale, acc, beta)))] = dict(
            loss_ref=ref_loss, loss_err=abs(dp_loss - ref_loss), grad_scale=float(ref_grad.abs().max()),
            grad_err=float((dp_grad - ref_grad).abs().max()), naive_err=float((naive_grad - ref_grad).abs().max()),
            replicas_equal=equal)
    components = torch.stack([rewards, torch.tensor([0.0, 1.0, 1.0, 0.5, 0.0, 2.0, 1.0, 1.0])[:len(rewards)]], 1)
    weights = torch.tensor([0.8, 0.2])
    for loss_type, adv_scale, acc, beta, floor in COMPONENT_CASES:
        kw = dict(floor=floor, weights=weights)
        ref_loss, ref_grad = _step_grads(model, _micro_batches(bundle, examples, ids, mask, components, prompt_ids,
                                                              acc, single), loss_type, adv_scale, beta, single, **kw)
        mbs = _micro_batches(bundle, examples, ids, mask, components, prompt_ids, acc, dp)
        _, naive_grad = _step_grads(model, mbs, loss_type, adv_scale, beta, dp, naive=True, **kw)
        dp_loss, dp_grad = _step_grads(model, mbs, loss_type, adv_scale, beta, dp, **kw)
        equal = all(torch.equal(dp_grad, other) for other in dp.gather_objects(dp_grad))
        result["cases"]["components/" + "/".join(map(str, (loss_type, adv_scale, acc, beta, floor)))] = dict(
            loss_ref=ref_loss, loss_err=abs(dp_loss - ref_loss), grad_scale=float(ref_grad.abs().max()),
            grad_err=float((dp_grad - ref_grad).abs().max()), naive_err=float((naive_grad - ref_grad).abs().max()),
            replicas_equal=equal)
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

    # the trainer, as torchrun -m grpo.train runs it (the process group is reused)
    from grpo.train import main

    result["train_rc"] = main(["--run.run_dir", str(out_dir / "run"), *TRAIN_ARGS])
    dp.barrier()  # rank 0 has written A's checkpoints: every rank must plan phase B alone
    args_b = [("B" if a == "A" else a) for a in TRAIN_ARGS]  # phase B from A:best_structure, mu = 2
    result["train_mu2_rc"] = main(["--run.run_dir", str(out_dir / "run"), *args_b, "--optim.updates_per_batch", "2",
                                   "--optim.lr", "5e-2"])
    (out_dir / f"rank{dp.rank}.json").write_text(json.dumps(result))
    dp.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))

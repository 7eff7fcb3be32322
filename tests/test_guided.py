"""Guided groups (grpo/rollout/guided.py): which groups get the gold, what the row holds, and
that a step trains it the same way on every path.

The pairing of guided rows with their own image and gold, through dynamic sampling, two
rollout batches, micro-batches and the merged rollout, is checked row by row in
tests/test_pairing.py (its guided case)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from data.contract import gold_response
from data.synthetic import generate
from grpo.cli import phase_config
from grpo.errors import ConfigError
from grpo.model.logprobs import completion_logprobs
from grpo.model.policy import build_policy
from grpo.presets import phase_preset
from grpo.rewards import RewardBatch, RewardModel
from grpo.rollout.guided import guide, shaped_rows, shaped_term, unguided_groups, write_demonstrations
from grpo.rollout.sampler import SampleOutput
from grpo.run.records import guided_record
from grpo.step import BatchLog, Learner, grpo_step, sample_and_score
from grpo_kernels.grpo_advantages import AdvantageSource, group_advantages
from lora import lora_parameters

G, L, TEMP = 4, 40, 1.0


def _out(ids: torch.Tensor, mask: torch.Tensor) -> SampleOutput:
    N = ids.shape[0]
    return SampleOutput(completion_ids=ids, completion_mask=mask, logprobs=-mask.float(), filtered_logprobs=-mask.float(),
                        finished=torch.ones(N, dtype=torch.bool), truncated=torch.zeros(N, dtype=torch.bool),
                        texts=[f"row {n}" for n in range(N)], prompt_index=torch.arange(N) // 2, G=2, context=None)


def test_unguided_groups_are_the_groups_without_a_correct_completion():
    correctness = torch.tensor([0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1.0])  # groups of 4: none, one, last
    assert unguided_groups(correctness, 4) == [0]
    assert unguided_groups(torch.zeros(8), 4) == [0, 1]
    assert unguided_groups(torch.ones(8), 4) == []


def test_a_demonstration_is_written_whole_and_every_other_row_keeps_its_values():
    ids = torch.tensor([[5, 6, 0], [7, 0, 0], [8, 9, 9], [4, 0, 0]])
    mask = (ids != 0).long()
    out = _out(ids, mask)
    new = write_demonstrations(out, {1: ("gold", [11, 12, 13, 14])}, pad_id=0)  # longer than T = 3
    assert new.completion_ids.shape == (4, 4)
    assert new.completion_ids[1].tolist() == [11, 12, 13, 14] and new.completion_mask[1].tolist() == [1, 1, 1, 1]
    assert new.texts[1] == "gold" and bool(new.finished[1]) and not bool(new.truncated[1])
    assert new.guided.tolist() == [False, True, False, False]
    for n in (0, 2, 3):  # the others: the same tokens, padded with the pad id and mask 0
        assert new.completion_ids[n, :3].tolist() == ids[n].tolist() and int(new.completion_ids[n, 3]) == 0
        assert new.completion_mask[n].tolist() == mask[n].tolist() + [0]
        assert new.logprobs[n, :3].tolist() == out.logprobs[n].tolist() and new.texts[n] == out.texts[n]
    assert write_demonstrations(out, {}, pad_id=0) is out


def test_a_demonstration_over_the_budget_leaves_its_group_as_sampled():
    out = _out(torch.ones(4, 3, dtype=torch.long), torch.ones(4, 3, dtype=torch.long))  # 2 groups of 2, none right
    words = lambda text, add_special_tokens: {"input_ids": [7] * len(text.split())}  # noqa: E731
    new, demos = guide(out, ["a b", "a b c d"], torch.zeros(4), text_of=str, tokenizer=words, stop_id=9, pad_id=0,
                       max_new_tokens=3, policy_logprobs=lambda o, groups: torch.full((2 * len(groups), 3), -0.5))
    assert demos.rows == [1] and demos.too_long == 1  # "a b" + stop fits 3 tokens, "a b c d" + stop does not
    assert new.completion_ids[1].tolist() == [7, 7, 9] and new.texts[1] == "a b"
    assert new.logprobs[1].tolist() == [-0.5] * 3 and torch.equal(new.logprobs[3], out.logprobs[3])


def test_the_log_counts_guided_groups_and_the_policys_own_correctness():
    out = write_demonstrations(_out(torch.ones(4, 2, dtype=torch.long), torch.ones(4, 2, dtype=torch.long)),
                               {1: ("gold", [3])}, pad_id=0)
    scores = RewardBatch(total=torch.tensor([0.0, 1.0, 1.0, 0.0]),
                         components={"correctness": torch.tensor([0.0, 1.0, 1.0, 0.0])}, weights={"correctness": 1.0})
    record = guided_record([BatchLog(scores, None, out, None)])
    assert record == {"share": 0.5, "sampled_correctness": 0.25}  # 1 of 2 groups; 1 right of 4 rows of its own


def test_the_shaped_term_has_luffys_gradient():
    """-A * p / (p + gamma) with p = exp(logp): d/dlogp = -A * gamma * p / (p + gamma)^2, largest at p = gamma."""
    gamma = 0.1
    p = torch.tensor([[0.01, 0.1, 0.5, 0.99]])
    logp = p.log().requires_grad_(True)
    adv = torch.tensor([[2.0, 2.0, 2.0, 0.0]])  # the last token: another row's (0: no term)
    shaped_term(logp, adv, gamma).sum().backward()
    expected = -adv * gamma * p / (p + gamma) ** 2
    assert torch.allclose(logp.grad, expected, rtol=1e-6)
    assert int(logp.grad[0, :3].abs().argmax()) == 1  # the pull peaks where the policy gives the gold token gamma


# ----------------------------------------------------------------------------- on the shipped tiny model


def _learner(gamma: float = 0.0, guided: bool = True, micro_batch_rows: int = 0, shared_prefix: bool = True,
             mu: int = 1, lr: float = 0.0) -> Learner:
    cfg = phase_preset("A")
    cfg.sampling.G, cfg.sampling.max_new_tokens, cfg.phase.prompts_per_step = G, L, 4
    cfg.sampling.guided, cfg.optim.guided_gamma, cfg.optim.micro_batch_rows = guided, gamma, micro_batch_rows
    cfg.optim.shared_prefix, cfg.optim.updates_per_batch, cfg.model.device, cfg.optim.lr = shared_prefix, mu, "cpu", lr
    bundle = build_policy(cfg, "cpu", verbose=False)
    torch.manual_seed(0)
    for p in lora_parameters(bundle.model):  # a non-zero adapter
        p.data.normal_(0, 0.005)
    opt = torch.optim.AdamW(lora_parameters(bundle.model), lr=lr, weight_decay=0.0)
    return Learner(bundle, opt, RewardModel(cfg.rewards, L, tokenizer=bundle.tokenizer), cfg,
                   torch.Generator().manual_seed(0), backend="torch")


# stage-2 figures, which the shipped base gets mostly wrong, without their worked reasoning (as
# own data comes): the demonstration is "the answer is <gold>." in the contract
EXAMPLES = [replace(ex, reasoning=None) for ex in generate("train", 2, 4, seed=11)]


def test_a_guided_group_holds_the_gold_with_the_policys_own_logprobs_and_draws_no_random_number():
    plain, guided = _learner(guided=False), _learner(guided=True)
    a = sample_and_score(plain, EXAMPLES, TEMP)
    b = sample_and_score(guided, EXAMPLES, TEMP)
    assert torch.equal(plain.generator.get_state(), guided.generator.get_state())  # a resume guides the same
    rows = b.out.guided.nonzero().flatten().tolist()
    want = [g * G + G - 1 for g in unguided_groups(a.scores.components["correctness"], G)]
    assert rows == want and rows, "no group was guided: the test needs a batch the base gets wrong"
    T = a.out.completion_ids.shape[1]
    for n in range(len(b.out.texts)):
        ex = b.examples[n // G]
        if n in rows:
            assert b.out.texts[n] == gold_response(ex.reasoning, ex.answer)
            assert float(b.scores.components["correctness"][n]) == 1.0
        else:  # a sampled row: as drawn, scored as before
            assert b.out.texts[n] == a.out.texts[n]
            assert torch.equal(b.out.completion_ids[n, :T], a.out.completion_ids[n])
            assert float(b.scores.total[n]) == float(a.scores.total[n])
    with torch.no_grad():  # the demonstration's sampler log-probs: the policy's, by a plain full forward
        full = completion_logprobs(guided.bundle.model, b.out.context, b.out.completion_ids, b.out.completion_mask, G,
                                   temperature=TEMP, shared_prefix=False)
    for n in rows:
        m = b.out.completion_mask[n].bool()
        assert torch.allclose(b.out.logprobs[n][m], full[n][m], atol=1e-5)
        assert torch.equal(b.out.logprobs[n], b.out.filtered_logprobs[n])


def _grads(learner: Learner) -> torch.Tensor:
    grpo_step(learner, lambda n: sample_and_score(learner, EXAMPLES[:n], TEMP), step=0, temperature=TEMP)
    return torch.cat([p.grad.flatten() for p in learner.params])


@pytest.mark.parametrize("gamma", [0.0, 0.1], ids=["ratio", "shaped"])
def test_a_guided_step_is_the_same_in_one_pass_in_micro_batches_and_without_the_shared_prefix(gamma):
    one = _grads(_learner(gamma))
    parts = _grads(_learner(gamma, micro_batch_rows=G))
    full = _grads(_learner(gamma, shared_prefix=False))
    assert one.abs().sum() > 0
    assert torch.allclose(parts, one, rtol=1e-4, atol=1e-8)
    assert torch.allclose(full, one, rtol=1e-3, atol=1e-7)


def test_with_the_shaping_a_demonstration_row_leaves_the_ppo_term_for_its_own():
    """gamma > 0: the kernel's advantages of demonstration rows are 0 (their KL term stays), and
    the shaped term gets their advantage on every token; with none guided, or gamma 0, nothing changes."""
    out = write_demonstrations(_out(torch.ones(4, 3, dtype=torch.long), torch.ones(4, 3, dtype=torch.long)),
                               {1: ("gold", [3, 4])}, pad_id=0)
    adv = group_advantages(AdvantageSource(torch.tensor([0.0, 1.0, 1.0, 0.5])[:, None]), 2, T=3, backend="torch")
    kernel, guided = shaped_rows(adv, out, 0.1)
    assert kernel.values().tolist() == [adv.values()[0].item(), 0.0, *adv.values()[2:].tolist()]
    assert guided[1].tolist() == [adv.values()[1].item()] * 3 and guided[[0, 2, 3]].abs().sum() == 0
    assert shaped_rows(adv, out, 0.0) == (adv, None)
    assert shaped_rows(adv, _out(torch.ones(4, 3, dtype=torch.long), torch.ones(4, 3, dtype=torch.long)),
                              0.1) == (adv, None)


def test_several_updates_a_batch_train_the_demonstrations_with_finite_losses():
    learner = _learner(0.1, mu=2, lr=1e-3)
    result = grpo_step(learner, lambda n: sample_and_score(learner, EXAMPLES[:n], TEMP), step=0, temperature=TEMP)
    assert len(result.updates) == 2 and all(math.isfinite(u.loss) for u in result.updates)


@pytest.mark.parametrize("overrides, message", [
    ({"optim.guided_gamma": "0.1"}, "sampling.guided is off"),
    ({"sampling.guided": "true", "optim.guided_gamma": "-1"}, "optim.guided_gamma=-1.0: must be a finite number >= 0"),
    ({"sampling.guided": "true", "rewards.random_reward": "true"}, "rewards.random_reward with sampling.guided"),
])
def test_bad_guided_settings_are_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        phase_config("B", "tiny", overrides, "B")


# ----------------------------------------------------------------------------- the trainer


def test_the_trainer_guides_logs_the_share_and_resumes_as_a_straight_run(tmp_path):
    """Phase A on bare own-data rows (no worked reasoning: the demonstrations fit 24 tokens), 3
    steps straight against 2 steps then a resume to 3: the same log records (timings aside) and
    the same adapter; the resume refuses to switch guiding off."""
    import json

    from test_own_data import minimal_rows
    from train_helpers import log_lines, run_main

    from grpo.state.checkpoint import load_checkpoint
    from grpo.state.registry import resolve

    data = tmp_path / "data"
    (data / "img").mkdir(parents=True)
    rows = minimal_rows(30)
    for row, image in rows:
        image.save(data / row["image"])
    (data / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row, _ in rows))
    args = ["--model.device", "cpu", "--run.data", str(data), "--sft-first", "never", "--phase", "A",
            "--sampling.G", "4", "--sampling.max_new_tokens", "24", "--phase.prompts_per_step", "4",
            "--run.eval_size", "2", "--run.eval_every", "1", "--run.test_per_stage", "0", "--sampling.guided", "true"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run_main(straight, *args, "--phase.steps", "3")[0] == 0
    assert run_main(resumed, *args, "--phase.steps", "2")[0] == 0
    rc, _, err = run_main(resumed, *args[:-2], "--phase.steps", "3")  # guiding off on resume
    assert rc == 2 and "sampling.guided" in err, err
    assert run_main(resumed, *args, "--phase.steps", "3")[0] == 0

    def steps(run):
        return [{k: v for k, v in r.items() if k != "time"} for r in log_lines(run) if "loss" in r and "event" not in r]
    a, b = steps(straight), steps(resumed)
    assert [r["step"] for r in a] == [1, 2, 3] and a == b
    assert any(r["guided"]["share"] > 0 for r in a), "no group was guided"
    ta, tb = (load_checkpoint(resolve(run, "A:latest")).tensors for run in (straight, resumed))
    lora = [k for k in ta if "lora" in k]
    assert lora and all(torch.equal(ta[k], tb[k]) for k in lora)

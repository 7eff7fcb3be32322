"""Qwen2.5-VL-7B's shapes on the CPU: the parameter arithmetic at full depth (meta device, no
memory), and one real GRPO step through bench.qwen7b_cpu's CLI on a model with every 7B width
and vocabulary but 1 decoder layer and 2 vision blocks (one windowed, one full-attention),
its embeddings, lm_head and vision tower in bf16 and the decoder layer in NF4 (about 3.4 GB
resident, about a minute on one thread). The image is 224 px (16 x 16 patches: 2 x 2 windows
of 112 px) rather than the benchmark's 448 px, a quarter of the vision and prefill work with
the same code paths."""

import dataclasses
import re

import pytest
import torch

from bench import qwen7b_cpu


def test_formula_and_meta_model_match_the_7b_published_counts():
    from transformers import Qwen2_5_VLForConditionalGeneration

    from grpo.model.load import load_bundle
    from lora import inject_lora

    cfg = qwen7b_cpu.qwen7b_config(28, 32, load_bundle("tiny").tokenizer)
    assert qwen7b_cpu.expected_counts(cfg) == (qwen7b_cpu.KNOWN_7B_PARAMETERS, qwen7b_cpu.KNOWN_7B_LORA_R8)
    with torch.device("meta"):  # shapes only: the full class, no storage
        model = Qwen2_5_VLForConditionalGeneration(cfg)
        count = inject_lora(model, verbose=False)
    assert count.total - count.trainable == 8_292_166_656
    assert count.trainable == 20_185_088
    assert cfg.vision_config.fullatt_block_indexes == [7, 15, 23, 31]
    # a shortened tower keeps a full-attention block: its last one when none of the 7B's survives
    assert qwen7b_cpu.qwen7b_config(1, 2, load_bundle("tiny").tokenizer).vision_config.fullatt_block_indexes == [1]
    assert qwen7b_cpu.qwen7b_config(1, 9, load_bundle("tiny").tokenizer).vision_config.fullatt_block_indexes == [7]


def test_units_cover_every_tensor_once():
    from transformers import Qwen2_5_VLForConditionalGeneration

    from grpo.model.load import load_bundle

    cfg = qwen7b_cpu.qwen7b_config(2, 2, load_bundle("tiny").tokenizer)
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(cfg)
    seen = []
    for _, unit, recurse in qwen7b_cpu._units(model):
        seen += [id(t) for t in (*unit.parameters(recurse=recurse), *unit.buffers(recurse=recurse))]
    everything = [id(t) for t in (*model.parameters(), *model.buffers())]
    assert sorted(seen) == sorted(everything)


def test_one_grpo_step_at_7b_widths(capsys, monkeypatch):
    pytest.importorskip("bitsandbytes")
    from grpo.rewards import RewardModel

    # Random weights give both completions the same reward, hence zero advantage and an
    # exactly-zero gradient; spread the rewards so the update must reach every adapter.
    score = RewardModel.__call__

    def spread(self, *args, **kwargs):
        rb = score(self, *args, **kwargs)
        return dataclasses.replace(rb, total=rb.total + torch.arange(rb.total.numel(), dtype=torch.float32))

    monkeypatch.setattr(RewardModel, "__call__", spread)
    threads = torch.get_num_threads()
    try:
        qwen7b_cpu.main(["--smoke", "--image-px", "224"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "the 7B's widths, 1 LM + 2 vision layers" in out
    for name in ("base parameters", "LoRA parameters", "LoRA layers"):
        assert re.search(rf"^\s*{name}\s+[\d,]+\s+[\d,]+\s+yes$", out, re.M), name
    assert "# LoRA targets: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj " in out
    # 224 px = 16 x 16 patches: four 8 x 8-patch windows in block 0, one 256-patch sequence in block 1
    assert "# vision windowed blocks [0]: 4 segment(s), longest 64 patches" in out
    assert "# vision full-attention blocks [1]: 1 segment(s), longest 256 patches" in out
    for stage in ("prompts", "sampling", "rewards", "logp (grad)", "loss", "backward", "optimizer", "step total"):
        assert re.search(rf"^\s*{re.escape(stage)}\s+[\d.]+\s+[\d.]+ [KMG]i?B$", out, re.M), stage
    grad = re.search(r"gradient reached (\d+)/(\d+) LoRA tensors, nonzero on (\d+)/7 B matrices .*norm ([\d.e+-]+)", out)
    assert grad and grad.group(1) == grad.group(2) == "14" and grad.group(3) == "7" and float(grad.group(4)) > 0
    assert re.search(r"^summary: .*peak RSS [\d.]+ GiB; 1,408,540,272 base \+ 720,896 LoRA parameters; counts match$",
                     out, re.M)


@pytest.mark.parametrize("argv, says", [(["--layers", "0"], "--layers 0: must be >= 1"),
                                        (["--G", "1"], "--G 1: must be >= 2"),
                                        (["--image-px", "450"], "--image-px 450: must be a multiple of 28")])
def test_bad_arguments_one_line_exit_2(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        qwen7b_cpu.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: " + says) and err.count("\n") == 1

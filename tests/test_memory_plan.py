"""The memory plan (grpo/run/memory_plan.py) against what a real step allocates, and the
trainer's decision on CUDA with the CUDA queries faked (no GPU here).

The measurements are bench/memory.py's instruments on the tiny model: autograd's saved
tensors per decoder layer (saved-tensor hooks) and the live bytes of a whole grpo_step
(allocation tracking), each against the plan at the same shapes."""

from __future__ import annotations

import copy

import pytest
import torch

from bench.memory import LiveBytes, measured_step, planned_phases, prompt_len_of, saved_per_layer
from data.synthetic import generate
from grpo.batches import micro_batch_choices
from grpo.cli import phase_config
from grpo.errors import ConfigError
from grpo.model.policy import build_policy
from grpo.run import memory_plan
from grpo.run.memory_plan import GiB, check_fits, need_bytes, plan_step, shapes_of_model


@pytest.fixture(scope="module")
def tiny():
    # checkpointing on, the 7B's setting: the plan's per-layer terms are the checkpointed ones
    cfg = phase_config("A", "tiny", {"model.device": "cpu", "sampling.G": "2", "phase.prompts_per_step": "2",
                                     "sampling.max_new_tokens": "6", "model.gradient_checkpointing": "true"}, "A")
    return cfg, build_policy(cfg, "cpu", verbose=False)


def test_live_bytes_counts_a_storage_once_and_until_it_is_freed():
    known = torch.zeros(10)  # resident from the start: 40 bytes
    with LiveBytes([known]) as t:
        a = torch.empty(1000, dtype=torch.float32)
        view, known_view = a.t(), known.view(2, 5)  # a view of a new tensor, a view of a known one: nothing new
        assert t.live == 40 + 4000
        del a, view
        assert t.live == 40
        b = torch.empty(10)
        del known, known_view  # a resident tensor freed (as a step frees the previous gradients) leaves the count
    assert t.peak("other") == 4040 and t.live == 40 and b.numel() == 10


@pytest.mark.parametrize("shared_prefix", [True, False])
def test_one_layer_saves_what_the_plan_counts_op_by_op(tiny, shared_prefix):
    cfg, bundle = tiny
    cfg = copy.deepcopy(cfg)
    cfg.optim.shared_prefix = shared_prefix
    examples = generate("train", 1, 2, seed=0, image_size=cfg.model.image_size)
    per_layer, planned, tokens = saved_per_layer(bundle, cfg, examples)
    assert abs(per_layer - planned) <= 0.01 * planned, (per_layer, planned, tokens)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("vision,merger", [(True, True), (False, True), (True, False)])
def test_the_vision_tower_with_lora_saves_what_the_plan_counts(dtype, vision, merger):
    """lora.vision / lora.merger: the tower rerun with grad (checkpointing off) keeps what
    vision_saved_per_patch counts op by op per patch, plus the LoRA factors' casts."""
    from bench.memory import resident_tensors, saved_bytes
    from grpo.model.prompts import encode_prompts
    from grpo.model.vision import VisionInputs, tower_features
    from grpo.run.memory_plan import vision_lora_copies, vision_saved_per_patch

    cfg = phase_config("A", "tiny", {"model.device": "cpu", "lora.vision": str(vision).lower(),
                                     "lora.merger": str(merger).lower(), "model.load_in_4bit": "false",
                                     "model.dtype": dtype}, "A")
    bundle = build_policy(cfg, "cpu", verbose=False)
    prompts = encode_prompts(bundle, generate("train", 1, 2, seed=0, image_size=cfg.model.image_size))
    images = VisionInputs(prompts.pixel_values.to(getattr(torch, dtype)), prompts.image_grid_thw, 2)
    with saved_bytes(resident_tensors(bundle.model, None)) as seen:
        tower_features(bundle.model, images)
    sh = shapes_of_model(bundle.model, cfg)
    planned = prompts.pixel_values.shape[0] * vision_saved_per_patch(sh) + vision_lora_copies(sh)
    assert seen["bytes"] > 0 and abs(planned - seen["bytes"]) <= 0.01 * seen["bytes"], (seen["bytes"], planned)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("vision,merger", [(True, True), (False, True)])
def test_the_checkpointed_vision_tower_keeps_what_the_plan_counts(dtype, vision, merger):
    """model.gradient_checkpointing with the tower training: what its forward leaves alive
    for backward (every live byte after it, the features it returns excepted) is what
    vision_checkpointed_per_patch counts per patch, plus the merger's LoRA casts. With
    lora.merger alone the frozen blocks run without grad (checkpointing's input hook removed):
    they keep nothing, and backward never enters them."""
    from bench.memory import resident_tensors
    from grpo.model.prompts import encode_prompts
    from grpo.model.vision import VisionInputs, tower_features
    from grpo.run.memory_plan import vision_checkpointed_per_patch, vision_lora_copies

    cfg = phase_config("A", "tiny", {"model.device": "cpu", "lora.vision": str(vision).lower(),
                                     "lora.merger": str(merger).lower(), "model.load_in_4bit": "false",
                                     "model.dtype": dtype, "model.gradient_checkpointing": "true"}, "A")
    bundle = build_policy(cfg, "cpu", verbose=False)
    prompts = encode_prompts(bundle, generate("train", 1, 2, seed=0, image_size=cfg.model.image_size))
    images = VisionInputs(prompts.pixel_values.to(getattr(torch, dtype)), prompts.image_grid_thw, 2)
    blocks_with_grad = []  # per block: did its output need grad (is backward going to enter it)?
    for blk in bundle.model.model.visual.blocks:
        blk.register_forward_hook(lambda mod, args, out: blocks_with_grad.append(out.requires_grad))
    with LiveBytes(resident_tensors(bundle.model, None) + [images.pixel_values]) as seen:
        features = tower_features(bundle.model, images)
        kept = seen.live - seen.by_label["resident"] - features.untyped_storage().nbytes()
    sh = shapes_of_model(bundle.model, cfg)
    planned = prompts.pixel_values.shape[0] * vision_checkpointed_per_patch(sh) + vision_lora_copies(sh, True)
    assert features.requires_grad and kept > 0
    assert abs(planned - kept) <= 0.01 * kept, (kept, planned)
    from grpo.run.memory_plan import vision_saved_per_patch
    if vision:  # the blocks' activations are gone: a fraction of what the tower keeps not checkpointed
        assert vision_checkpointed_per_patch(sh) < 0.5 * vision_saved_per_patch(sh)
    else:  # nothing in the blocks needs grad: they are outside the graph
        assert blocks_with_grad == [False] * len(bundle.model.model.visual.blocks)
        assert vision_checkpointed_per_patch(sh) == vision_saved_per_patch(sh)


def _tower_at_7b_widths(cfg, blocks: int = 2):
    """The tiny model with Qwen2.5-VL-7B's vision tower (1280 wide, MLP 3420, 16 heads, 112 px
    windows) cut to ``blocks`` (the last one full attention), in cfg's dtype, with cfg's vision LoRA."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from bench.step import QWEN7B_VISION
    from grpo.model.load import load_bundle
    from grpo.model.vision import inject_vision_lora

    t = load_bundle("tiny").model.config
    vision = dict(t.vision_config.to_dict(), **QWEN7B_VISION)
    vision.update(depth=blocks, fullatt_block_indexes=[blocks - 1], out_hidden_size=t.text_config.hidden_size)
    hf = Qwen2_5_VLConfig(text_config=t.text_config.to_dict(), vision_config=vision, image_token_id=t.image_token_id,
                          video_token_id=t.video_token_id, vision_start_token_id=t.vision_start_token_id,
                          vision_end_token_id=t.vision_end_token_id)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(hf).to(getattr(torch, cfg.model.dtype)).eval().requires_grad_(False)
    inject_vision_lora(model, cfg.lora, verbose=False)
    if cfg.model.gradient_checkpointing:
        from lora import enable_gradient_checkpointing

        enable_gradient_checkpointing(model)
    return model


@pytest.mark.parametrize("checkpointed", [False, True])
def test_the_vision_plan_holds_at_the_7b_tower_widths_on_a_448px_image(checkpointed):
    """The two tests above at the 7B's vision widths (2 blocks: one windowed, one full) on one
    448 px image (1,024 patches) in bf16: what the tower's forward keeps for backward is what the
    per-patch counts say, and backward reaches every adapter of the blocks and the merger."""
    from bench.memory import resident_tensors, saved_bytes
    from grpo.model.vision import VisionInputs, tower_features
    from grpo.run.memory_plan import vision_checkpointed_per_patch, vision_lora_copies, vision_saved_per_patch
    from lora import lora_modules

    cfg = phase_config("A", "tiny", {"model.device": "cpu", "lora.vision": "true", "lora.merger": "true",
                                     "model.load_in_4bit": "false", "model.dtype": "bfloat16",
                                     "model.gradient_checkpointing": str(checkpointed).lower()}, "A")
    model = _tower_at_7b_widths(cfg)
    v = model.config.vision_config
    side = 448 // v.patch_size
    pixels = torch.randn(side * side, 3 * v.temporal_patch_size * v.patch_size ** 2, dtype=torch.bfloat16)
    images = VisionInputs(pixels, torch.tensor([[1, side, side]]), v.spatial_merge_size)
    sh = shapes_of_model(model, cfg)
    assert (sh.vision_hidden, sh.vision_blocks, pixels.shape[0]) == (1280, 2, 1024)
    if checkpointed:
        with LiveBytes(resident_tensors(model, None) + [pixels]) as seen:
            features = tower_features(model, images)
            kept = seen.live - seen.by_label["resident"] - features.untyped_storage().nbytes()
        planned = pixels.shape[0] * vision_checkpointed_per_patch(sh) + vision_lora_copies(sh, True)
    else:
        with saved_bytes(resident_tensors(model, None)) as seen:
            features = tower_features(model, images)
        kept = seen["bytes"]
        planned = pixels.shape[0] * vision_saved_per_patch(sh) + vision_lora_copies(sh)
    assert kept > 0 and abs(planned - kept) <= 0.01 * kept, (kept, planned)
    features.float().square().mean().backward()
    adapters = lora_modules(model).values()
    assert len(adapters) == 2 * 5 + 2 and all(m.lora_B.grad is not None and m.lora_B.grad.abs().sum() > 0
                                               for m in adapters)


@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_a_whole_step_allocates_what_the_plan_predicts(tiny, entropy_coef):
    cfg, bundle = tiny
    cfg = copy.deepcopy(cfg)
    cfg.optim.entropy_coef = entropy_coef  # the bonus's gradient through the logits chunk, counted
    examples = generate("train", 1, 6, seed=1, image_size=cfg.model.image_size)
    got = measured_step(bundle, cfg, examples)
    want = planned_phases(plan_step(shapes_of_model(bundle.model, cfg), cfg, device="cpu",
                                    prompt_len=prompt_len_of(bundle, cfg, examples[:2])))
    # every byte held (weights, gradients, AdamW, activations) at each phase's peak, planned within 10%
    for phase in ("resident", "sampling", "policy"):
        assert abs(want[phase] - got[phase]) <= 0.1 * got[phase], (phase, got, want)
    assert got["policy"] > 1.2 * got["resident"]  # the step's own activations are a real part of what is compared


@pytest.mark.parametrize("micro_batch_rows", [0, 2])
def test_a_whole_step_with_the_tower_training_allocates_what_the_plan_predicts(micro_batch_rows):
    """lora.vision + lora.merger, checkpointed: the step's policy peak within 5%, and what
    training the tower adds to it (the patches kept and copied for the micro-batches, the
    tower's kept inputs, its LoRA) within 10% of what it adds when measured. The plan keeps
    the previous step's gradients through the passes (resident); a real step frees them at
    zero_grad and, in one pass, makes the tower's only after the language model's backward
    peak: there the plan may be high by the tower's LoRA gradients, never low."""
    def step(vision: bool) -> tuple[dict, dict]:
        cfg = phase_config("A", "tiny", {"model.device": "cpu", "sampling.G": "2", "phase.prompts_per_step": "2",
                                         "sampling.max_new_tokens": "6", "model.gradient_checkpointing": "true",
                                         "optim.micro_batch_rows": str(micro_batch_rows),
                                         "lora.vision": str(vision).lower(), "lora.merger": str(vision).lower()}, "A")
        bundle = build_policy(cfg, "cpu", verbose=False)
        examples = generate("train", 1, 6, seed=1, image_size=cfg.model.image_size)
        got = measured_step(bundle, cfg, examples)
        sh = shapes_of_model(bundle.model, cfg)
        want = planned_phases(plan_step(sh, cfg, device="cpu", prompt_len=prompt_len_of(bundle, cfg, examples[:2])))
        return got, want, sh.vision_lora_params * sh.lora_bytes

    (got_off, want_off, _), (got, want, tower_grads) = step(False), step(True)
    # The plan counts every position of the batch's shape as a real token; the shared-prefix pass
    # runs its token-wise parts on the real ones only, so a step with left-padded prompts and
    # early-stopped rows (this one) holds less: the plan may be high by that (here ~5%), never low.
    assert -0.05 * got["policy"] <= want["policy"] - got["policy"] <= 0.08 * got["policy"], (got, want)
    added = got["policy"] - got["resident"] - (got_off["policy"] - got_off["resident"])
    planned = want["policy"] - want["resident"] - (want_off["policy"] - want_off["resident"])
    assert added > 0.1 * (got["policy"] - got["resident"]), (added, got)  # the tower is a real part of the step
    assert -0.1 * added <= planned - added <= 0.1 * added + tower_grads, (added, planned, tower_grads)


def test_the_entropy_bonus_is_counted_in_the_logits_chunks_backward():
    """At the 7B's vocabulary, long rows and a 16384-token chunk, the logits part is the policy
    backward's peak: the bonus adds its own gradient of that chunk in bf16 (b V per token) and
    the fp32 block temporaries, nothing to the other phases."""
    from bench.memory import qwen7b_on_meta

    cfg = phase_config("A", "qwen7b", {"optim.logits_chunk_tokens": "16384"}, "A")
    sh = shapes_of_model(qwen7b_on_meta(cfg), cfg)
    off = plan_step(sh, cfg)
    cfg.optim.entropy_coef = 0.01
    on = plan_step(sh, cfg)
    T = on.completion_tokens
    chunk = min(on.micro_batch_rows, max(1, 16384 // T)) * T  # completion tokens per LM-head chunk
    grew = {p.name: q.bytes - p.bytes for p, q in zip(off.parts, on.parts) if q.bytes != p.bytes}
    assert list(grew) == ["policy backward: final norm + one logits chunk recomputed + its gradient"], grew
    assert list(grew.values())[0] == memory_plan.entropy_bonus_bytes(sh, chunk) >= chunk * sh.vocab * 2
    for phase in ("resident", "sampling", "reference"):
        assert on.phase_bytes(phase) == off.phase_bytes(phase)


# ----------------------------------------------------------------------------- the trainer's decision


def fake_cuda(monkeypatch, free_gib: float, held_gib: float = 0.0, total_gib: float = 80.0):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (int(free_gib * GiB), int(total_gib * GiB)))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev=None: int(held_gib * GiB))


@pytest.fixture(scope="module")
def qwen7b_preset():
    """The qwen7b preset's config and the 7B's module tree on the meta device (no storage)."""
    from bench.memory import qwen7b_on_meta

    cfg = phase_config("A", "qwen7b", {}, "A")
    return cfg, qwen7b_on_meta(cfg)


def test_on_cuda_a_step_that_fits_prints_the_plan_and_goes_on(monkeypatch, qwen7b_preset):
    cfg, model = qwen7b_preset
    plan = plan_step(shapes_of_model(model, cfg), cfg)
    fake_cuda(monkeypatch, free_gib=200.0, total_gib=200.0)
    lines = []
    assert check_fits(model, cfg, "cuda", log=lambda *a, **k: lines.append(a[0])) is not None
    assert len(lines) == 1 and f"predicted peak {plan.peak / GiB:.1f} GiB" in lines[0]


def test_on_cuda_a_step_that_cannot_fit_stops_with_the_micro_batch_that_would(monkeypatch, qwen7b_preset):
    cfg, model = qwen7b_preset
    sh = shapes_of_model(model, cfg)
    resident = plan_step(sh, cfg).phase_bytes("resident")
    # a GPU where micro-batches of 16 rows fit and 32 do not, the weights loaded already
    need = {rows: need_bytes(plan_step(sh, cfg, micro_batch_rows=rows)) for rows in (16, 32, 64)}
    free = (need[16] + need[32]) / 2 - memory_plan.CUDA_OVERHEAD - resident
    fake_cuda(monkeypatch, free_gib=free / GiB, held_gib=resident / GiB)
    with pytest.raises(ConfigError) as err:
        check_fits(model, cfg, "cuda", log=lambda *a, **k: None)
    msg = str(err.value)
    assert "\n" not in msg and "--optim.micro_batch_rows 16 " in msg and f"{free / GiB:.1f} GiB is free" in msg
    # the fix it names is accepted by the config and then passes the same check
    fixed = copy.deepcopy(cfg)
    fixed.optim.micro_batch_rows = 16
    assert check_fits(model, fixed.validate(), "cuda", log=lambda *a, **k: None) is not None


def test_on_cuda_nothing_fits_says_what_else_to_lower(monkeypatch, qwen7b_preset):
    cfg, model = qwen7b_preset
    fake_cuda(monkeypatch, free_gib=0.5, held_gib=6.0)
    with pytest.raises(ConfigError, match="no training micro-batch fits: lower --sampling.max_new_tokens"):
        check_fits(model, cfg, "cuda", log=lambda *a, **k: None)


def test_the_plan_counts_the_visual_tokens_of_every_image_of_a_prompt(monkeypatch, qwen7b_preset):
    """max_pixels bounds each image, so a prompt of k images is k x 256 visual tokens at the
    preset's 448^2 (plus the text); a prompt cap, when set, is the bound instead."""
    cfg, model = qwen7b_preset
    one, three = memory_plan.prompt_tokens(cfg), memory_plan.prompt_tokens(cfg, images=3)
    assert one == 256 + memory_plan.TEXT_TOKENS and three == 3 * 256 + memory_plan.TEXT_TOKENS
    fake_cuda(monkeypatch, free_gib=200.0, total_gib=200.0)
    lines = []
    plan = check_fits(model, cfg, "cuda", images=3, log=lambda *a, **k: lines.append(a[0]))
    assert plan.prompt_tokens == three and f"prompt ~{three} tokens" in lines[0]
    assert plan.peak > plan_step(shapes_of_model(model, cfg), cfg).peak
    capped = copy.deepcopy(cfg)
    capped.model.max_prompt_tokens = 600
    assert memory_plan.prompt_tokens(capped, images=3) == 600


def test_on_a_cpu_the_plan_prints_nothing_and_never_stops(monkeypatch, qwen7b_preset, capsys):
    cfg, model = qwen7b_preset
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (0, 0))  # would stop any CUDA run
    assert check_fits(model, cfg, "cpu") is None
    assert capsys.readouterr().out == ""


def test_the_trainer_stops_with_one_line_and_exit_2_before_any_step(monkeypatch, tmp_path, capsys):
    """grpo.train's GRPO phase asks the plan once the policy is built and the data read; on a (faked)
    CUDA device without room it ends with one line and exit 2, no step taken."""
    import grpo.train as train

    real = train.check_fits

    def on_a_full_gpu(model, cfg, device, world=1, images=1):  # CUDA faked for the check alone (bitsandbytes asks too)
        assert images == 1  # the synthetic curriculum: one image a prompt
        with monkeypatch.context() as patch:
            fake_cuda(patch, free_gib=0.0)
            return real(model, cfg, "cuda", world, images)

    monkeypatch.setattr(train, "check_fits", on_a_full_gpu)
    rc = train.main(["--phase", "A", "--init", "base", "--run.run_dir", str(tmp_path / "run"), "--phase.steps", "1",
                     "--model.device", "cpu", "--run.test_per_stage", "0", "--run.train_per_stage", "8",
                     "--run.eval_size", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: the step does not fit on cuda: predicted peak")
    log = tmp_path / "run" / "train_log.jsonl"
    assert not log.exists() or '"step"' not in log.read_text()


# ----------------------------------------------------------------------------- an out-of-memory error mid-step


def test_out_of_memory_in_the_training_pass_names_the_micro_batch_that_fits(qwen7b_preset):
    cfg, model = qwen7b_preset
    sh = shapes_of_model(model, cfg)
    plan = plan_step(sh, cfg)
    smaller = [r for r in micro_batch_choices(cfg.phase.prompts_per_step, cfg.sampling.G) if r < plan.micro_batch_rows]
    assert smaller, plan.micro_batch_rows  # the preset's micro-batch has a smaller choice
    budget = (need_bytes(plan) + need_bytes(plan_step(sh, cfg, micro_batch_rows=smaller[0]))) // 2
    assert need_bytes(plan_step(sh, cfg, micro_batch_rows=smaller[0])) < budget < need_bytes(plan)
    msg = memory_plan.out_of_memory_fix(sh, cfg, "backward", budget)
    assert f"the loss and backward at {plan.phase_bytes('policy') / GiB:.1f} GiB (policy" in msg
    assert f"--optim.micro_batch_rows {smaller[0]} (the same command with it resumes" in msg
    assert "--optim.micro_batch_rows" not in memory_plan.out_of_memory_fix(sh, cfg, "sampling", budget)
    # the plan predicted the current micro-batch fits: the next smaller one
    msg = memory_plan.out_of_memory_fix(sh, cfg, "logprobs", 10_000 * GiB)
    assert f"so try the next smaller --optim.micro_batch_rows {smaller[0]} " in msg


def test_out_of_memory_in_sampling_names_the_budget_that_fits(qwen7b_preset):
    cfg, model = qwen7b_preset
    sh = shapes_of_model(model, cfg)
    T = cfg.sampling.max_new_tokens
    shorter = copy.deepcopy(cfg)
    shorter.sampling.max_new_tokens = T // 2
    budget = need_bytes(plan_step(sh, shorter))  # exactly what half the budget needs
    msg = memory_plan.out_of_memory_fix(sh, cfg, "sampling", budget)
    assert f"puts sampling at {plan_step(sh, cfg).phase_bytes('sampling') / GiB:.1f} GiB" in msg
    assert f"--sampling.max_new_tokens {T // 2} (in a new run directory" in msg
    assert "no shorter" in memory_plan.out_of_memory_fix(sh, cfg, "sampling", GiB)


def test_an_out_of_memory_error_mid_step_is_one_line_and_the_last_checkpoint_loads(monkeypatch, tmp_path, capsys):
    """A real run of phase A: step 1 is evaluated and saved, then the policy's log-prob pass of
    step 2 raises torch.OutOfMemoryError (what a GPU raises there). One line naming step 2,
    the part and the smaller micro-batch; exit 1; step 1's checkpoint loads."""
    import grpo.step as step
    import grpo.train as train
    from grpo.state.checkpoint import load_checkpoint
    from grpo.state.registry import resolve

    real, calls = step.completion_logprobs, []

    def short_of_memory(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # one call per step (one micro-batch of all rows): step 2's
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(*args, **kwargs)

    monkeypatch.setattr(step, "completion_logprobs", short_of_memory)
    run = tmp_path / "run"
    rc = train.main(["--phase", "A", "--init", "base", "--run.run_dir", str(run), "--phase.steps", "3",
                     "--run.eval_every", "1", "--model.device", "cpu", "--run.test_per_stage", "0",
                     "--run.train_per_stage", "8", "--run.eval_size", "2", "--sampling.G", "2",
                     "--sampling.max_new_tokens", "8", "--phase.prompts_per_step", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1, err
    assert err[0].startswith("error: phase A step 2 ran out of device memory in the log-probs on cpu; "
                             "the memory plan puts the log-probs at "), err[0]
    assert "rerun with --optim.micro_batch_rows 2" in err[0] and err[0].endswith("intact")
    latest = load_checkpoint(resolve(run, "A:latest"))
    assert latest.step == 1


def test_the_reference_adapter_of_a_warm_up_is_counted_resident(tiny):
    """RL from a warm-up keeps a frozen copy of its adapter (the reference): the plan's
    resident bytes grow by exactly the bytes the copy allocates."""
    from lora import freeze_reference_adapter, lora_modules

    cfg, bundle = tiny
    model = copy.deepcopy(bundle.model)
    before = plan_step(shapes_of_model(model, cfg), cfg, device="cpu")
    freeze_reference_adapter(model)
    copies = sum(t.numel() * t.element_size() for m in lora_modules(model).values() for t in (m.ref_A, m.ref_B))
    after = plan_step(shapes_of_model(model, cfg), cfg, device="cpu")
    assert copies > 0 and planned_phases(after)["resident"] - planned_phases(before)["resident"] == copies


def test_the_plain_decode_on_a_cpu_counts_the_projections_it_keeps_dequantised(tiny, monkeypatch):
    """The plain rollout on a CPU keeps every NF4 projection dequantised while it decodes
    (lora.dequant.dequantised_forward): the plan's part is the bytes that cache holds; the merged
    rollout and CUDA (bitsandbytes' own kernel there) add nothing."""
    import lora.dequant as dequant
    from grpo.model.prompts import encode_prompts
    from grpo.rollout.sampler import sample

    cfg, bundle = tiny
    kept = {}
    real = dequant.dequantised_forward

    def recording(layer, x, cache):
        out = real(layer, x, cache)
        kept.update(cache)
        return out

    monkeypatch.setattr(dequant, "dequantised_forward", recording)
    sample(bundle, encode_prompts(bundle, generate("train", 1, 1)), G=2, max_new_tokens=3, seed=0)
    held = sum(w.numel() * w.element_size() for w in kept.values())
    plain = copy.deepcopy(cfg)
    plain.sampling.rollout = "plain"

    def part(c, device):
        parts = plan_step(shapes_of_model(bundle.model, c), c, device=device).parts
        return sum(p.bytes for p in parts if p.name.startswith("decode: every NF4 projection"))

    assert held > 0 and part(plain, "cpu") == held
    merged = copy.deepcopy(plain)
    merged.sampling.rollout = "merged"
    assert part(merged, "cpu") == 0 and part(plain, "cuda") == 0

"""Config dataclasses, presets and the --key value override mechanism."""

import pytest

from grpo.config import PHASE_WEIGHTS, TrainConfig
from grpo.errors import ConfigError
from grpo.overrides import apply_overrides, describe_fields, from_json, parse_override_args
from grpo.presets import phase_preset


def test_phase_presets_carry_the_design_weights():
    for phase in ("A", "B", "C"):
        cfg = phase_preset(phase)
        assert cfg.rewards.weights == PHASE_WEIGHTS[phase]
        assert cfg.rewards.tolerance is (phase == "C")
    assert phase_preset("B").phase.mixture == {1: 0.7, 2: 0.3}
    assert phase_preset("C").phase.mixture == {2: 0.6, 3: 0.4}


def test_overrides_parse_by_field_type():
    cfg = phase_preset("B")
    args = parse_override_args(["--G", "4", "--optim.lr=1e-4", "--load_in_4bit", "yes",
                                "--targets", "q_proj,v_proj", "--weights", "format=1,correctness=3.5",
                                "--mixture", "1=0.5,2=0.5"])
    apply_overrides(cfg, args)
    assert cfg.sampling.G == 4 and cfg.optim.lr == 1e-4 and cfg.model.load_in_4bit is True
    assert cfg.lora.targets == ("q_proj", "v_proj")
    assert cfg.rewards.weights == {"format": 1.0, "correctness": 3.5}
    assert cfg.phase.mixture == {1: 0.5, 2: 0.5}
    cfg.validate()


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--nonsense", "1"], "unknown config key --nonsense; known keys: data.columns"),
        (["--run.dir", "x"], r"unknown config key --run.dir; did you mean --run.run_dir\? known keys"),
        (["--G", "four"], "expected an integer"),
        (["--load_in_4bit", "maybe"], "expected true or false"),
        (["--G"], "needs a value"),
        (["G", "4"], "unexpected argument"),
    ],
)
def test_bad_overrides_name_the_problem(argv, match):
    with pytest.raises(ConfigError, match=match):
        apply_overrides(TrainConfig(), parse_override_args(argv))


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("G", 0, "sampling.G=0: GRPO phase B needs a group of >= 2"),
        ("G", 1, "with one there is no group"),
        ("lr", float("inf"), "optim.lr=inf: must be a finite number"),
        ("weights", {"format": 0.0, "correctness": 0}, "every weight is 0"),
        ("log_every", 0, "run.log_every=0"),
        ("seed", -1, r"run.seed=-1: must be in \[0, 2\*\*32\)"),
        ("device", "tpu", "model.device='tpu': use auto, cpu, cuda or cuda:N"),
        ("G", 4.0, "sampling.G=4.0: expected int"),
        ("max_new_tokens", -3, "max_new_tokens=-3"),
        ("rank", 0, "lora.rank=0"),
        ("loss_type", "ppo", "use grpo, bnpo, dr_grpo or dapo"),
        ("mixture", {4: 1.0}, "stages are 1, 2 and 3"),
        ("temperature", 0.0, "temperature"),
        ("temperature_max", 0.0, r"sampling.temperature_max=0.0: must be a number in \(0, 5\]"),
        ("temperature_max", float("nan"), r"sampling.temperature_max=nan: must be a finite number"),
        ("temperature_max", 6.0, r"sampling.temperature_max=6.0: must be a number in \(0, 5\]"),
        ("max_pixels", 783, r"model.max_pixels=783: must be >= 784 \(one 28x28 visual token\), or 0"),
        ("min_pixels", -1, r"model.min_pixels=-1: must be >= 0 \(0 = the processor's own\)"),
        ("max_prompt_tokens", -1, r"model.max_prompt_tokens=-1: must be >= 0 \(0 = no cap\)"),
        ("accuracy_low", -0.1, r"sampling.accuracy_low=-0.1, sampling.accuracy_high=1.0: the accuracy band needs "
                               r"0 <= low <= high <= 1"),
        ("accuracy_high", 1.5, r"sampling.accuracy_high=1.5: the accuracy band needs 0 <= low <= high <= 1"),
        ("accuracy_low", 0.01, r"sampling.accuracy_low=0.01, .* filter the groups of dynamic sampling, which is off"),
        ("overlong_buffer", 49, r"rewards.overlong_buffer=49: .* an int in 1..48"),
        ("overlong_penalty", -1.0, r"rewards.overlong_penalty=-1.0: give a finite number > 0"),
        ("entropy_coef", -0.01, r"optim.entropy_coef=-0.01: must be a number in \[0, 1\]"),
        ("entropy_coef", float("nan"), r"optim.entropy_coef=nan: must be a finite number"),
        ("entropy_coef", 2.0, r"optim.entropy_coef=2.0: must be a number in \[0, 1\]"),
        ("kl_estimator", "low_var_kl", r"optim.kl_estimator='low_var_kl': use k1, k2 or k3"),
        ("kl_estimator", "k2", r"optim.kl_estimator='k2' picks the KL term, which optim.beta=0 switches off"),
    ],
)
def test_impossible_values_are_refused(key, value, match):
    cfg = apply_overrides(TrainConfig(), {key: value})
    with pytest.raises(ConfigError, match=match):
        cfg.validate()


def test_the_accuracy_band_needs_an_ordered_range_and_the_correctness_component():
    cfg = apply_overrides(TrainConfig(), {"dynamic_sampling": True, "accuracy_low": 0.8, "accuracy_high": 0.2})
    with pytest.raises(ConfigError, match=r"sampling.accuracy_low=0.8, sampling.accuracy_high=0.2: .* low <= high"):
        cfg.validate()
    cfg = apply_overrides(TrainConfig(), {"dynamic_sampling": True, "accuracy_low": 0.01, "accuracy_high": 0.99,
                                          "weights": {"format": 1.0}})
    with pytest.raises(ConfigError, match="filter on the correctness component, which rewards.weights does not name"):
        cfg.validate()
    cfg.rewards.weights["correctness"] = 0.0  # scored, unpaid: enough for the band
    assert cfg.validate().sampling.accuracy_band() == (0.01, 0.99)
    assert TrainConfig().sampling.accuracy_band() is None  # the default: no band, the spread test alone


def test_image_bounds_must_form_a_range():
    cfg = apply_overrides(TrainConfig(), {"max_pixels": 56 * 56, "min_pixels": 112 * 112})
    with pytest.raises(ConfigError, match="model.min_pixels=12544 > model.max_pixels=3136"):
        cfg.validate()
    assert apply_overrides(cfg, {"max_pixels": 0}).validate() is cfg  # 0: the processor's own max (checked at load)


def test_the_qwen7b_preset_bounds_its_images_and_tiny_keeps_the_checkpoints():
    from grpo.cli import phase_config

    for phase in ("warmup", "A"):
        q = phase_config(phase, "qwen7b", {}, phase).model
        assert (q.max_pixels, q.min_pixels, q.max_prompt_tokens) == (448 * 448, 3136, 0)
        assert q.max_pixels // (28 * 28) == 256 and q.max_pixels == q.image_size**2  # its renders pass untouched
        t = phase_config(phase, "tiny", {}, phase).model
        assert (t.max_pixels, t.min_pixels) == (0, 0)


def test_warmup_has_no_group_or_rewards_to_check():
    cfg = apply_overrides(phase_preset("warmup"), {"G": 1, "weights": {"format": 0.0}})
    assert cfg.validate() is cfg  # SFT samples no groups and computes no rewards
    with pytest.raises(ConfigError, match="sampling.G=0: the group size must be >= 1"):
        apply_overrides(cfg, {"G": 0}).validate()


def test_json_round_trip_and_help():
    cfg = apply_overrides(phase_preset("C"), {"G": 3, "targets": ("q_proj",)})
    assert from_json(cfg.to_json()) == cfg
    text = describe_fields()
    assert "--sampling.G (default 8)" in text and "Group size" in text


def test_perception_supervision_is_for_models_trained_from_scratch(tmp_path):
    """The caption stage and the perception head teach a random tower (tiny-random, what the
    pretraining starts from); a pretrained model -- the shipped 'tiny' included -- gets
    neither by default, and asking for them is one clear error rather than a silently
    relabelled run."""
    from grpo.cli import phase_config

    scratch = {"model.name": "tiny-random"}
    random_tiny = phase_config("warmup", "tiny", scratch, "B")
    assert (random_tiny.phase.perception_steps, random_tiny.optim.perception_weight) == (800, 1.0)
    assert phase_config("A", "tiny", scratch, "B").optim.perception_weight == 0.0  # GRPO phases: never
    kept = phase_config("warmup", "tiny", {**scratch, "warmup.phase.perception_steps": "7"}, "B")
    assert (kept.phase.perception_steps, kept.optim.perception_weight) == (7, 1.0)
    for pretrained in ("tiny", str(tmp_path)):
        plain = phase_config("warmup", "tiny", {"model.name": pretrained}, "B")
        assert (plain.phase.perception_steps, plain.optim.perception_weight) == (0, 0.0)
        with pytest.raises(ConfigError, match="pretrained model, which already sees"):
            phase_config("warmup", "tiny", {"model.name": pretrained, "warmup.phase.perception_steps": "5"}, "B")
    with pytest.raises(ConfigError, match="vision_lr_scale=0 freezes the tower"):
        phase_config("warmup", "tiny", {**scratch, "warmup.optim.vision_lr_scale": "0"}, "B")

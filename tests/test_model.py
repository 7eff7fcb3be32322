"""The embedded tiny Qwen2.5-VL: tokenizer, prompt encoding, forward/backward, save/reload, errors."""

from __future__ import annotations

import shutil
import time

import numpy as np
import pytest
import torch
from PIL import Image

from data.contract import format_prompt, format_response
from grpo.model.load import ModelLoadError, load_bundle
from grpo.model.prompts import encode_prompts, prompt_text
from grpo.model.tiny import build_tiny_model, default_model_dir
from grpo.model.tokenizer import CONTRACT_TOKENS, SPECIAL_TOKENS, train_bpe, wrap_for_transformers

SMALL_CORPUS = [format_prompt(f"How many {c} {s} are there?") for c in ("red", "blue") for s in ("circles", "bars")] * 5
SMALL_CORPUS += [format_response(f"I count {k} red circles and {k + 2} blue bars.", str(2 * k + 2)) for k in range(30)]


def _image(seed: int, size=(112, 112)) -> Image.Image:
    arr = np.random.default_rng(seed).integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(arr)


@pytest.fixture(scope="module")
def bundle():
    torch.manual_seed(0)
    return load_bundle("tiny")


# ----------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip_and_special_tokens():
    tok = wrap_for_transformers(train_bpe(SMALL_CORPUS, vocab_size=400))
    text = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>How many 1234? "
            "héllo wörld 🙂 \x00\t\r\n 数学<|im_end|>\n<REASONING>2+2</REASONING>\n<SOLUTION>4</SOLUTION><|im_end|>")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text  # byte-level: anything round-trips, no unknown token
    # Every special / contract token is exactly one id, in Qwen's order after the BPE vocab.
    special_ids = tok.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    assert special_ids == list(range(special_ids[0], special_ids[0] + len(SPECIAL_TOKENS)))
    for t in SPECIAL_TOKENS + CONTRACT_TOKENS:
        assert len(tok(t, add_special_tokens=False)["input_ids"]) == 1, t
    # Digits are split one per token, as in Qwen2.
    digit_tokens = tok.convert_ids_to_tokens(tok("x 1234", add_special_tokens=False)["input_ids"])
    assert digit_tokens[-4:] == ["1", "2", "3", "4"]
    # skip_special_tokens drops chat/vision tokens but keeps the contract tags.
    plain = tok.decode(ids, skip_special_tokens=True)
    assert "<|im_end|>" not in plain and "<|image_pad|>" not in plain
    assert "<REASONING>2+2</REASONING>\n<SOLUTION>4</SOLUTION>" in plain


def test_tokenizer_training_is_deterministic():
    a = train_bpe(SMALL_CORPUS, vocab_size=400).to_str()
    b = train_bpe(list(SMALL_CORPUS), vocab_size=400).to_str()
    assert a == b


def test_bad_tokenizer_arguments():
    with pytest.raises(ValueError, match="corpus is empty"):
        train_bpe([], 512)
    with pytest.raises(ValueError, match="vocab_size=100"):
        train_bpe(SMALL_CORPUS, 100)


def test_config_ids_match_tokenizer(bundle):
    cfg, tok = bundle.model.config, bundle.tokenizer
    assert cfg.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert cfg.video_token_id == tok.convert_tokens_to_ids("<|video_pad|>")
    assert cfg.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
    assert cfg.vision_end_token_id == tok.convert_tokens_to_ids("<|vision_end|>")
    assert cfg.text_config.eos_token_id == bundle.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert cfg.text_config.vocab_size == len(tok)
    n_params = sum(p.numel() for p in bundle.model.parameters())
    assert 0.5e6 < n_params < 3e6


# ----------------------------------------------------------------------------- prompt encoding


def _processor(bundle):
    """transformers' own Qwen2_5_VLProcessor, minus its video processor (which needs torchvision)."""
    from transformers import Qwen2_5_VLProcessor

    class ImageOnlyProcessor(Qwen2_5_VLProcessor):
        def check_argument_for_proper_class(self, name, arg):
            if name == "video_processor" and arg is None:
                return None
            return super().check_argument_for_proper_class(name, arg)

    return ImageOnlyProcessor(image_processor=bundle.image_processor, tokenizer=bundle.tokenizer,
                              video_processor=None, chat_template=bundle.tokenizer.chat_template)


def test_encode_matches_transformers_processor(bundle):
    images = [_image(0), _image(1, (90, 60)), _image(2, (140, 100))]
    questions = ["How many red circles are there?", "What is the sum of the bars?", "Count the shapes."]
    ours = encode_prompts(bundle, (images, questions))
    texts = [prompt_text(bundle, q) for q in questions]
    ref = _processor(bundle)(images=images, text=texts, return_tensors="pt", padding=True)
    for k in ("input_ids", "attention_mask", "mm_token_type_ids", "image_grid_thw"):
        assert torch.equal(ours.model_inputs()[k], ref[k]), k
    assert torch.equal(ours.pixel_values, ref["pixel_values"])
    assert ours.kept == [0, 1, 2] and ours.n_image_tokens.tolist() == [16, 6, 12]  # 140x100 is capped at 112^2 px
    assert (ours.attention_mask[:, -1] == 1).all()  # left padding: every prompt ends at the last column

    with torch.no_grad():
        lo = bundle.model(**ours.model_inputs()).logits
        lr = bundle.model(**{k: ref[k] for k in ref}).logits
        # Without mm_token_type_ids Qwen2.5-VL silently falls back to 1-D positions.
        no_mrope = {k: v for k, v in ours.model_inputs().items() if k != "mm_token_type_ids"}
        l1d = bundle.model(**no_mrope).logits
    mask = ours.attention_mask.bool()
    torch.testing.assert_close(lo[mask], lr[mask], rtol=0, atol=0)
    assert (lo[mask] - l1d[mask]).abs().max() > 1e-4


def test_several_images_a_prompt_match_transformers_processor(bundle):
    """One placeholder per image, every image's patches in order, one grid row per IMAGE: what
    the processor gives for nested images, and the model reads them so (logits equal)."""
    images = [[_image(0), _image(1, (90, 60))], [_image(2, (140, 100))], [_image(3, (56, 84)), _image(4), _image(5)]]
    questions = ["Which is larger?", "Count the shapes.", "Sum over the three?"]
    ours = encode_prompts(bundle, (images, questions))
    texts = [prompt_text(bundle, q, len(im)) for q, im in zip(questions, images)]
    assert [t.count("<|vision_start|><|image_pad|><|vision_end|>") for t in texts] == [2, 1, 3]
    ref = _processor(bundle)(images=images, text=texts, return_tensors="pt", padding=True)
    for k in ("input_ids", "attention_mask", "mm_token_type_ids", "image_grid_thw"):
        assert torch.equal(ours.model_inputs()[k], ref[k]), k
    assert torch.equal(ours.pixel_values, ref["pixel_values"])
    assert ours.images_per_prompt == [2, 1, 3] and ours.image_grid_thw.shape == (6, 3)
    assert ours.n_image_tokens.tolist() == [16 + 6, 12, 6 + 16 + 16]  # each image resized on its own
    assert ours.counts.visual_tokens_max == 38 and ours.counts.resized_down == 1  # the 140x100 image
    with torch.no_grad():
        lo = bundle.model(**ours.model_inputs()).logits
        lr = bundle.model(**{k: ref[k] for k in ref}).logits
    mask = ours.attention_mask.bool()
    torch.testing.assert_close(lo[mask], lr[mask], rtol=0, atol=0)
    # repeated(G): each copy of a prompt brings all of its images, in order
    rep = ours.repeated(2)
    assert rep["image_grid_thw"].tolist() == [g for b, k in ((0, 2), (2, 1), (3, 3))
                                              for _ in range(2) for g in ours.image_grid_thw[b:b + k].tolist()]
    assert rep["pixel_values"].shape[0] == 2 * ours.pixel_values.shape[0]


def test_examples_input_and_bad_images(bundle):
    from data.schema import Example

    good = Example(pid="a", question="How many red circles?", answer="3", image=_image(3))
    no_image = Example(pid="b", question="How many?", answer="1", image=None)
    thin = Example(pid="c", question="How many?", answer="1", image=_image(4, (300, 1)))  # aspect ratio > 200
    with pytest.raises(ValueError, match="item 1: no image"):
        encode_prompts(bundle, [good, no_image])
    with pytest.raises(ValueError, match="item 1: image preprocessing failed"):
        encode_prompts(bundle, [good, thin])
    pb = encode_prompts(bundle, [no_image, good, thin], on_bad_image="skip")
    assert pb.kept == [1] and [i for i, _ in pb.skipped] == [0, 2] and pb.input_ids.shape[0] == 1
    with pytest.raises(ValueError, match="every image failed"):
        encode_prompts(bundle, [no_image], on_bad_image="skip")
    with pytest.raises(ValueError, match="no question text"):
        encode_prompts(bundle, ([_image(5)], [""]))


# ----------------------------------------------------------------------------- training path


def _sft_batch(bundle, n: int):
    """n prompts + contract responses, with labels only on the response tokens."""
    images = [_image(10 + i, (112, 112)) for i in range(n)]
    questions = [f"How many red circles are there? ({i})" for i in range(n)]
    pb = encode_prompts(bundle, (images, questions))
    resp = [bundle.tokenizer(format_response(f"I count {i} circles.", str(i)) + "<|im_end|>",
                             add_special_tokens=False)["input_ids"] for i in range(n)]
    T = max(len(r) for r in resp)
    resp_ids = torch.full((n, T), bundle.pad_token_id)
    resp_mask = torch.zeros((n, T), dtype=torch.long)
    for i, r in enumerate(resp):
        resp_ids[i, : len(r)] = torch.tensor(r)
        resp_mask[i, : len(r)] = 1
    inputs = pb.model_inputs()
    inputs["input_ids"] = torch.cat([pb.input_ids, resp_ids], 1)
    inputs["attention_mask"] = torch.cat([pb.attention_mask, resp_mask], 1)
    inputs["mm_token_type_ids"] = torch.cat([pb.mm_token_type_ids, torch.zeros_like(resp_ids)], 1)
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    labels[:, : pb.input_ids.shape[1]] = -100
    return inputs, labels


def test_forward_backward_with_images(bundle):
    model = bundle.model
    inputs, labels = _sft_batch(bundle, 4)
    model.zero_grad(set_to_none=True)
    out = model(**inputs, labels=labels)
    assert out.logits.shape == (*inputs["input_ids"].shape, len(bundle.tokenizer))
    assert torch.isfinite(out.loss) and out.loss.item() > 0
    out.loss.backward()
    for name in ("lm_head.weight", "model.language_model.layers.0.self_attn.q_proj.weight",
                 "model.visual.merger.mlp.2.weight", "model.visual.patch_embed.proj.weight"):
        g = dict(model.named_parameters())[name].grad
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0, name
    model.zero_grad(set_to_none=True)


def test_forward_backward_timing_32(bundle):
    """Prints the cost of one SFT micro-batch of 32 (no timed assertion: see bench/)."""
    model = bundle.model
    inputs, labels = _sft_batch(bundle, 32)
    model(**inputs, labels=labels).loss.backward()  # warm-up
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    loss = model(**inputs, labels=labels).loss
    loss.backward()
    dt = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    print(f"\ntiny model forward+backward, 32 examples x {inputs['input_ids'].shape[1]} tokens: "
          f"{dt * 1e3:.0f} ms on {torch.get_num_threads()} threads")
    assert torch.isfinite(loss)


# ----------------------------------------------------------------------------- save / reload / errors


def test_save_reload_offline_identical_logits(bundle, tmp_path):
    bundle.model.save_pretrained(tmp_path)
    bundle.tokenizer.save_pretrained(tmp_path)
    bundle.image_processor.save_pretrained(tmp_path)
    again = load_bundle(str(tmp_path))
    pb = encode_prompts(bundle, ([_image(7)], ["How many?"]))
    pb2 = encode_prompts(again, ([_image(7)], ["How many?"]))
    assert torch.equal(pb.input_ids, pb2.input_ids) and torch.equal(pb.pixel_values, pb2.pixel_values)
    with torch.no_grad():
        a = bundle.model(**pb.model_inputs()).logits
        b = again.model(**pb2.model_inputs()).logits
    assert torch.equal(a, b)


def test_build_is_deterministic(tmp_path):
    d1 = build_tiny_model(tmp_path / "a", seed=3, corpus=SMALL_CORPUS)
    d2 = build_tiny_model(tmp_path / "b", seed=3, corpus=SMALL_CORPUS)
    assert (d1 / "tokenizer.json").read_text() == (d2 / "tokenizer.json").read_text()
    m1, m2 = load_bundle(str(d1)).model, load_bundle(str(d2)).model
    for (n1, p1), (_, p2) in zip(m1.named_parameters(), m2.named_parameters()):
        assert torch.equal(p1, p2), n1


def test_default_dir_is_reused():
    assert default_model_dir() == default_model_dir()
    assert (default_model_dir() / "model.safetensors").is_file()


def test_a_changed_architecture_gets_its_own_cache_entry(monkeypatch):
    """The cache is keyed by the architecture as well as the tokenizer's corpus: when the tower
    was widened, a cache keyed by the corpus alone handed back the old, narrower build."""
    from grpo.model import tiny

    before = default_model_dir()
    assert before.name == tiny._cache_name(0)
    wider = dict(tiny.TINY_VISION, hidden_size=tiny.TINY_VISION["hidden_size"] * 2)
    monkeypatch.setattr(tiny, "TINY_VISION", wider)
    tiny._build_fingerprint.cache_clear()
    try:
        assert tiny._cache_name(0) != before.name
    finally:
        monkeypatch.undo()
        tiny._build_fingerprint.cache_clear()
    assert default_model_dir() == before


def test_a_damaged_cache_entry_is_built_again(tmp_path, monkeypatch):
    monkeypatch.setenv("VLGRPO_CACHE", str(tmp_path))
    first = default_model_dir()
    (first / "model.safetensors").unlink()  # the marker stays: the entry must not be trusted
    again = default_model_dir()
    assert again == first and (again / "model.safetensors").is_file()
    load_bundle("tiny-random")  # and it loads


def test_a_rank_other_than_0_builds_a_whole_copy(tmp_path, monkeypatch):
    """In a data-parallel run every rank builds the cache and the first rename wins; transformers'
    save_pretrained writes nothing but on rank 0 of a process group, so rank 1's copy had no
    weights. Here transformers is told it runs as rank 1 of a process group."""
    import transformers.distributed.mixin as mixin

    monkeypatch.setattr(mixin, "_is_torch_distributed_initialized", lambda: True)
    monkeypatch.setattr(mixin, "_get_torch_distributed_rank", lambda: 1)
    out = build_tiny_model(tmp_path / "rank1", seed=3, corpus=SMALL_CORPUS)
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    load_bundle(str(out))


def test_clear_load_errors(tmp_path, monkeypatch):
    with pytest.raises(ModelLoadError, match="'/no/such/model' does not exist"):
        load_bundle("/no/such/model")
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_bundle(str(tmp_path))
    corrupt = tmp_path / "corrupt"
    shutil.copytree(default_model_dir(), corrupt)
    (corrupt / "tokenizer.json").write_text("{ not json")
    with pytest.raises(ModelLoadError, match="could not load the tokenizer from directory"):
        load_bundle(str(corrupt))
    # A hub id without hub access: one error that says to download it. Offline mode keeps
    # the test from waiting on network retries.
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="hub id 'Qwen/Qwen2.5-VL-7B-Instruct'.*hf download"):
        load_bundle("Qwen/Qwen2.5-VL-7B-Instruct")

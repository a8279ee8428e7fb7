"""The tiny Qwen2-VL: built offline from the shipped config, frozen vision tower, a local checkpoint round
trip, mrope log-probs that do not depend on the batch a row sits in, and image tokens that cannot disagree
with the images."""

import json

import attrs
import pytest
import torch
from PIL import Image

from rlgraph.backends.local.vlm import (
    IMAGE_PAD, TINY_VL_CONFIG, ImageTokenError, build_image_processor, build_vision_lm, build_vl_tokenizer,
    check_image_tokens, encode_vl_batch, tiny_vl_config, vl_token_logprobs,
)


@pytest.fixture(scope="module")
def vl():
    tokenizer = build_vl_tokenizer()
    model = build_vision_lm(tokenizer=tokenizer, seed=0)
    return tokenizer, model, build_image_processor(model.config, max_pixels=32 * 32)


def _batch(vl, texts, images):
    tokenizer, _, processor = vl
    return encode_vl_batch(tokenizer, processor, texts, images)


RED, TALL = Image.new("RGB", (32, 32), (255, 0, 0)), Image.new("RGB", (24, 40), (0, 90, 200))


def test_shipped_config_is_the_builder_output_and_freezes_the_vision_tower(vl):
    _, model, _ = vl
    assert json.loads(TINY_VL_CONFIG.read_text()) == tiny_vl_config()
    text = model.config.get_text_config()
    assert sum(text.rope_parameters["mrope_section"]) == text.hidden_size // text.num_attention_heads // 2
    visual = {id(p) for p in model.model.visual.parameters()}
    assert visual and all(not p.requires_grad for p in model.model.visual.parameters())
    assert all(p.requires_grad for p in model.parameters() if id(p) not in visual)
    trained = build_vision_lm(seed=0, train_vision=True)
    assert all(p.requires_grad for p in trained.parameters())


def test_image_tokens_follow_the_grid(vl):
    tokenizer, model, _ = vl
    batch = _batch(vl, ["how many=", "ab="], [[RED], [TALL]])
    # 32x32 -> 8x8 patches of 4 px -> 16 tokens; 24x40 -> 6x10 patches -> 15 tokens (2x2 merge)
    assert batch.image_grid_thw.tolist() == [[1, 8, 8], [1, 10, 6]]
    pad = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    assert (batch.ids == pad).sum(-1).tolist() == [16, 15]
    check_image_tokens(batch, model.config.image_token_id, 2)


def test_a_row_scores_the_same_alone_and_left_padded_in_a_batch(vl):
    _, model, _ = vl
    with torch.no_grad():
        both = vl_token_logprobs(model, _batch(vl, ["how many=", "ab="], [[RED], [TALL]]))
        alone = vl_token_logprobs(model, _batch(vl, ["ab="], [[TALL]]))
        blank = vl_token_logprobs(model, _batch(vl, ["ab="], [[Image.new("RGB", (24, 40))]]))
    width = alone.shape[1]
    # the same float32 ops over different padding: a few ulps of log-probs of magnitude ~4
    torch.testing.assert_close(both[1, -width:], alone[0], atol=1e-5, rtol=0)
    assert (both[1, :-width] == 0).all()
    assert (blank - alone).abs().max() > 1e-4  # the pixels reach the text's log-probs


def test_a_row_whose_tokens_disagree_with_its_image_is_named(vl):
    tokenizer, model, _ = vl
    batch = _batch(vl, ["how many=", "ab="], [[RED], [TALL]])
    pad = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    ids = batch.ids.clone()
    ids[1, (ids[1] == pad).nonzero()[0, 0]] = tokenizer.convert_tokens_to_ids("a")  # one image token lost
    with pytest.raises(ImageTokenError, match=r"row 1: 14 image tokens .* give 15"):
        vl_token_logprobs(model, attrs.evolve(batch, ids=ids))
    with pytest.raises(ImageTokenError, match="lists 1 images .* image_grid_thw has 2"):
        check_image_tokens(attrs.evolve(batch, images_per_row=(1, 0)), pad, 2)


def test_checkpoint_round_trip_from_a_local_directory(vl, tmp_path):
    tokenizer, model, _ = vl
    model.save_pretrained(tmp_path)
    loaded = build_vision_lm(tmp_path, tokenizer=tokenizer)
    batch = _batch(vl, ["ab="], [[TALL]])
    with torch.no_grad():
        torch.testing.assert_close(vl_token_logprobs(loaded, batch), vl_token_logprobs(model, batch), atol=0, rtol=0)
    assert not any(p.requires_grad for p in loaded.model.visual.parameters())


def test_bad_sources_and_budgets_are_named(vl, tmp_path):
    tokenizer, model, _ = vl
    with pytest.raises(ValueError, match="model_type='qwen2'"):
        build_vision_lm(TINY_VL_CONFIG.parent / "tiny_qwen2.json")
    with pytest.raises(ValueError, match="does not exist"):
        build_vision_lm(tmp_path / "nowhere.json")
    small = {**tiny_vl_config(), "text_config": {**tiny_vl_config()["text_config"], "vocab_size": 10}}
    with pytest.raises(ValueError, match="vocab_size=10 is smaller"):
        build_vision_lm(small, tokenizer=tokenizer)
    for budget in (0, 63, 1e6):
        with pytest.raises(ValueError, match="max_pixels"):
            build_image_processor(model.config, max_pixels=budget)


def tiny_qwen2_5_vl_config(tokenizer) -> dict:
    """The tiny Qwen2-VL's language model under a tiny Qwen2.5-VL tower: RMSNorm, a gated SiLU MLP, window
    attention (16-pixel windows: 2x2 merged patches) in block 0 and full attention in block 1."""
    vision = {"depth": 2, "hidden_size": 32, "out_hidden_size": 64, "intermediate_size": 48, "num_heads": 2,
              "in_channels": 3, "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2,
              "window_size": 16, "fullatt_block_indexes": [1]}
    return {**tiny_vl_config(tokenizer), "model_type": "qwen2_5_vl",
            "architectures": ["Qwen2_5_VLForConditionalGeneration"], "vision_config": vision}


def test_a_qwen2_5_vl_loads_from_a_local_directory_and_scores_a_row_as_it_does_alone(vl, tmp_path):
    tokenizer, _, _ = vl
    model = build_vision_lm(tiny_qwen2_5_vl_config(tokenizer), tokenizer=tokenizer, seed=1)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    model.save_pretrained(tmp_path)
    loaded = build_vision_lm(tmp_path, tokenizer=tokenizer)
    assert type(loaded).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert not any(p.requires_grad for p in loaded.model.visual.parameters())
    processor = build_image_processor(loaded.config, max_pixels=32 * 32)
    batch = encode_vl_batch(tokenizer, processor, ["how many=", "ab="], [[RED], [TALL]])
    with torch.no_grad():
        both = vl_token_logprobs(loaded, batch)
        alone = vl_token_logprobs(loaded, encode_vl_batch(tokenizer, processor, ["ab="], [[TALL]]))
        torch.testing.assert_close(vl_token_logprobs(model, batch), both, atol=0, rtol=0)  # the same weights, read back
        blank = vl_token_logprobs(loaded, encode_vl_batch(tokenizer, processor, ["ab="], [[Image.new("RGB", (24, 40))]]))
    width = alone.shape[1]
    torch.testing.assert_close(both[1, -width:], alone[0], atol=1e-5, rtol=0)  # a few ulps of log-probs ~4, as above
    assert (blank - alone).abs().max() > 1e-4  # the pixels reach the text through the windowed tower

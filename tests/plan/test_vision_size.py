"""Vision-tower arithmetic against transformers' own Qwen2-VL / Qwen2.5-VL towers and the published 7B."""

import pytest
import torch
from transformers import AutoModelForImageTextToText

from rlgraph.plan.model_size import ModelShape
from rlgraph.plan.presets import load_model_config
from rlgraph.plan.vision_size import DEFAULT_PIXEL_BUDGET, VisionShape

TEXT = {"vocab_size": 50, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}
VISION = {
    "qwen2_vl": {"depth": 2, "embed_dim": 16, "hidden_size": 32, "num_heads": 2, "mlp_ratio": 3, "patch_size": 4,
                 "spatial_merge_size": 2, "temporal_patch_size": 2},
    "qwen2_5_vl": {"depth": 2, "hidden_size": 16, "out_hidden_size": 32, "intermediate_size": 24, "num_heads": 2,
                   "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2, "fullatt_block_indexes": [1]},
}


@pytest.mark.parametrize("kind", sorted(VISION))
def test_parameters_equal_a_random_init_transformers_model(kind):
    from transformers import AutoConfig

    fields = {"model_type": kind, "text_config": TEXT, "vision_config": VISION[kind]}
    config = AutoConfig.for_model(kind, text_config=TEXT, vision_config=VISION[kind])
    model = AutoModelForImageTextToText.from_config(config)
    shape = ModelShape.from_hf_config(fields)
    assert shape.vision.n_params == sum(p.numel() for p in model.model.visual.parameters())
    assert shape.n_params == sum(p.numel() for p in model.parameters())
    assert shape.trainable_params == shape.n_params - shape.vision.n_params  # frozen by default


def test_the_published_7b_and_its_pixel_budget():
    shape = ModelShape.from_hf_config(load_model_config("qwen2.5-vl-7b"))
    assert shape.n_params == 8_292_166_656  # the model card's 8.29B
    assert shape.vision.n_params == 676_550_144
    assert shape.vision.image_tokens(DEFAULT_PIXEL_BUDGET) == 1280
    assert shape.vision.image_tokens(448 * 448) == 256  # 16 x 16 merged 28-px blocks
    # a frozen tower runs forward only; training it triples (backward = 2 forwards)
    frozen = shape.vision.flops_per_image(DEFAULT_PIXEL_BUDGET, training=False)
    assert shape.vision.flops_per_image(DEFAULT_PIXEL_BUDGET, training=True) == 3 * frozen
    patches = 1280 * 4  # 2 FLOPs per weight per patch bound it from below
    assert frozen > 2 * patches * 32 * shape.vision.block_params
    trained, frozen_bytes = (shape.vision.activation_bytes_per_image(DEFAULT_PIXEL_BUDGET, torch.bfloat16, training=flag)
                             for flag in (True, False))
    assert trained > 16 * frozen_bytes  # 32 blocks kept against one block's working set (+ the output)


def test_not_a_vision_model_is_refused_by_name():
    with pytest.raises(ValueError, match="model_type='qwen2'"):
        VisionShape.from_hf_config(load_model_config("qwen2.5-7b"))
    with pytest.raises(ValueError, match="kind"):
        VisionShape("llava", 1, 8, 1, 8, 8, 4, 2)

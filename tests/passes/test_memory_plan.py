"""The memory plan of vision-language models: image tokens lengthen every row, the vision tower is held but
not trained when frozen, its activations are counted, and the pixel budget is a setting the plan prints."""

import pytest

import rlgraph as rg
from rlgraph.algorithms import grpo
from rlgraph.errors import ConfigError
from rlgraph.plan.model_size import ModelShape
from rlgraph.plan.plan import Plan
from rlgraph.plan.presets import load_model_config

SIZES = {"B": 4, "P": 16, "T": 8}
TINY = ModelShape.from_hf_config(load_model_config("tiny-qwen2-vl"))


def _plan(**options):
    return rg.compile(grpo, mesh="cpu:1", sizes=SIZES, models={"policy": "tiny-qwen2-vl"}, n=2, **options).plan


def test_the_plan_prints_the_tower_and_the_pixel_budget():
    plan = _plan(pixel_budget=32 * 32, images_per_prompt=2)
    facts = plan.vision["policy"]
    assert facts["tower_params"] == TINY.vision.n_params == 44_992
    assert facts["tokens_per_image"] == 16  # 32x32 px / (4 px patch * 2 merge)^2
    assert facts["flops_per_image"] == int(TINY.vision.flops_per_image(1024, training=False))
    text = plan.as_text()
    assert ("vision policy: tower 44,992 params (frozen); pixel budget 1,024 px an image -> <= 16 image tokens; "
            "2 image(s) a prompt = 32 tokens counted in every sequence beside P") in text
    assert Plan.from_json(plan.to_json()).vision == plan.vision


def test_a_frozen_tower_is_held_but_has_no_gradients_or_optimizer_state():
    train = _plan(pixel_budget=32 * 32).memory["policy"]["train"]
    assert train["params"] == TINY.n_params * 4  # float32 on a cpu mesh, one shard
    assert train["grads"] == (TINY.n_params - TINY.vision.n_params) * 4


def test_image_tokens_and_tower_activations_grow_with_the_budget():
    small, large = (_plan(pixel_budget=budget).memory["policy"] for budget in (16 * 16, 64 * 64))
    for phase in ("train", "generate"):
        assert large[phase]["activations"] > small[phase]["activations"]
    text = _plan(images_per_prompt=0).memory["policy"]  # no image: the text model's rows
    assert _plan(pixel_budget=16 * 16).memory["policy"]["train"]["activations"] > text["train"]["activations"]


@pytest.mark.parametrize("bad", [0, -5, 1.5, "1024"])
def test_bad_pixel_budgets_are_refused_by_name(bad):
    with pytest.raises(ConfigError, match=r"pixel_budget=.* whole number of pixels"):
        _plan(pixel_budget=bad)


def test_budgets_below_one_token_and_images_that_overflow_a_packed_micro_batch_are_refused():
    with pytest.raises(ConfigError, match=r"pixel_budget=63 is smaller than one 8x8-pixel block"):
        _plan(pixel_budget=63)
    with pytest.raises(ConfigError, match=r"images_per_prompt=-1"):
        _plan(images_per_prompt=-1)
    with pytest.raises(ConfigError, match=r"P=16 \+ 16 image tokens \+ T=8 = 40"):
        _plan(pixel_budget=32 * 32, micro_batch_tokens=30)

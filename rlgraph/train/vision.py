"""A vision-language run of `rlgraph train` (the `vision:` section, docs/vlm.md).

What changes against a text run, and only that: the tokenizer gains Qwen2-VL's vision tokens, the
policy is a Qwen2-VL / Qwen2.5-VL (the shipped tiny one when `model.path` is null), every row's images
are decoded and checked while the data loads (before step 1), and a batch of rows becomes `Prompts`
(or SFT `Rollouts`) whose rows carry their pixels (`vl_prompts`). The plan counts the images under
the pixel budget. Combinations not built yet are refused here, before any model exists.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from rlgraph.backends.local.vlm import build_image_processor, build_vl_tokenizer, vl_config, vl_prompts
from rlgraph.backends.vllm.convert import VISION_ON_VLLM
from rlgraph.batches import Prompts, Rollouts
from rlgraph.data.images import open_row_images
from rlgraph.data.prompts import encode_responses, to_prompts
from rlgraph.errors import ConfigError
from rlgraph.train.config import TrainConfig

TINY_VL_PRESET = "tiny-qwen2-vl"


def check_vision(config: TrainConfig) -> None:
    """Refuse what a vision run cannot do yet, naming the key (docs/vlm.md lists these)."""
    if config.runtime.engine != "native":
        raise ConfigError(f"runtime.engine: {config.runtime.engine!r} for a vision run (the vision: section); "
                          f"{VISION_ON_VLLM}", fix="runtime.engine: native, which generates with the images and "
                          "mrope positions (docs/vlm.md, 'On vLLM')")
    refused = {"env": config.env is not None, "model.teachers": bool(config.model.teachers)}
    for key, bad in refused.items():
        if bad:
            raise ConfigError(f"{key}: a vision run (the vision: section) is built without teachers or an "
                              f"environment; {key} asks for more",
                              fix=f"remove {key} (or set it to its default) for a vision run; docs/vlm.md says what is "
                                  "supported")
    runtime = config.runtime
    if runtime.runtime == "local":
        return
    if runtime.runtime == "ray":  # the same recipe reaches the actors; what is missing is a test that fits the suite
        raise ConfigError("runtime.runtime=ray: a vision run is tested on the local and spmd runtimes only; the Ray "
                          "actors build the same roles, but no test checks a vision run there against the local run "
                          "(a Ray cluster start is more than the test suite's time allows)",
                          fix="runtime.runtime: spmd (worker processes on this machine) or local")
    if config.model.lora is not None:  # `RoleSpec.build_lora_on_meta` builds the base with `build_causal_lm`
        raise ConfigError(f"model.lora with runtime.runtime={runtime.runtime}: a vision run's LoRA trains on the local "
                          "runtime only (the ranks build a LoRA role's base on the meta device as a text model, "
                          "which a Qwen2-VL config is not)",
                          fix="runtime.runtime: local for a LoRA vision run, or remove model.lora (full weights on spmd)")


def vision_tokenizer(source: str | None) -> Any:
    """The run's tokenizer (`source`, else the shipped character one) with the three vision tokens."""
    return build_vl_tokenizer(source)


def vision_models(config: TrainConfig) -> dict[str, str]:
    """The plan's model source of the policy: its directory, or the shipped tiny Qwen2-VL's preset."""
    return {"policy": config.model.path or TINY_VL_PRESET}


@attrs.define
class VisionBatches:
    """Rows -> batches whose rows carry their images: `prompts(rows)` and `demonstrations(rows)`."""

    tokenizer: Any
    processor: Any
    images: dict[str, tuple[Any, ...]] = attrs.field(factory=dict)  # row.source -> its decoded images

    def add(self, rows: Sequence[Any], path: str | Path, config: TrainConfig) -> None:
        """Decode and check every image of `rows` (read from `path`), before step 1."""
        assert config.vision is not None
        self.images.update(open_row_images(rows, path, image_field=config.vision.image_field,
                                           max_pixels=config.vision.pixel_budget))

    def prompts(self, rows: Sequence[Any]) -> Prompts:
        meta = to_prompts(rows, self.tokenizer).meta  # the text batch's meta: answers and fields for the rewards
        return vl_prompts(self.tokenizer, self.processor, [row.text for row in rows],
                          [list(self.images[row.source]) for row in rows], meta)

    def demonstrations(self, rows: Sequence[Any]) -> Rollouts:
        """The prompts with their images, each answer then EOS as the response (a warm start's SFT batch)."""
        response, mask = encode_responses([str(row.answer) for row in rows], self.tokenizer)  # [B, T] each
        return Rollouts.from_demonstrations(self.prompts(rows), response, mask)


def vision_batches(config: TrainConfig, tokenizer: Any, splits: Sequence[tuple[Sequence[Any], str]]) -> VisionBatches:
    """The run's `VisionBatches` with every row of `splits` ((rows, data path) each) decoded."""
    assert config.vision is not None
    model_config, _ = vl_config(config.model.path)
    budget = config.vision.pixel_budget
    try:
        processor = build_image_processor(model_config, max_pixels=budget)
    except ValueError as error:
        raise ConfigError(f"vision.pixel_budget: {error}", fix="a budget of at least one merged block of patches "
                          "(64 px for the tiny Qwen2-VL, 784 for Qwen2.5-VL)") from None
    batches = VisionBatches(tokenizer, processor)
    for rows, path in splits:
        batches.add(rows, path, config)
    return batches

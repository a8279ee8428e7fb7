"""Vision towers of Qwen2-VL / Qwen2.5-VL: exact parameters, image tokens under a pixel budget, FLOPs and
activation bytes per image. Pure arithmetic from a `config.json`; nothing is built.

    vision = VisionShape.from_hf_config(load_model_config("qwen2.5-vl-7b"))
    vision.n_params                         # 676_550_144
    vision.image_tokens(DEFAULT_PIXEL_BUDGET)   # 1280: (28 px)^2 a token after the 2x2 merge

An image is resized (Qwen's `smart_resize`) to h x w, multiples of patch*merge pixels with h*w <= the
pixel budget, and cut into (h/p)(w/p) patches; each merge x merge block of patches becomes one
token of the language model. So tokens <= budget / (patch*merge)^2, reached by a square image.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

# Qwen2.5-VL's recommended `max_pixels` (1280 tokens of 28x28 pixels), the plan's default budget.
DEFAULT_PIXEL_BUDGET = 1280 * 28 * 28
VISION_KINDS = ("qwen2_vl", "qwen2_5_vl")


@attrs.frozen
class VisionShape:
    """`kind` "qwen2_vl": LayerNorms and a GELU MLP of width `intermediate`; "qwen2_5_vl": RMSNorms and
    a SwiGLU MLP (gate, up, down, with biases). Both: a bias-free Conv3d patch embedding over
    `temporal` frames of `patch` x `patch` pixels, qkv and output projections with biases, and a merger
    (norm, then two linears with biases: [merge^2 * width] -> same -> `out_hidden`)."""

    kind: str = attrs.field(validator=attrs.validators.in_(VISION_KINDS))
    depth: int
    width: int
    heads: int
    intermediate: int
    out_hidden: int
    patch: int
    merge: int
    temporal: int = 2
    channels: int = 3

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> VisionShape:
        """From a Qwen2-VL / Qwen2.5-VL `config.json` (its `vision_config`, in either family's field names)."""
        kind = config.get("model_type")
        vision = config.get("vision_config")
        if kind not in VISION_KINDS or not isinstance(vision, Mapping):
            raise ValueError(f"model config (model_type={kind!r}) is no vision-language model the memory model "
                             f"sizes; give a {' or '.join(VISION_KINDS)} config.json with a vision_config")
        if kind == "qwen2_vl":  # embed_dim is the tower's width, hidden_size what the merger outputs
            width, out, inter = vision["embed_dim"], vision["hidden_size"], vision["embed_dim"] * vision["mlp_ratio"]
        else:
            width, out, inter = vision["hidden_size"], vision["out_hidden_size"], vision["intermediate_size"]
        return cls(kind, vision["depth"], width, vision["num_heads"], int(inter), out, vision["patch_size"],
                   vision["spatial_merge_size"], vision.get("temporal_patch_size", 2),
                   vision.get("in_channels", vision.get("in_chans", 3)))

    # -- sizes -------------------------------------------------------------------------------
    @property
    def _norm_params(self) -> int:
        return self.width * (2 if self.kind == "qwen2_vl" else 1)  # LayerNorm has a bias, RMSNorm none

    @property
    def _mlp_matrices(self) -> int:
        return 2 if self.kind == "qwen2_vl" else 3  # fc1, fc2 | gate, up, down

    @property
    def block_params(self) -> int:
        w, inter = self.width, self.intermediate
        attention = 3 * w * w + 3 * w + w * w + w
        mlp = self._mlp_matrices * w * inter + (self._mlp_matrices - 1) * inter + w
        return 2 * self._norm_params + attention + mlp

    @property
    def merger_params(self) -> int:
        wide = self.width * self.merge ** 2
        return self._norm_params + wide * wide + wide + wide * self.out_hidden + self.out_hidden

    @property
    def patch_embed_params(self) -> int:
        return self.channels * self.temporal * self.patch ** 2 * self.width

    @property
    def n_params(self) -> int:
        """Exact for transformers' Qwen2-VL / Qwen2.5-VL vision towers (tested against them)."""
        return self.patch_embed_params + self.depth * self.block_params + self.merger_params

    # -- per image ---------------------------------------------------------------------------
    def image_tokens(self, pixel_budget: int) -> int:
        """The most language-model tokens one image gives under `pixel_budget` pixels."""
        return pixel_budget // (self.patch * self.merge) ** 2

    def pixel_bytes_per_image(self, pixel_budget: int) -> int:
        """Bytes of one image as a batch row carries it at the budget's most patches: its fp32
        `pixel_values` (channels x temporal x patch^2 values a patch) and its i64 (t, h, w) grid."""
        patches = self.image_tokens(pixel_budget) * self.merge ** 2
        return patches * self.channels * self.temporal * self.patch ** 2 * 4 + 3 * 8

    def flops_per_image(self, pixel_budget: int, *, training: bool) -> float:
        """Matmul FLOPs of one image at the budget's most patches: 2 per weight per patch (the merger's
        per merged token), plus 4 * patches^2 * width per block for full attention (Qwen2.5-VL windows most
        blocks: an upper bound there). Training the tower is 3x (backward 2x); frozen it runs forward only."""
        tokens = self.image_tokens(pixel_budget)
        patches = tokens * self.merge ** 2
        per_patch = self.patch_embed_params + self.depth * (self.block_params - 2 * self._norm_params)
        merger = self.merger_params - self._norm_params
        forward = 2 * patches * per_patch + 2 * tokens * merger + 4 * self.depth * patches ** 2 * self.width
        return float(forward * (3 if training else 1))

    def activation_bytes_per_image(self, pixel_budget: int, dtype: torch.dtype, *, training: bool) -> int:
        """Bytes one image holds through a forward at the budget's most patches (fused attention).

        Trained: every block keeps its inputs for backward: 2 norm inputs, the normed input, q/k/v,
        the attention output and the MLP's hidden (k * intermediate, k = 2 GELU, 3 SwiGLU), ~ (7w + k*i)
        a patch, plus the merged output. Frozen: one block's working set at a time and the output
        features the language model reads (and backpropagates into, not through).
        """
        patches = self.image_tokens(pixel_budget) * self.merge ** 2
        e = dtype.itemsize
        block = patches * (7 * self.width + self._mlp_matrices * self.intermediate) * e
        output = self.image_tokens(pixel_budget) * self.out_hidden * e
        return (self.depth * block if training else block) + output

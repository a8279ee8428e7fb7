"""Vision-language models: a tiny Qwen2-VL built offline, its image processor, and the checked forward.

    tokenizer = build_vl_tokenizer()               # the character tokenizer + the three vision tokens
    model = build_vision_lm(None, tokenizer=tokenizer)   # the shipped tiny Qwen2-VL, vision tower frozen
    processor = build_image_processor(model.config, max_pixels=32 * 32)
    batch = encode_vl_batch(tokenizer, processor, ["how many=", "colour="], [[img_a], [img_b]])
    lp = vl_token_logprobs(model, batch)           # f32[B, L-1], positions by mrope

Nothing downloads: the config is `rlgraph/assets/tiny_qwen2_vl.json`, a checkpoint loads only from a
local directory. Transformers' `Qwen2VLProcessor` needs torchvision (its video processor), which the
venv does not have, so rlgraph expands each image into its image tokens itself: the expansion is
owned by this module alone, and `check_image_tokens` refuses a row whose tokens and grid disagree,
naming the row, before the model's own batch-wide check could.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from transformers import (AutoConfig, AutoModelForImageTextToText, PretrainedConfig, PreTrainedModel,
                          PreTrainedTokenizerFast)

from rlgraph.backends.local.models import ASSETS, ATTENTION, WEIGHT_FILES, build_char_tokenizer, load_tokenizer
from rlgraph.batches import Prompts
from rlgraph.errors import RLGraphError

TINY_VL_CONFIG = ASSETS / "tiny_qwen2_vl.json"
# Qwen2-VL's own names for the tokens that open, fill and close an image.
VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
VL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")


class ImageTokenError(RLGraphError, ValueError):
    """A row whose image tokens and images (grids) disagree: the model would mix up image features."""


def build_vl_tokenizer(path: str | Path | None = None) -> PreTrainedTokenizerFast:
    """The tokenizer at `path` (default: the shipped character tokenizer) with Qwen2-VL's three
    vision tokens added as special tokens (ids `len(tokenizer)`, +1, +2 when they are new)."""
    tokenizer = load_tokenizer(path) if path is not None else build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [VISION_START, IMAGE_PAD, VISION_END]})
    return tokenizer


def tiny_vl_config(tokenizer: PreTrainedTokenizerFast | None = None) -> dict[str, Any]:
    """The shipped tiny Qwen2-VL (~172k parameters, ~45k in the vision tower) as a config dict.

    Text: the tiny Qwen2 (hidden 64, 4 heads of 16, 2 layers); mrope_section [2, 3, 3] sums to
    head_dim / 2 = 8 (temporal, height, width rotary frequencies). Vision: 2 blocks of width 32,
    4-pixel patches, 2x2 merge, so a 32x32 image is 8x8 patches and 16 image tokens.
    """
    tokenizer = tokenizer if tokenizer is not None else build_vl_tokenizer()
    start, pad, end = tokenizer.convert_tokens_to_ids([VISION_START, IMAGE_PAD, VISION_END])
    text = {"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu", "initializer_range": 0.02,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}, "tie_word_embeddings": True,
            "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id}
    vision = {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2, "in_channels": 3,
              "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2}
    return {"model_type": "qwen2_vl", "architectures": ["Qwen2VLForConditionalGeneration"],
            "text_config": text, "vision_config": vision, "image_token_id": pad, "video_token_id": pad,
            "vision_start_token_id": start, "vision_end_token_id": end, "tie_word_embeddings": True}


def vl_config(source: str | Path | Mapping[str, Any] | None) -> tuple[PretrainedConfig, Path | None]:
    """(config, checkpoint directory or None) of a Qwen2-VL / Qwen2.5-VL `source`: a checkpoint
    directory, a config JSON, a config dict, or None (the shipped tiny one)."""
    source = TINY_VL_CONFIG if source is None else source
    checkpoint, where = None, "the config dict"
    if not isinstance(source, Mapping):
        path = Path(source)
        if path.is_dir():
            checkpoint = path if any((path / name).is_file() for name in WEIGHT_FILES) else None
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"build_vision_lm: {str(path)!r} does not exist; pass a checkpoint directory, a config "
                             "JSON, a config dict, or None for the shipped tiny Qwen2-VL")
        source, where = json.loads(path.read_text()), str(path)
    fields = dict(source)
    kind = fields.pop("model_type", None)
    if kind not in VL_MODEL_TYPES:
        raise ValueError(f"build_vision_lm: {where} has model_type={kind!r}; a vision-language model is one of "
                         f"{', '.join(VL_MODEL_TYPES)} (a text-only model is built by build_causal_lm)")
    fields.pop("transformers_version", None)
    return AutoConfig.for_model(kind, **fields), checkpoint


def is_vl_source(source: Any) -> bool:
    """Whether `source` (a config dict, a config JSON, or a model directory) is a Qwen2-VL / Qwen2.5-VL:
    what a builder that takes any model source dispatches on (None, the tiny Qwen2, is not)."""
    if isinstance(source, Mapping):
        return source.get("model_type") in VL_MODEL_TYPES
    if not isinstance(source, (str, Path)):
        return False
    path = Path(source) / "config.json" if Path(source).is_dir() else Path(source)
    try:
        return json.loads(path.read_text()).get("model_type") in VL_MODEL_TYPES
    except (OSError, ValueError, AttributeError):
        return False  # not a readable config: the text builder names what is wrong with it


def build_language_model(source: Any = None, *, tokenizer: PreTrainedTokenizerFast | None = None, seed: int = 0,
                         dtype: torch.dtype = torch.float32, train_vision: bool = False) -> PreTrainedModel:
    """`build_vision_lm` for a Qwen2-VL / Qwen2.5-VL source, else `build_causal_lm`: for the builders that
    take any model source (every role recipe's, and the generation engines)."""
    if is_vl_source(source):
        return build_vision_lm(source, tokenizer=tokenizer, seed=seed, dtype=dtype, train_vision=train_vision)
    from rlgraph.backends.local.models import build_causal_lm

    return build_causal_lm(source, tokenizer=tokenizer, seed=seed, dtype=dtype)


def build_vision_lm(
    source: str | Path | Mapping[str, Any] | None = None, *, tokenizer: PreTrainedTokenizerFast | None = None,
    seed: int = 0, dtype: torch.dtype = torch.float32, train_vision: bool = False,
) -> PreTrainedModel:
    """A Qwen2-VL / Qwen2.5-VL in train mode on the CPU, its vision tower frozen unless `train_vision`.

    Like `build_causal_lm`: weights from a local checkpoint directory (`from_pretrained`, local files
    only), else drawn from a generator seeded with `seed` (the global RNG untouched).
    """
    config, checkpoint = vl_config(source)
    vocab = config.get_text_config().vocab_size
    if tokenizer is not None and vocab < len(tokenizer):
        raise ValueError(f"build_vision_lm: the config's vocab_size={vocab} is smaller than the tokenizer "
                         f"({len(tokenizer)} tokens, vision tokens included); set vocab_size >= {len(tokenizer)}")
    if checkpoint is not None:
        model = AutoModelForImageTextToText.from_pretrained(str(checkpoint), local_files_only=True, dtype=dtype,
                                                            attn_implementation=ATTENTION)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForImageTextToText.from_config(config, dtype=dtype, attn_implementation=ATTENTION)
    # Frozen by default: the vision tower is most of what a small VLM step would otherwise train, and
    # RL on a language reward rarely needs it (verl and TRL freeze it by default too).
    model.model.visual.requires_grad_(train_vision)
    return model.train()


def build_image_processor(config: PretrainedConfig, *, max_pixels: int, min_pixels: int | None = None):
    """Qwen2-VL's PIL image processor sized to `config`'s vision tower: images are resized to a multiple
    of patch*merge pixels a side with at most `max_pixels` (the pixel budget) and at least `min_pixels`."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    vision = config.vision_config
    side = vision.patch_size * vision.spatial_merge_size
    min_pixels = side * side if min_pixels is None else min_pixels
    if not (isinstance(max_pixels, int) and max_pixels >= min_pixels):
        raise ValueError(f"build_image_processor: max_pixels={max_pixels!r} must be an int >= {min_pixels} "
                         f"(one {side}x{side} block of merged patches)")
    return Qwen2VLImageProcessorPil(patch_size=vision.patch_size, merge_size=vision.spatial_merge_size,
                                    temporal_patch_size=vision.temporal_patch_size,
                                    min_pixels=min_pixels, max_pixels=max_pixels)


@attrs.frozen
class VLBatch:
    """One padded (left) batch of prompts with their images, as the model's forward takes it.

    `ids`/`mask`: [B, L]; `pixel_values`: [patches, C*t*p*p] of every image in row order;
    `image_grid_thw`: [images, 3]; `images_per_row`: how many of the images each row holds.
    """

    ids: torch.Tensor
    mask: torch.Tensor
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    images_per_row: tuple[int, ...]


def image_token_counts(grid_thw: torch.Tensor, merge: int) -> list[int]:
    """Image tokens of each image: its t*h*w patches, merged merge x merge into one token."""
    return (grid_thw.prod(-1) // (merge * merge)).tolist()


def encode_vl_batch(tokenizer: PreTrainedTokenizerFast, processor: Any, texts: Sequence[str],
                    images: Sequence[Sequence[Any]]) -> VLBatch:
    """Each row's images (PIL) placed before its text, each as start + one pad token per merged patch +
    end: the expansion the model's `image_grid_thw` implies, done once, here."""
    if len(texts) != len(images):
        raise ValueError(f"encode_vl_batch: {len(texts)} texts but {len(images)} image lists; give one list a row")
    flat = [image for row in images for image in row]
    encoded = processor(flat, return_tensors="pt") if flat else None
    grid = encoded["image_grid_thw"] if flat else torch.zeros(0, 3, dtype=torch.long)
    counts, at, rendered = image_token_counts(grid, processor.merge_size), 0, []
    for text, row in zip(texts, images):
        blocks = "".join(VISION_START + IMAGE_PAD * counts[at + i] + VISION_END for i in range(len(row)))
        rendered.append(blocks + text)
        at += len(row)
    tokens = tokenizer(rendered, return_tensors="pt", padding=True)
    pixels = encoded["pixel_values"] if flat else torch.zeros(0, 0)
    return VLBatch(tokens["input_ids"], tokens["attention_mask"], pixels, grid, tuple(len(row) for row in images))


def row_images(batch: VLBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(`pixel_values` f32[B, K, D], `image_grid_thw` i64[B, I, 3]): the batch's flat images as the
    per-row fields of `Prompts` / `Rollouts`, each row's patches zero-padded to the widest row's K
    and its grids to the most images I (a row without images: zeros)."""
    rows, patches = len(batch.images_per_row), batch.image_grid_thw.prod(-1).tolist()
    depth = batch.pixel_values.shape[-1] if batch.pixel_values.dim() == 2 else 0
    widths, at = [], 0
    for count in batch.images_per_row:
        widths.append(sum(patches[at:at + count]))
        at += count
    pixels = batch.pixel_values.new_zeros(rows, max(widths, default=0), depth)  # [B, K, D]
    grid = torch.zeros(rows, max(batch.images_per_row, default=0), 3, dtype=torch.long)  # [B, I, 3]
    patch_at, image_at = 0, 0
    for row, count in enumerate(batch.images_per_row):
        pixels[row, :widths[row]] = batch.pixel_values[patch_at:patch_at + widths[row]]
        grid[row, :count] = batch.image_grid_thw[image_at:image_at + count]
        patch_at, image_at = patch_at + widths[row], image_at + count
    return pixels, grid


def vl_prompts(tokenizer: PreTrainedTokenizerFast, processor: Any, texts: Sequence[str],
               images: Sequence[Sequence[Any]], meta: Mapping[str, Sequence[Any]] | None = None) -> Prompts:
    """Left-padded `Prompts` whose rows carry their images (`encode_vl_batch`, then `row_images`):
    what `rg.generate`, `rg.logprobs` and `rg.update` take for a vision-language model."""
    batch = encode_vl_batch(tokenizer, processor, texts, images)
    if not bool(batch.mask[:, -1].all()):
        raise ValueError("vl_prompts: the tokenizer pads on the right; prompts are left-padded "
                         "(tokenizer.padding_side = 'left')")
    pixels, grid = row_images(batch)
    return Prompts(batch.ids, batch.mask.bool(), dict(meta or {}), pixel_values=pixels, image_grid_thw=grid)


# The most pixels an environment's image observation keeps (Qwen2.5-VL's recommended max_pixels; larger
# ones are resized down by the processor, as the observation's own choice of resolution is not checked data).
OBSERVATION_MAX_PIXELS = 1280 * 28 * 28


def image_encoder(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast,
                  max_pixels: int = OBSERVATION_MAX_PIXELS) -> Any:
    """`show(image) -> (its tokens: start + one pad a merged patch + end, pixels [k, D], grid [1, 3])`:
    how an environment's image observation enters a rollout (the same expansion as `encode_vl_batch`)."""
    processor = build_image_processor(model.config, max_pixels=max_pixels)
    start, pad, end = tokenizer.convert_tokens_to_ids([VISION_START, IMAGE_PAD, VISION_END])

    def show(image: Any) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        encoded = processor([image], return_tensors="pt")
        grid = encoded["image_grid_thw"]  # [1, 3]
        return [start, *[pad] * image_token_counts(grid, processor.merge_size)[0], end], encoded["pixel_values"], grid

    return show


def check_image_tokens(batch: VLBatch, image_token_id: int, merge: int) -> None:
    """Refuse a row whose image-token count is not what its images' grids give (verl #3469: the model's
    own check counts the whole batch and names no row, or passes when two rows' errors cancel)."""
    counts = image_token_counts(batch.image_grid_thw, merge)
    if sum(batch.images_per_row) != len(counts):
        raise ImageTokenError(f"the batch lists {sum(batch.images_per_row)} images over its rows "
                              f"(images_per_row={list(batch.images_per_row)}) but image_grid_thw has {len(counts)}")
    at = 0
    for row, n_images in enumerate(batch.images_per_row):
        want = sum(counts[at:at + n_images])
        have = int((batch.ids[row] == image_token_id).sum())
        if have != want:
            raise ImageTokenError(
                f"row {row}: {have} image tokens (id {image_token_id}) but its {n_images} image(s) give {want} "
                f"(grids {batch.image_grid_thw[at:at + n_images].tolist()}, {merge}x{merge} patches a token)",
            )
        at += n_images


def vl_token_logprobs(model: PreTrainedModel, batch: VLBatch) -> torch.Tensor:
    """log p(ids[:, t+1] | ids[:, :t+1], images): f32[B, L-1], 0 where ids[t] or
    ids[t+1] is padding. mrope positions (3 x
    [B, L]) come from the model's `get_rope_index` over the image grids, after `check_image_tokens`."""
    config = model.config
    check_image_tokens(batch, config.image_token_id, config.vision_config.spatial_merge_size)
    token_type = (batch.ids == config.image_token_id).int()  # 1 marks an image token, for mrope
    has_images = batch.image_grid_thw.shape[0] > 0
    extra = {"pixel_values": batch.pixel_values, "image_grid_thw": batch.image_grid_thw} if has_images else {}
    if has_images:
        positions, _ = model.model.get_rope_index(batch.ids, mm_token_type_ids=token_type,
                                                  image_grid_thw=batch.image_grid_thw, attention_mask=batch.mask)
    else:  # text only: all three rotary axes are the plain position
        positions = (batch.mask.long().cumsum(-1) - 1).clamp(min=0).expand(3, -1, -1)
    logits = model(input_ids=batch.ids, attention_mask=batch.mask, position_ids=positions,
                   mm_token_type_ids=token_type, **extra).logits[:, :-1].float()  # [B, L-1, V]
    lp = torch.log_softmax(logits, -1).gather(-1, batch.ids[:, 1:, None]).squeeze(-1)  # [B, L-1]
    return lp * (batch.mask[:, :-1] * batch.mask[:, 1:])  # a real token predicted from a real one


def write_vl_assets(directory: str | Path = ASSETS) -> Path:
    """(Re)write `tiny_qwen2_vl.json` in `directory` (default: the shipped assets)."""
    path = Path(directory) / TINY_VL_CONFIG.name
    path.write_text(json.dumps(tiny_vl_config(), indent=2) + "\n")
    return path


if __name__ == "__main__":
    print(f"wrote {write_vl_assets()}")

"""The forwards of a vision-language model behind the primitives: prefill for `generate`, the
response states for `logprobs` and `update` (padded or packed).

A `Prompts` / `Rollouts` carries each row's images (`pixel_values` [R, K, D], `image_grid_thw`
[R, I, 3], see `rlgraph.batches`). Here they become the model's inputs:

- the image features are scattered into the token embeddings at the *prompt's* image tokens only.
  A response may sample the image-pad token (it is in the vocabulary); the engine fed it back as a
  plain token, so the training forward must too, or it would count it as an image and crash
  (verl #3469's "features and tokens do not match", after hundreds of steps);
- the 3-D rotary positions (mrope) come from the model's `get_rope_index` over the whole row,
  prompt and response, with the same image-token marking; a decode step's position is the last
  prompt position plus the step on all three axes, which is what `get_rope_index` gives a text
  token after the prompt, so generation and training see the same positions;
- every row's image-token count is checked against its grids before any forward, naming the row.
"""

from __future__ import annotations

from typing import Any

import torch

from rlgraph.backends.local.packing import packed_attention_mask, packed_state_index, predicting_columns
from rlgraph.backends.local.vlm import VL_MODEL_TYPES, ImageTokenError
from rlgraph.batches import Rollouts


def is_vision_lm(model: Any) -> bool:
    """Whether `model` (or the model a peft wrapper holds) is a Qwen2-VL / Qwen2.5-VL."""
    return getattr(getattr(model, "config", None), "model_type", None) in VL_MODEL_TYPES


def _body(model: Any) -> torch.nn.Module:
    """The multimodal body (`Qwen2VLModel`: vision tower + language model) under the LM head."""
    causal = model.get_base_model() if hasattr(model, "get_base_model") else model
    return causal.model


def check_row_images(ids: torch.Tensor, mask: torch.Tensor, grid: torch.Tensor | None, model: Any,
                     where: str, index: torch.Tensor | None = None) -> torch.Tensor:
    """The image positions bool[R, L] of token rows `ids` [R, L] (image tokens where `mask` says images
    may sit: the prompt, an environment's observations), after checking that each row holds exactly
    the image tokens its grids give (`grid` i64[R, I, 3] or None: no images).

    A row that disagrees is refused by row (and batch `index` where given) before the forward:
    the model's own check counts the whole batch and names none, or passes when two rows' errors cancel."""
    if not is_vision_lm(model):
        raise ImageTokenError(f"{where}: the batch carries images but the model is {type(model).__name__}, a text "
                              "model\n  fix: load a Qwen2-VL / Qwen2.5-VL, or drop the images")
    config = model.config
    merge = config.vision_config.spatial_merge_size
    image = (ids == config.image_token_id) & mask.bool()  # [R, P]
    have = image.sum(1)  # [R]
    want = torch.zeros_like(have) if grid is None else (grid.prod(-1) // (merge * merge)).sum(-1)  # [R]
    bad = (have != want).nonzero().flatten()
    if len(bad):
        row = int(bad[0])
        name = f"row {row}" + (f" (batch index {int(index[row])})" if index is not None else "")
        grids = [] if grid is None else [g for g in grid[row].tolist() if any(g)]
        raise ImageTokenError(
            f"{where}: {name} has {int(have[row])} image tokens (id {config.image_token_id}) but its {len(grids)} "
            f"image(s) give {int(want[row])} (grids {grids}, {merge}x{merge} patches a token)\n  fix: build prompts "
            "with rlgraph.backends.local.vlm.vl_prompts, which expands each image once")
    return image


def flat_images(pixels: torch.Tensor | None, grid: torch.Tensor | None
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(patches [sum, D], grids [images, 3]) of the rows' padded images, rows in order: the layout the
    vision tower and `get_rope_index` read; (None, None) for no images."""
    if grid is None:
        return None, None
    used = grid.prod(-1).sum(-1)  # [R]: each row's real patches
    keep = torch.arange(pixels.shape[1], device=pixels.device)[None] < used[:, None].to(pixels.device)  # [R, K]
    return pixels[keep], _flat_grid(grid)


def _flat_grid(grid: torch.Tensor) -> torch.Tensor:
    """The grids [images, 3] of rows' images (`grid` [R, I, 3], zero rows padding), rows in order."""
    flat = grid.reshape(-1, 3)  # [R*I, 3]
    return flat[flat.prod(-1) > 0]


def _text_positions(real: torch.Tensor) -> torch.Tensor:
    """Positions [3, R, L] of text-only rows: all three rotary axes the plain position, padding 0."""
    return (real.long().cumsum(-1) - 1).clamp(min=0)[None].expand(3, -1, -1)


def _tower(model: Any, flat_pixels: torch.Tensor, flat_grid: torch.Tensor) -> torch.Tensor:
    """The vision tower's features [image tokens, H] of images laid out as `flat_images` gives them."""
    return torch.cat(_body(model).get_image_features(flat_pixels, flat_grid).pooler_output)


def image_inputs(model: Any, ids: torch.Tensor, real: torch.Tensor, image: torch.Tensor,
                 flat_pixels: torch.Tensor | None, flat_grid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(input embeddings [R, L, H], mrope positions [3, R, L]) of token rows `ids` [R, L] whose real
    tokens are `real` and whose image tokens are `image` (both bool [R, L]), their images `flat_pixels`
    / `flat_grid` in row order (`flat_images`): the features sit at exactly the `image` positions;
    padding gets position 0, as in the text path."""
    body = _body(model)
    embeds = body.get_input_embeddings()(ids)  # [R, L, H]
    if flat_grid is None or not bool(image.any()):  # text only: all three rotary axes are the plain position
        return embeds, _text_positions(real)
    features = _tower(model, flat_pixels, flat_grid)  # [image tokens, H]
    embeds = embeds.masked_scatter(image[..., None], features.to(embeds.dtype))  # [R, L, H]
    return embeds, _rope_index(body, ids, real, image, flat_grid)


def _rope_index(body: torch.nn.Module, ids: torch.Tensor, real: torch.Tensor, image: torch.Tensor,
                flat_grid: torch.Tensor) -> torch.Tensor:
    """The model's own mrope positions [3, R, L] of rows `ids` (a Python loop over the rows inside)."""
    positions, _ = body.get_rope_index(ids, mm_token_type_ids=image.int(), image_grid_thw=flat_grid,
                                       attention_mask=real.long())  # [3, R, L]
    return positions


def _runs(*fields: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(heads i64[U], run i64[R]): consecutive rows equal in every field [R, ...] form a run (a prompt's
    n samples: `generate` repeats its rows); `heads` are each run's first row, `run[r]` row r's run."""
    rows = fields[0].shape[0]
    new = torch.ones(rows, dtype=torch.bool, device=fields[0].device)  # [R]: a row that starts a run
    if rows > 1:
        same = torch.ones(rows - 1, dtype=torch.bool, device=new.device)
        for field in fields:
            same &= (field[1:] == field[:-1]).flatten(1).all(1)
        new[1:] = ~same
    return new.nonzero().flatten(), new.long().cumsum(0) - 1


def shared_image_features(model: Any, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Features [image tokens, H] of the rows' images (`pixels` [R, K, D], `grid` [R, I, 3]) in row order,
    the tower run once for each run of consecutive rows holding the same images: a batch of N = B*n
    samples costs B prompts' tower work, as in generation. When the tower trains, a shared feature's
    gradient is the sum over its rows (the gather's backward), what N separate tower runs would give."""
    heads, run = _runs(pixels, grid)
    features = _tower(model, *flat_images(pixels[heads], grid[heads]))  # [image tokens of the heads, H]
    if len(heads) == len(run):
        return features
    merge = model.config.vision_config.spatial_merge_size
    tokens = (grid.prod(-1) // (merge * merge)).sum(-1)  # [R]: each row's image tokens
    head_tokens = tokens[heads]  # [U]
    row_start = (head_tokens.cumsum(0) - head_tokens)[run]  # [R]: where row r's head's features start
    within = torch.arange(int(tokens.sum()), device=tokens.device) - (tokens.cumsum(0) - tokens).repeat_interleave(tokens)
    return features[row_start.repeat_interleave(tokens) + within]  # [image tokens of all rows, H]


def continued_positions(model: Any, ids: torch.Tensor, real: torch.Tensor, image: torch.Tensor, grid: torch.Tensor,
                        width: int) -> torch.Tensor:
    """mrope positions [3, R, L] of rows [prompt (`width` columns) | response] with their grids
    `grid` [R, I, 3]: the model's `get_rope_index` over each run of identical prompts once, and a
    response of text continuing the prompt's next position one a token on all three axes, which is
    what `get_rope_index` gives text after the prompt (and the engine's decode positions). A batch
    with an image in a response (an environment's observation) goes through `get_rope_index` whole:
    its grids are not all the prompts'."""
    body = _body(model)
    if bool(image[:, width:].any()):
        return _rope_index(body, ids, real, image, _flat_grid(grid))
    prompt_real = real[:, :width]  # [R, P]
    heads, run = _runs(ids[:, :width], prompt_real, grid)
    prompt = _rope_index(body, ids[heads, :width], prompt_real[heads], image[heads, :width],
                         _flat_grid(grid[heads]))[:, run]  # [3, R, P]
    following = torch.where(prompt_real[None], prompt, -1).amax(dim=(0, 2)) + 1  # [R]: the next text position
    response_real = real[:, width:]  # [R, T]
    response = (following[:, None] + response_real.long().cumsum(-1) - 1) * response_real  # [R, T], padding 0
    return torch.cat([prompt, response[None].expand(3, -1, -1)], dim=2)  # [3, R, P+T]


def prompt_inputs(model: Any, ids: torch.Tensor, mask: torch.Tensor, pixels: torch.Tensor | None,
                  grid: torch.Tensor | None, index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(embeddings [B, P, H], mrope positions [3, B, P]) to prefill prompts with their images."""
    image = check_row_images(ids, mask, grid, model, "generate", index)
    return image_inputs(model, ids, mask.bool(), image, *flat_images(pixels, grid))


def vision_response_states(model: Any, rollouts: Rollouts, *, packed: bool = False) -> torch.Tensor:
    """Final-norm hidden states [N, T, H] of the rollouts' responses given their prompts' images;
    row r, column t predicts response token t (`logprobs.response_hidden_states`'s contract).
    `packed`: one forward over the rows' real tokens laid end to end, positions and images kept."""
    width, steps = rollouts.prompt_ids.shape[1], rollouts.response_ids.shape[1]
    ids = torch.cat([rollouts.prompt_ids, rollouts.response_ids], dim=1)  # [N, P+T]
    real = torch.cat([rollouts.prompt_mask, rollouts.attention_mask], dim=1).bool()  # [N, P+T]
    # images sit in the prompt and in environment observations (context, not the policy's tokens)
    shown = torch.cat([rollouts.prompt_mask, rollouts.attention_mask & ~rollouts.mask], dim=1).bool()  # [N, P+T]
    image = check_row_images(ids, shown, rollouts.image_grid_thw, model,
                             "a forward over rollouts (rg.logprobs / rg.update)")  # [N, P+T]
    body = _body(model)
    embeds = body.get_input_embeddings()(ids)  # [N, P+T, H]
    if rollouts.image_grid_thw is None or not bool(image.any()):  # text only
        positions = _text_positions(real)  # [3, N, P+T]
    else:  # a prompt's tower and rope index once for its n samples
        features = shared_image_features(model, rollouts.pixel_values, rollouts.image_grid_thw)  # [image tokens, H]
        embeds = embeds.masked_scatter(image[..., None], features.to(embeds.dtype))
        positions = continued_positions(model, ids, real, image, rollouts.image_grid_thw, width)  # [3, N, P+T]
    before = predicting_columns(real, width, steps)  # [N, T]
    if packed:
        mask = packed_attention_mask(real.sum(1), model.config._attn_implementation, embeds.dtype)  # [1, 1, L, L]
        hidden = body(inputs_embeds=embeds[real][None], attention_mask=mask, position_ids=positions[:, real][:, None],
                      use_cache=False).last_hidden_state[0]  # [L, H]
        return hidden[packed_state_index(real, before)]  # [N, T, H]
    hidden = body(inputs_embeds=embeds, attention_mask=real.long(), position_ids=positions,
                  use_cache=False).last_hidden_state  # [N, P+T, H]
    return hidden.gather(1, before[:, :, None].expand(-1, -1, hidden.shape[-1]))  # [N, T, H]

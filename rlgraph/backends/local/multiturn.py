"""Multi-turn generation in the native engine: every row continues from its own KV cache.

A rollout alternates policy turns and environment steps. After a turn, a row's next input is
only what is new: the last token it sampled (not yet fed) and the observation's ids. They are
appended to the row's cache (`TurnDecoder.feed`, one forward over the new block), so earlier
turns are never prefilled again; rows whose episode ended leave the batch (`TurnDecoder.keep`).

    feed(prompt ++ first observation)          # prefill, left-padded
    turn: sample, feed(token), sample, ...     # until EOS, a stop string or the turn's cap
    env.step(turn's ids) -> observation ids    # rlgraph.agents.episode, concurrently across rows
    feed(last token ++ observation)            # the new tokens only, then the next turn

Positions are each row's count of real tokens so far and the attention mask keeps every padding
column out, so a row continued from its cache computes what one forward over its whole context
computes (up to float rounding), which tests/backends/test_multiturn.py checks.

Sampling is counter-based as in `generation.py`: token s of turn t of sample j of a prompt draws
the noise of (seed, call, prompt index, j, t * max_tokens_per_turn + s), whatever else is in the
batch and whichever rank generates it. One Hugging Face forward per step (any causal LM), not the
lean static-cache step: a cache that grows by blocks of different lengths per row is what the
Hugging Face `DynamicCache` API does (and `batch_select_indices` drops finished rows).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
from transformers import DynamicCache

from rlgraph.agents import episode as E
from rlgraph.backends.local.counter_sampling import SamplingParams, StepNoise, sample_tokens, sampling_keys
from rlgraph.backends.local.generation import _check_prompts
from rlgraph.backends.local.vlm_forward import flat_images, image_inputs, is_vision_lm
from rlgraph.batches import Prompts, Rollouts


class TurnDecoder:
    """A batch of rows decoded block after block over one Hugging Face `DynamicCache`.

    `feed(ids, mask)` appends a left-padded block [R, L] (mask False on padding) and returns the
    logits [R, V] that predict each row's next token; a row whose block is all padding keeps the
    logits of its last real token. `fed_tokens` counts the real tokens that went through the model.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.attention: torch.Tensor | None = None  # [R, L] long: 1 on the cache's real columns
        self.positions: torch.Tensor | None = None  # [R]: each row's next position (its real tokens so far;
        # a VLM's next mrope position: an image advances it by its grid's side, not its token count)
        self.logits: torch.Tensor | None = None  # [R, V]: what predicts each row's next token
        self.fed_tokens = 0
        self.vision = is_vision_lm(model)

    def feed(self, ids: torch.Tensor, mask: torch.Tensor, images: tuple | None = None) -> torch.Tensor:
        """`images` (a VLM's): (image positions bool [R, L], pixels, grids of them in row order)."""
        rows = ids.shape[0]
        if self.attention is None:
            self.attention = torch.zeros(rows, 0, dtype=torch.long, device=ids.device)  # [R, 0]
            self.positions = torch.zeros(rows, dtype=torch.long, device=ids.device)  # [R]
        mask = mask.bool()
        attention = torch.cat([self.attention, mask.long()], dim=1)  # [R, L_cache + L]
        if self.vision:  # the block's own mrope positions, from the row's next position on
            image, pixels, grid = images if images is not None else (torch.zeros_like(mask), None, None)
            embeds, block = image_inputs(self.model, ids, mask, image, pixels, grid)  # [R, L, H], [3, R, L]
            positions = block + self.positions[None, :, None]  # [3, R, L]
            advance = torch.where(mask[None], block, -1).amax(dim=(0, 2)) + 1  # [R]: 0 for an empty block
            inputs = {"inputs_embeds": embeds}
        else:
            positions = (self.positions[:, None] + mask.long().cumsum(-1) - 1).clamp(min=0)  # [R, L]
            advance, inputs = mask.sum(dim=1), {"input_ids": ids}
        out = self.model(**inputs, attention_mask=attention, position_ids=positions, past_key_values=self.cache,
                         use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1].float()  # [R, V]
        has_new = mask.any(dim=1)  # [R]
        self.logits = logits if self.logits is None else torch.where(has_new[:, None], logits, self.logits)  # [R, V]
        self.attention, self.positions = attention, self.positions + advance
        self.fed_tokens += int(mask.sum())
        return self.logits

    def keep(self, rows: torch.Tensor) -> None:
        """Only `rows` (indices into the current batch, in order) go on decoding."""
        self.cache.batch_select_indices(rows)
        self.attention, self.positions, self.logits = self.attention[rows], self.positions[rows], self.logits[rows]


def left_pad(rows: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (ids i64[R, L], mask bool[R, L]), each row right-aligned (padding first)."""
    width = max(1, max((len(row) for row in rows), default=1))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [R, L]
    mask = torch.zeros(len(rows), width, dtype=torch.bool)  # [R, L]
    for index, row in enumerate(rows):
        if row:
            ids[index, width - len(row):] = torch.tensor(list(row), dtype=torch.long)
            mask[index, width - len(row):] = True
    return ids.to(device), mask.to(device)


@attrs.frozen
class TurnLimits:
    """How long episodes run: `max_turns` policy turns of at most `per_turn` tokens, all turns and
    observations within `total` response tokens (T); an env step may take `step_timeout` seconds."""

    max_turns: int
    per_turn: int
    total: int
    step_timeout: float | None


@attrs.frozen
class Turn:
    """What one policy turn sampled, per row: its ids and log-probs, and the ids sampled but not
    yet fed to the cache (the last step's, when the turn ended the decode loop)."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    pending: list[list[int]]


def decode_turn(decoder: TurnDecoder, keys: torch.Tensor, caps: Sequence[int], turn: int, limits: TurnLimits,
                params: SamplingParams, eos: int, ends_turn: Callable[[int, list[int]], bool]) -> Turn:
    """Sample one turn for every row of `decoder` (row r at most `caps[r]` tokens): until EOS, the
    cap, or `ends_turn(r, ids so far)` (a stop string). Every sampled token but the last step's is fed."""
    rows, device = len(caps), decoder.logits.device
    cap = torch.tensor(list(caps), device=device)  # [R]
    noise = None if params.greedy else StepNoise(keys, decoder.logits.shape[-1], (turn + 1) * limits.per_turn)
    tokens: list[list[int]] = [[] for _ in range(rows)]
    logprobs: list[list[float]] = [[] for _ in range(rows)]
    running = torch.ones(rows, dtype=torch.bool, device=device)  # [R]
    for step in range(max(caps)):
        counter = turn * limits.per_turn + step  # the row's own counter: same whatever else runs
        token, logprob = sample_tokens(decoder.logits, params, None,
                                       noise=None if noise is None else noise.at(counter))  # [R], [R]
        stopped = (token == eos) | (step + 1 >= cap)  # [R]
        for row in running.nonzero().flatten().tolist():
            tokens[row].append(int(token[row]))
            logprobs[row].append(float(logprob[row]))
            if not bool(stopped[row]) and ends_turn(row, tokens[row]):
                stopped[row] = True
        going = running & ~stopped  # [R]
        if not bool(going.any()):
            pending = [[int(token[row])] if bool(running[row]) else [] for row in range(rows)]
            return Turn(tokens, logprobs, pending)
        decoder.feed(token[:, None], running[:, None])  # a token that just ended its row's turn is context too
        running = going
    raise AssertionError("a turn ends by its cap at the latest")


def stop_checker(envs: Sequence[Any], decode: Callable[[list[int]], str]) -> Callable[[int, list[int]], bool]:
    """`ends_turn(row, ids)`: whether the row's turn text now holds one of its env's `stop` strings
    (a ToolEnv's closing call tag). Only the last len(stop) tokens are decoded: a token is at least
    one character, so a stop string completed by the last token lies within them."""
    stops = [tuple(getattr(getattr(env, "env", env), "stop", ())) for env in envs]
    longest = max((len(item) for items in stops for item in items), default=0)

    def ends_turn(row: int, ids: list[int]) -> bool:
        if not stops[row]:
            return False
        text = decode(ids[-longest:])
        return any(item in text for item in stops[row])

    return ends_turn


def multi_turn_rollouts(model: torch.nn.Module, prompts: Prompts, envs: Sequence[Any], *, n: int, params: SamplingParams,
                        limits: TurnLimits, seed: int, call: int, eos: int, pad: int,
                        decode: Callable[[list[int]], str], show: Callable[[Any], tuple] | None = None
                        ) -> tuple[Rollouts, torch.Tensor, torch.Tensor]:
    """(Rollouts[N, total], episode statistics f32[N, E], turn rewards f32[N, total]) of `envs`
    (N = B*n token environments, row i*n + j for sample j of prompt i), in eval mode without gradients.
    `show` (a VLM's): image -> (its tokens, pixels, grid), for environments that answer with an image."""
    vocab = model.get_input_embeddings().num_embeddings
    _check_prompts(prompts, vocab)
    device = model.device
    keys = sampling_keys(seed, call, prompts.index.to(device), n)  # [N]
    repeated = prompts.select(torch.arange(len(prompts)).repeat_interleave(n))  # the N rows, each its prompt's
    episodes = E.start(envs, episode_rows(prompts, n), limits.total, vocab, limits.step_timeout)
    for episode, (pixels, grid) in zip(episodes, _row_images(repeated)):
        episode.show, episode.images = show, _split(pixels, grid)  # the prompt's images come first
    try:
        _run_turns(TurnDecoder(model), episodes, repeated.ids, repeated.mask.bool(), keys, limits, params, eos, pad,
                   stop_checker(envs, decode), vocab)
    finally:
        E.close_all(episodes)
    return episode_outputs(episodes, prompts, n, limits.total, pad)


def episode_outputs(episodes: Sequence[E.Episode], prompts: Prompts, n: int, total: int,
                    pad: int) -> tuple[Rollouts, torch.Tensor, torch.Tensor]:
    """(Rollouts[N, total], episode statistics f32[N, E], turn rewards f32[N, total]) of finished episodes."""
    tensors = E.to_tensors(episodes, total, pad)
    meta = {key: [value for value in values for _ in range(n)] for key, values in prompts.meta.items()}
    group = torch.arange(len(prompts)).repeat_interleave(n)  # [N]
    repeated = prompts.select(group)  # the N rows, each its prompt's
    rollouts = Rollouts(repeated.ids, repeated.mask.bool(), tensors["response_ids"], tensors["mask"], tensors["logprobs"],
                        group, meta, tensors["context_mask"], *_episode_images(episodes))
    return rollouts, tensors["stats"], tensors["turn_rewards"]


def _row_images(prompts: Prompts) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
    """Each row's own (pixels [k, D], grids [i, 3]) of its prompt's images, or (None, None)."""
    if prompts.image_grid_thw is None:
        return [(None, None)] * len(prompts)
    return [flat_images(prompts.pixel_values[row:row + 1], prompts.image_grid_thw[row:row + 1])
            for row in range(len(prompts))]


def _split(pixels: torch.Tensor | None, grid: torch.Tensor | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A row's flat images as one (pixels [k, D], grid [1, 3]) a image."""
    if grid is None or not len(grid):
        return []
    return list(zip(torch.split(pixels, grid.prod(-1).tolist()), grid.split(1)))


def _episode_images(episodes: Sequence[E.Episode]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The rows' images (prompt's, then each image observation's) as `Rollouts.pixel_values` [N, K, D] and
    `image_grid_thw` [N, I, 3], zero-padded; (None, None) when no row has one."""
    if not any(episode.images for episode in episodes):
        return None, None
    depth = next(pixels.shape[1] for episode in episodes for pixels, _ in episode.images)
    width = max(sum(len(pixels) for pixels, _ in episode.images) for episode in episodes)
    count = max(len(episode.images) for episode in episodes)
    pixels = torch.zeros(len(episodes), width, depth)  # [N, K, D]
    grids = torch.zeros(len(episodes), count, 3, dtype=torch.long)  # [N, I, 3]
    for row, episode in enumerate(episodes):
        if episode.images:
            pixels[row, :sum(len(p) for p, _ in episode.images)] = torch.cat([p for p, _ in episode.images])
            grids[row, :len(episode.images)] = torch.cat([g for _, g in episode.images])
    return pixels, grids


def _block_images(decoder: TurnDecoder, rows: Sequence[list[int]], shown: Sequence[list[bool]],
                  images: Sequence[list[tuple]], device: torch.device) -> tuple | None:
    """A VLM block's (image positions [R, L], pixels, grids): image tokens where `shown` marks the
    environment's (and the prompt's) tokens, with `images` each row's new images in order."""
    if not decoder.vision:
        return None
    image_id = decoder.model.config.image_token_id
    flags = [[int(token == image_id and ok) for token, ok in zip(row, marks)] for row, marks in zip(rows, shown)]
    image = left_pad(flags, 0, device)[0].bool()  # [R, L], aligned as the ids
    new = [item for row in images for item in row]
    if not new:
        return image, None, None
    return image, torch.cat([p for p, _ in new]).to(device), torch.cat([g for _, g in new]).to(device)

def mark_budget_cut(episodes: Sequence[E.Episode]) -> None:
    """Episodes still going when `max_turns` is reached were cut by the budget."""
    for episode in episodes:
        episode.budget_cut = True
        episode.stats["budget_cut"] = 1.0


def _run_turns(decoder: TurnDecoder, episodes: list[E.Episode], prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
               keys: torch.Tensor, limits: TurnLimits, params: SamplingParams, eos: int, pad: int,
               ends_turn: Callable[[int, list[int]], bool], vocab: int) -> None:
    device = keys.device
    active = list(range(len(episodes)))  # episode of each decoder row
    # the first block: each prompt's real ids and its first observation (already in the response)
    new = [prompt_ids[r][prompt_mask[r]].tolist() + episodes[r].ids for r in active]
    shown = [[True] * len(row) for row in new]  # every token of the first block may be an image's
    images = [list(episodes[r].images) for r in active]
    for turn in range(limits.max_turns):
        decoder.feed(*left_pad(new, pad, device), _block_images(decoder, new, shown, images, device))
        caps = [min(limits.per_turn, episodes[r].remaining) for r in active]
        sampled = decode_turn(decoder, keys[active], caps, turn, limits, params, eos,
                              lambda row, ids: ends_turn(active[row], ids))
        for row, r in enumerate(active):
            episodes[r].add_policy(sampled.tokens[row], sampled.logprobs[row])
        # every row's turn goes to its env, a turn cut by the budget too (the env judges what was
        # written); an observation that no longer fits ends the episode (`Episode.add_observation`)
        seen = [len(episodes[r].images) for r in active]
        observations = E.step_all([episodes[r] for r in active], sampled.tokens, turn=turn,
                                  timeout_s=limits.step_timeout, vocab=vocab)
        keep = [row for row, r in enumerate(active) if not episodes[r].done]
        if not keep:
            return
        new = [sampled.pending[row] + observations[row] for row in keep]
        shown = [[False] * len(sampled.pending[row]) + [True] * len(observations[row]) for row in keep]  # a sampled
        # image-pad token is text, as the training forward reads it; the observation's may be an image's
        images = [episodes[active[row]].images[seen[row]:] for row in keep]
        active = [active[row] for row in keep]
        decoder.keep(torch.tensor(keep, device=device))
    mark_budget_cut([episodes[r] for r in active])  # max_turns reached with these still going


def episode_rows(prompts: Prompts, n: int) -> list[Mapping[str, Any]]:
    """The data row of each of the N = B*n episodes: its prompt's meta fields."""
    return [{key: values[i] for key, values in prompts.meta.items()} for i in range(len(prompts)) for _ in range(n)]

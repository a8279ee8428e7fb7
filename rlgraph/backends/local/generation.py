"""The native generation engine: batched sampling with the model's KV cache, in plain PyTorch.

It runs wherever the model runs (the CPU demo, tests, GPUs without vLLM). One prefill over the
left-padded prompts, then one decode step per token for all rows at once; the only per-step
Python work is a single "all rows finished?" check.
"""

from __future__ import annotations

import attrs
import torch
from transformers import DynamicCache, PreTrainedModel

from rlgraph.batches import Prompts, Rollouts


def _non_negative(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not value >= 0.0:
        raise ValueError(f"SamplingParams.{attribute.name} must be >= 0 (0 means greedy), got {value}")


def _probability(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise ValueError(f"SamplingParams.{attribute.name} must be in (0, 1], got {value}; "
                         "use 1.0 to disable nucleus sampling")


def _positive(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if not value >= 1:
        raise ValueError(f"SamplingParams.{attribute.name} must be >= 1, got {value}")


@attrs.frozen
class SamplingParams:
    """How to sample: `temperature` 0 is greedy; `top_p` < 1 keeps the smallest nucleus of
    tokens whose probability adds up to at least `top_p`; at most `max_new_tokens` per response."""

    temperature: float = attrs.field(default=1.0, converter=float, validator=_non_negative)
    top_p: float = attrs.field(default=1.0, converter=float, validator=_probability)
    max_new_tokens: int = attrs.field(default=16, validator=[attrs.validators.instance_of(int), _positive])

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def nucleus_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """`logits` [N, V] with every token outside the top-`top_p` nucleus set to -inf.

    A token is kept when the probability of the tokens ranked above it is below `top_p`, so the
    most likely token is always kept.
    """
    if top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V]
    probs = sorted_logits.softmax(dim=-1)  # [N, V]
    mass_above = probs.cumsum(dim=-1) - probs  # [N, V]
    drop_sorted = mass_above >= top_p  # [N, V]
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)  # [N, V]
    return logits.masked_fill(drop, float("-inf"))


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens i64[N], logprobs f32[N]) drawn from `logits` [N, V].

    The log-prob is taken from the temperature-scaled distribution over the full vocabulary
    (before nucleus filtering; temperature 1 when greedy), which is what a training-side
    recompute with the same temperature gives.
    """
    logits = logits.float()  # [N, V]
    if params.greedy:
        tokens = logits.argmax(dim=-1)  # [N]
        scaled = logits  # [N, V]
    else:
        scaled = logits / params.temperature  # [N, V]
        probs = nucleus_filter(scaled, params.top_p).softmax(dim=-1)  # [N, V]
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # [N]
    logprobs = scaled.log_softmax(dim=-1).gather(-1, tokens[:, None]).squeeze(-1)  # [N]
    return tokens, logprobs


def _check_prompts(prompts: Prompts) -> None:
    if len(prompts) == 0 or prompts.ids.shape[1] == 0:
        raise ValueError(f"generate: empty prompt batch {tuple(prompts.ids.shape)}; pass at least one non-empty prompt")
    if not bool(prompts.mask[:, -1].all()):
        raise ValueError(
            "generate: prompts must be left-padded (the last column of every prompt mask True); "
            "tokenize with `tokenizer.padding_side = 'left'`"
        )


class NativeGenerator:
    """Samples `n` responses per prompt from a Hugging Face causal LM with its KV cache."""

    def __init__(self, model: PreTrainedModel, *, eos_token_id: int, pad_token_id: int) -> None:
        self.model = model
        self.eos_token_id = int(eos_token_id)
        self.pad_token_id = int(pad_token_id)

    def generate(
        self, prompts: Prompts, n: int, params: SamplingParams, *, generator: torch.Generator | None = None
    ) -> Rollouts:
        """N = B*n rollouts; row `i*n + j` is sample j of prompt i and `group[i*n + j] = i`.

        Each response stops after its first EOS (kept, with mask True) or at `max_new_tokens`;
        later positions hold `pad_token_id` with mask False and log-prob 0. T is the longest
        response produced. Same model, prompts, params and generator state give the same rollouts.
        The model runs in eval mode without gradients; its previous mode is restored.
        """
        if n < 1:
            raise ValueError(f"generate: n (samples per prompt) must be >= 1, got {n}")
        _check_prompts(prompts)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                return self._generate(prompts, n, params, generator)
        finally:
            self.model.train(was_training)

    def _generate(
        self, prompts: Prompts, n: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Rollouts:
        device = self.model.device
        prompt_ids = prompts.ids.to(device).repeat_interleave(n, dim=0)  # [N, P]
        prompt_mask = prompts.mask.to(device).bool().repeat_interleave(n, dim=0)  # [N, P]
        rows, width = prompt_ids.shape
        steps = params.max_new_tokens
        attention = torch.ones(rows, width + steps, dtype=torch.long, device=device)  # [N, P+steps]
        attention[:, :width] = prompt_mask
        positions = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)  # [N, P]
        next_position = positions[:, -1:] + 1  # [N, 1]
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=prompt_ids, attention_mask=attention[:, :width], position_ids=positions,
                         past_key_values=cache, use_cache=True, logits_to_keep=1)
        tokens, logprobs, alive = [], [], []
        running = torch.ones(rows, dtype=torch.bool, device=device)  # [N]
        for step in range(steps):
            token, logprob = sample_tokens(out.logits[:, -1], params, generator)  # [N], [N]
            alive.append(running)
            tokens.append(token.masked_fill(~running, self.pad_token_id))
            logprobs.append(logprob.masked_fill(~running, 0.0))
            running = running & (token != self.eos_token_id)  # [N]
            if step + 1 == steps or not bool(running.any()):
                break
            out = self.model(input_ids=tokens[-1][:, None], attention_mask=attention[:, : width + step + 1],
                             position_ids=next_position + step, past_key_values=out.past_key_values,
                             use_cache=True, logits_to_keep=1)
        group = torch.arange(len(prompts), device=device).repeat_interleave(n)  # [N]
        meta = {key: [value for value in values for _ in range(n)] for key, values in prompts.meta.items()}
        return Rollouts(prompt_ids, prompt_mask, torch.stack(tokens, 1), torch.stack(alive, 1),
                        torch.stack(logprobs, 1), group, meta)

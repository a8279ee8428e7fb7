"""The native generation engine: batched sampling with the model's KV cache, in plain PyTorch.

It runs wherever the model runs (the CPU demo, tests, GPUs without vLLM). One prefill over the
left-padded prompts (each prompt once: its KV cache is repeated for its n samples), then one
decode step per token for all rows at once; the only per-step Python work is a single "all rows
finished?" check. With `compile_decode` the prefill and the decode run under torch.compile
(`decode_compile.py` says when a run asks for it): one compiled call decodes a chunk of k tokens
with their sampling (`lean_decode.decode_chunk`; the noise of those steps precomputed), and the
"all finished?" check runs once a chunk; nucleus sampling (top-p < 1) keeps a compiled call a step
and the torch sampler. A decode step is the lean step of
`lean_decode` (static KV cache, hand-written block over the model's own submodules) for the
Llama/Qwen2 family, else one Hugging Face forward with a `DynamicCache`; both sample the same.

Sampling is counter-based (`counter_sampling.py`): a prompt gets the same noise whichever rank
generates it and whatever else is in its batch.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import time
from collections.abc import Callable, Iterator, Sequence

import attrs
import torch
from transformers import DynamicCache, PreTrainedModel

from rlgraph.backends.local.decode_compile import CompileLedger, chunk_steps, model_signature, padded_width
from rlgraph.backends.local.lean_decode import LeanDecoder, lean_unsupported
from rlgraph.backends.local.vlm_forward import is_vision_lm, prompt_inputs
from rlgraph.kernels import sampling as fused
from rlgraph.kernels.sampling import splitmix64
from rlgraph.batches import Prompts, Rollouts
from rlgraph.errors import RLGraphError
from rlgraph.backends.local.counter_sampling import SamplingParams, StepNoise, sample_tokens, sampling_keys, steps_noise


def cut_at_stop(rollouts: Rollouts, stop: Sequence[str], decode: Callable[[list[int]], str], pad_id: int) -> Rollouts:
    """`rollouts` with each response ended after the token that completes its first stop string.

    Stop strings are text, and a string may span tokens, so the check runs on decoded text, after
    generation: the kept tokens are the shortest prefix whose text (`decode`, as the rewards
    decode) holds one of `stop`; the tokens after it get mask False, `pad_id` and log-prob 0, as
    after an EOS. The stop string itself is kept (it is what the policy produced). T is unchanged.
    """
    if not stop:
        return rollouts
    keep = rollouts.mask.clone()  # [N, T]
    lengths = rollouts.mask.sum(dim=1).tolist()  # [N]; a mask is a prefix of its row
    for row, length in enumerate(lengths):
        end = _stop_end(rollouts.response_ids[row, :length].tolist(), stop, decode)
        if end is not None:
            keep[row, end:] = False
    return attrs.evolve(rollouts, response_ids=rollouts.response_ids.masked_fill(~keep, pad_id), mask=keep,
                        logprobs=rollouts.logprobs.masked_fill(~keep, 0.0))


def _stop_end(tokens: list[int], stop: Sequence[str], decode: Callable[[list[int]], str]) -> int | None:
    """The fewest leading `tokens` whose text holds a stop string, or None. A longer prefix's text
    extends a shorter one's, so "holds a stop string" is monotone in the length: bisect it."""
    def holds(count: int) -> bool:
        text = decode(tokens[:count])
        return any(item in text for item in stop)

    if not holds(len(tokens)):
        return None
    low, high = 0, len(tokens)  # holds(high) is True; holds(low) is False (an empty text holds no non-empty string)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if holds(middle) else (middle, high)
    return high


# Where temperature sampling runs the fused Triton kernel (`rlgraph.kernels.sampling`). Tests add "cpu"
# (the Triton interpreter) to check the wiring.
FUSED_SAMPLING_DEVICES: tuple[str, ...] = ("cuda",)
# The most noise words [N, k, V] a compiled decode chunk takes precomputed (4 bytes each, 8 while
# hashing): past it (a large vocabulary and many rows) the decode runs a compiled call per step.
CHUNK_NOISE_WORDS = 2**24
FINISHED_CHECK_EVERY = 8  # decode steps between "all rows finished?" host syncs on a GPU


def finished_check_every(device: torch.device) -> int:
    """Decode steps between "all rows finished?" checks, each a host sync: every step on the CPU (free
    there, and stopping early saves work), every `FINISHED_CHECK_EVERY` on a GPU, where a sync stalls
    the launch queue (steps past the last EOS only append masked columns, which are trimmed)."""
    return 1 if device.type == "cpu" else FINISHED_CHECK_EVERY


def pad_prompt_columns(ids: torch.Tensor, mask: torch.Tensor, width: int, pad_id: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts `ids`, `mask` [B, P] padded further on the left to `width` columns
    (`pad_id`, mask False): the same prompts, since masked columns are attended by no query."""
    extra = width - ids.shape[1]
    if extra <= 0:
        return ids, mask
    return (torch.cat([ids.new_full((len(ids), extra), pad_id), ids], 1),  # [B, P']
            torch.cat([mask.new_zeros(len(mask), extra), mask], 1))  # [B, P']


class TokenizerError(RLGraphError, ValueError):
    """A tokenizer generation cannot use."""


def token_id(value: object, name: str, where: str) -> int:
    """`value` as a token id, or a TokenizerError naming `name` (eos_token_id, pad_token_id) and the
    fix: without EOS no response ever ends, and finished rows are padded with the pad id."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        fix = ("tokenizer.eos_token = '<|endoftext|>' (a token the model was trained to end with)" if name == "eos_token_id"
               else "tokenizer.pad_token = tokenizer.eos_token")
        raise TokenizerError(f"{where}: {name} is {value!r}; generation needs one\n  fix: {fix}")
    return value


class PromptError(RLGraphError, ValueError):
    """A prompt batch the model cannot read: empty, right-padded, or ids that are no tokens."""


def _check_prompts(prompts: Prompts, vocab_size: int) -> None:
    """Refuse prompts where they enter `generate`, naming the row; the embedding would raise a bare
    IndexError for an out-of-vocabulary id, and float ids are a tokenizer mix-up."""
    if len(prompts) == 0 or prompts.ids.shape[1] == 0:
        raise PromptError(f"generate: empty prompt batch {tuple(prompts.ids.shape)}; pass at least one non-empty prompt")
    if prompts.ids.dtype == torch.bool or prompts.ids.is_floating_point() or prompts.ids.is_complex():
        raise PromptError(f"generate: prompt ids are {prompts.ids.dtype}, not token ids\n"
                          "  fix: pass the tokenizer's integer ids (torch.long), e.g. tokenizer(texts, return_tensors='pt')")
    outside = (prompts.ids < 0) | (prompts.ids >= vocab_size)  # [B, P]
    if bool(outside.any()):
        row = int(outside.any(dim=1).nonzero()[0])
        bad = prompts.ids[row][outside[row]].tolist()
        raise PromptError(f"generate: prompt row {row} (batch index {int(prompts.index[row])}) holds token ids {bad[:5]} "
                          f"outside the model's vocabulary 0..{vocab_size - 1}\n"
                          "  fix: tokenize with the model's own tokenizer, whose vocabulary matches the embedding")
    if not bool(prompts.mask[:, -1].all()):
        raise PromptError(
            "generate: prompts must be left-padded (the last column of every prompt mask True); "
            "tokenize with `tokenizer.padding_side = 'left'`"
        )


_LEAN: contextvars.ContextVar[bool | None] = contextvars.ContextVar("rlgraph_lean_decode", default=None)


@contextlib.contextmanager
def lean_decoding(enabled: bool | None) -> Iterator[None]:
    """Within the block, generators built with `lean=None` use the lean decode step (True), one
    Hugging Face forward per token (False) or pick by model (None). For callers that build their
    generator inside an executor: a benchmark timing the decode paths against each other."""
    token = _LEAN.set(enabled)
    try:
        yield
    finally:
        _LEAN.reset(token)


class NativeGenerator:
    """Samples `n` responses per prompt from a Hugging Face causal LM with its KV cache.

    `lean` picks the decode loop: True the lean step of `lean_decode` (a static KV cache and a
    hand-written step over the model's own submodules: 0.77 instead of 1.18 ms a token for 8
    rows of the tiny Qwen2 on one CPU thread), False one Hugging Face forward per token (any causal LM), None (the default) the lean
    step when it supports the model (or what an enclosing `lean_decoding` says). Both draw the same
    tokens for the same (seed, call, index). `compile_decode` compiles the lean prefill and decode;
    `chunked` (the default) runs k = `decode_compile.CHUNK_STEPS` tokens and their sampling a compiled
    call, False a compiled call a token (what the chunk is measured against).
    """

    def __init__(self, model: PreTrainedModel, *, eos_token_id: int, pad_token_id: int, lean: bool | None = None,
                 compile_decode: bool = False, ledger: CompileLedger | None = None, chunked: bool = True) -> None:
        self.model = model
        self.compile_decode = bool(compile_decode)
        if not isinstance(chunked, bool):
            raise ValueError(f"NativeGenerator(chunked={chunked!r}) must be True or False: whether a compiled "
                             "decode runs k steps and their sampling a call (True) or a call a step (False)")
        self.chunked = chunked
        # the run's compiles (an executor shares one across its calls); the first call of a shape is its compile
        self.ledger = ledger if ledger is not None else CompileLedger()
        self.eos_token_id = token_id(eos_token_id, "eos_token_id", "NativeGenerator")
        self.pad_token_id = token_id(pad_token_id, "pad_token_id", "NativeGenerator")
        reason = lean_unsupported(model)
        if lean and reason is not None:
            raise ValueError(f"NativeGenerator(lean=True): the lean decode step cannot drive this model: {reason}\n"
                             "  fix: pass lean=None (the default) to fall back to a Hugging Face forward per token")
        wanted = _LEAN.get() if lean is None else lean
        self.lean = reason is None and wanted is not False
        if self.compile_decode and not self.lean:
            raise ValueError(f"NativeGenerator(compile_decode=True) compiles the lean decode step, which cannot drive this "
                             f"model: {reason or 'lean=False was asked for'}\n  fix: pass compile_decode=False")

    def generate(
        self, prompts: Prompts, n: int, params: SamplingParams, *, seed: int = 0, call: int = 0
    ) -> Rollouts:
        """N = B*n rollouts; row `i*n + j` is sample j of prompt i and `group[i*n + j] = i`.

        Each response stops after its first EOS (kept, with mask True) or at `max_new_tokens`;
        later positions hold `pad_token_id` with mask False and log-prob 0. T is the longest
        response produced. A row's noise depends only on the key (seed, call, prompts.index[i], j),
        so generating a batch whole or in shards gives the same rows (up to the model's rounding).
        The model runs in eval mode without gradients; its previous mode is restored.
        """
        if n < 1:
            raise ValueError(f"generate: n (samples per prompt) must be >= 1, got {n}")
        _check_prompts(prompts, self.model.get_input_embeddings().num_embeddings)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                return self._generate(prompts, n, params, seed, call)
        finally:
            self.model.train(was_training)

    def _generate(self, prompts: Prompts, n: int, params: SamplingParams, seed: int, call: int) -> Rollouts:
        device = self.model.device
        keys = sampling_keys(seed, call, prompts.index.to(device), n)  # [N]
        ids, mask = prompts.ids.to(device), prompts.mask.to(device).bool()  # [B, P] each
        if self.compile_decode:  # a few cache lengths, so a few compiles, whatever the batches' prompt widths
            ids, mask = pad_prompt_columns(ids, mask, padded_width(ids.shape[1], self.ledger.policy.width),
                                           self.pad_token_id)  # [B, P'] each
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, P']
        chunk = self._chunk(len(keys), params)
        decode = self._decode_chunked if chunk else self._decode_stepwise
        if prompts.image_grid_thw is not None or is_vision_lm(self.model):
            # each prompt's images enter its prefill once (B rows, not N); mrope positions [3, B, P]
            embeds, positions = prompt_inputs(self.model, ids, mask, prompts.pixel_values, prompts.image_grid_thw,
                                              prompts.index)
            decode = functools.partial(self._decode_stepwise, embeds=embeds)
        tokens, logprobs, alive = decode(ids, mask, positions, keys, n, params, chunk)  # [N, S'] each, S' >= 1
        length = int(alive.any(0).nonzero().max()) + 1  # T: the longest response produced
        group = torch.arange(len(prompts), device=device).repeat_interleave(n)  # [N]
        meta = {key: [value for value in values for _ in range(n)] for key, values in prompts.meta.items()}
        prompt_ids = prompts.ids.to(device).repeat_interleave(n, dim=0)  # [N, P]
        prompt_mask = prompts.mask.to(device).bool().repeat_interleave(n, dim=0)  # [N, P]
        images = [None if value is None else value.to(device).repeat_interleave(n, dim=0)  # a sample keeps its prompt's
                  for value in (prompts.pixel_values, prompts.image_grid_thw)]
        return Rollouts(prompt_ids, prompt_mask, tokens[:, :length], alive[:, :length], logprobs[:, :length], group,
                        meta, None, *images)

    def _chunk(self, rows: int, params: SamplingParams) -> int | None:
        """k, the decode steps one compiled call runs with their sampling (`decode_chunk`), or None for
        a call per step: a nucleus (top-p < 1) needs a sort of every row, which stays in the per-step
        sampler, and the chunk's noise [N, k, V] is precomputed, so it must fit `CHUNK_NOISE_WORDS`."""
        if not (self.compile_decode and self.chunked) or params.top_p < 1.0:
            return None
        k = chunk_steps(params.max_new_tokens)
        vocab = self.model.get_input_embeddings().num_embeddings
        return k if rows * k * vocab <= CHUNK_NOISE_WORDS else None

    def _decode_stepwise(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
                         n: int, params: SamplingParams, chunk: None, embeds: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, ...]:
        """(tokens, logprobs, alive) [N, S'] of one model call and one sampling per token; `embeds`
        [B, P, H]: prefill from these input embeddings (a VLM's, images in place) on the HF path."""
        steps = params.max_new_tokens
        start = self._lean_start if self.lean and embeds is None else functools.partial(self._hf_start, embeds=embeds)
        # each prompt is prefilled once; its cache is shared by its n samples
        logits, advance = start(ids, mask, positions, steps, n)  # [N, V], tokens [N] -> [N, V]
        sample = self._sampler(keys, logits.shape[-1], steps, params)
        tokens, logprobs, alive = [], [], []
        running = torch.ones(len(keys), dtype=torch.bool, device=keys.device)  # [N]
        check_every = finished_check_every(keys.device)
        for step in range(steps):
            token, logprob = sample(logits, step)  # [N], [N]
            alive.append(running)
            tokens.append(token.masked_fill(~running, self.pad_token_id))
            logprobs.append(logprob.masked_fill(~running, 0.0))
            running = running & (token != self.eos_token_id)  # [N]
            if step + 1 == steps or ((step + 1) % check_every == 0 and not bool(running.any())):
                break
            logits = advance(tokens[-1])  # [N, V]
        return torch.stack(tokens, 1), torch.stack(logprobs, 1), torch.stack(alive, 1)

    def _decode_chunked(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
                        n: int, params: SamplingParams, chunk: int) -> tuple[torch.Tensor, ...]:
        """(tokens, logprobs, alive) [N, S'] of the compiled prefill and compiled chunks of `chunk` steps
        (`decode_chunk`), one "all rows finished?" check a chunk. S = max_new_tokens that is no multiple
        of k runs the last chunk whole and trims it: one graph per shape, and the k - 1 steps at most it
        wastes cost less than a second graph's compile and call (the steps past S are masked anyway)."""
        steps, device = params.max_new_tokens, keys.device
        chunks = -(-steps // chunk)
        shape = (len(keys), ids.shape[1] + chunks * chunk, chunk)  # one graph per (rows, cache length, k)
        signature, first = model_signature(self.model), self.ledger.first_call(shape)
        started = time.perf_counter()
        decoder = LeanDecoder(self.model)
        logits = decoder.start(ids, mask, positions, chunks * chunk, n, compiled=True)  # [N, V]
        vocab = logits.shape[-1]
        temperature = torch.tensor(1.0 if params.greedy else params.temperature, device=device)  # []
        running = torch.ones(len(keys), dtype=torch.bool, device=device)  # [N]
        if params.greedy:  # argmax(logits / 1 + 0) is argmax(logits): greedy is the same graph
            noise = torch.zeros(chunks, len(keys), chunk, vocab, device=device)  # [C, N, k, V]
        else:  # every chunk's noise hashed at once, each chunk's block contiguous (the graph's input layout)
            noise = steps_noise(keys, vocab, 0, chunks * chunk).view(len(keys), chunks, chunk, vocab)
            noise = noise.transpose(0, 1).contiguous()  # [C, N, k, V]
        outs = []
        for index in range(chunks):
            out = decoder.compiled_chunk(logits, noise[index], temperature, running, self.eos_token_id, self.pad_token_id)
            if device.type == "cuda":  # a CUDA graph's outputs are overwritten by its next replay
                out = tuple(tensor.clone() for tensor in out)
            tokens, logprobs, alive, running, logits = out  # [N, k] x 3, [N], [N, V]
            outs.append((tokens, logprobs, alive))
            if first and index == 0:  # the first call of a shape compiles (prefill and chunk): reported apart
                self.ledger.compiled(shape, time.perf_counter() - started, signature=signature, device=device.type)
            if not bool(running.any()):
                break
        return tuple(torch.cat(parts, 1)[:, :steps] for parts in zip(*outs))

    @staticmethod
    def _sampler(keys: torch.Tensor, vocab: int, steps: int, params: SamplingParams
                 ) -> Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]:
        """(logits [N, V], step) -> (tokens [N], log-probs [N]). On a GPU with Triton, temperature
        sampling without a nucleus runs the fused kernel (one pass over the logits, no [N, V]
        temporaries); otherwise the torch sampler, with the noise of a block of steps hashed at once."""
        if params.greedy:
            return lambda logits, step: sample_tokens(logits, params, None)
        if params.top_p >= 1.0 and keys.device.type in FUSED_SAMPLING_DEVICES and fused.triton is not None:
            return lambda logits, step: fused.gumbel_sample_triton(logits, splitmix64(keys, step), params.temperature)
        noise = StepNoise(keys, vocab, steps)
        return lambda logits, step: sample_tokens(logits, params, None, noise=noise.at(step))

    @property
    def compile_seconds(self) -> float:
        """Seconds spent in decode steps that compiled a graph (the first call of each shape)."""
        return self.ledger.seconds

    def _lean_start(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, steps: int, n: int):
        """(first logits [N, V], step function) of the lean decode loop over prompts [B, P]."""
        decoder = LeanDecoder(self.model)
        logits = decoder.start(ids, mask, positions, steps, n)  # [N, V]
        if not self.compile_decode:
            return logits, decoder.step
        shape = (len(logits), ids.shape[1] + steps)  # one graph per (rows, cache length)
        signature, device = model_signature(self.model), ids.device.type

        def compiled(tokens: torch.Tensor) -> torch.Tensor:
            # the first call of a shape compiles: its time goes to the ledger, reported apart from decoding
            return self.ledger.timed(shape, lambda: decoder.compiled_step(tokens), signature=signature, device=device)

        return logits, compiled

    def _hf_start(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, steps: int, n: int,
                  embeds: torch.Tensor | None = None):
        """(first logits [N, V], step function) of one Hugging Face forward per token over prompts [B, P].
        `positions`: [B, P], or a VLM's mrope [3, B, P] with its prefill `embeds` [B, P, H]."""
        width = ids.shape[1]
        state = {"step": 0, "cache": DynamicCache(config=self.model.config)}
        first = {"input_ids": ids} if embeds is None else {"inputs_embeds": embeds}
        out = self.model(**first, attention_mask=mask.long(), position_ids=positions,
                         past_key_values=state["cache"], use_cache=True, logits_to_keep=1)
        if n > 1:  # the prompts' cache rows repeated for their samples: row i*n + j is sample j of prompt i
            state["cache"].batch_repeat_interleave(n)
        # [N, P] each (mrope: [3, N, P]); a decode step is the last prompt position + step on every axis
        mask, positions = mask.repeat_interleave(n, 0), positions.repeat_interleave(n, positions.dim() - 2)
        attention = torch.ones(len(mask), width + steps, dtype=torch.long, device=ids.device)  # [N, P+steps]
        attention[:, :width] = mask

        def advance(token: torch.Tensor) -> torch.Tensor:
            state["step"] += 1
            out = self.model(input_ids=token[:, None], attention_mask=attention[:, : width + state["step"]],
                             position_ids=positions[..., -1:] + state["step"], past_key_values=state["cache"],
                             use_cache=True, logits_to_keep=1)
            return out.logits[:, -1]  # [N, V]

        return out.logits[:, -1].repeat_interleave(n, 0), advance  # [N, V]

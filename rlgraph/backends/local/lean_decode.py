"""A lean decode loop for Llama-family causal LMs: a preallocated KV cache and a hand-written step.

Why: on small models a Hugging Face forward per decoded token is dispatch overhead, not
arithmetic (0.9 ms a step for 8 rows of the 126k-parameter tiny Qwen2 on one CPU thread, of
which about 0.13 ms are matrix products): each call rebuilds the attention mask, the rotary
tables and the cache bookkeeping, and walks the output-capturing and config-default decorators.
This step (0.6 ms there) does only the layer arithmetic, over the model's own submodules:

    x = embed(token);  per layer:  h = norm1(x);  q, k, v = proj(h);  rotate q, k;
    write k, v at column t of the cache;  x += o_proj(attend(q, cache[:t+1]));  x += mlp(norm2(x))
    logits = lm_head(norm(x))

The projections, norms, MLP and LM head are called as modules, so what wraps them still runs:
LoRA adapters injected by peft (a `PeftModel` is unwrapped to its base model, whose layers hold
the adapters), autocast, hooks. The rotary tables come from the model's own `rotary_emb` for all
positions at once, the mask is a [N, P + S] buffer filled once, and the cache is two
[N, H_kv, P + S, D] tensors per layer written in place: no per-step allocation beyond the
activations. Tokens and log-probs equal the Hugging Face path (bit for bit on the tiny model:
the kernels are the same; another attention kernel choice could move the last bit), which
tests/backends/test_generation_lean.py checks.

For `torch.compile` the prefill (`prefill`), the step with static shapes (`static_decode_step`) and
a chunk of k such steps with their Gumbel-max sampling (`decode_chunk`) are free functions of
tensors and modules: one compiled call then decodes k tokens (generation.py's compiled path).

Models this step does not know (another block structure, sliding-window attention, a norm on q
and k, attention biases it cannot see) are left to the Hugging Face path: `lean_unsupported`
says why.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from rlgraph.kernels.sampling import argmax_and_logprob

_NEEDED_LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "mlp", "self_attn")
_NEEDED_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")


def _causal_lm(model: nn.Module) -> nn.Module:
    """The `*ForCausalLM` inside `model`: a peft `PeftModel` is unwrapped (its adapters live in the
    base model's layers, so calling those layers runs them)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def lean_unsupported(model: nn.Module) -> str | None:
    """Why the lean step cannot drive `model` (None when it can): it needs the Llama/Qwen2 block
    layout (`model.model.layers[i].self_attn.q_proj` ... and `model.lm_head`), full attention, no
    q/k norms, and no forward hooks on the modules whose forward it replaces (the model, its
    decoder, blocks and attention modules): FSDP's parameter gathering, say, lives in such hooks."""
    causal = _causal_lm(model)
    decoder = getattr(causal, "model", None)
    if decoder is None or not hasattr(causal, "lm_head"):
        return f"{type(causal).__name__} has no .model decoder and .lm_head"
    for part in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(decoder, part):
            return f"{type(decoder).__name__} has no .{part}"
    config = causal.config
    # Qwen2 carries a sliding_window it ignores unless use_sliding_window; Mistral-style configs apply theirs
    windowed = config.use_sliding_window if hasattr(config, "use_sliding_window") else getattr(config, "sliding_window", None)
    if windowed or "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return "sliding-window attention"
    bypassed = [("the model", model), (type(causal).__name__, causal), (type(decoder).__name__, decoder)]
    bypassed += [(f"layer {i}", layer) for i, layer in enumerate(decoder.layers)]
    bypassed += [(f"layer {i}.self_attn", getattr(layer, "self_attn", layer)) for i, layer in enumerate(decoder.layers)]
    hooked = [name for name, module in bypassed if _hooked(module)]
    if hooked:
        return f"forward hooks on {', '.join(hooked[:3])}, whose forward the lean step does not call"
    for i, layer in enumerate(decoder.layers):
        missing = [part for part in _NEEDED_LAYER_PARTS if not hasattr(layer, part)]
        attention = getattr(layer, "self_attn", None)
        missing += [part for part in _NEEDED_ATTENTION_PARTS if not hasattr(attention, part)]
        if missing:
            return f"layer {i} ({type(layer).__name__}) has no {', '.join(missing)}"
        if hasattr(attention, "q_norm") or hasattr(attention, "k_norm"):
            return f"layer {i} normalises q and k (Qwen3/OLMo-style), which the lean step does not do"
    return None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [N, H, L, D] by cos, sin [N, 1, L, D]: x*cos + rotate_half(x)*sin,
    rotate_half(x) = (-x[D/2:], x[:D/2]) (the Llama/Qwen2 convention of the weights)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [N, H, L, D]
    return x * cos + rotated * sin  # [N, H, L, D]


class LeanDecoder:
    """Prefill then one `step` per token over a Llama-family causal LM, with a static KV cache.

    >>> decoder = LeanDecoder(model)
    >>> logits = decoder.start(prompt_ids, prompt_mask, positions, 16, n=4)    # [B*4, V]: B prompts, 4 samples each
    >>> logits = decoder.step(tokens)                                          # [N, V], next position
    """

    def __init__(self, model: nn.Module) -> None:
        reason = lean_unsupported(model)
        assert reason is None, f"LeanDecoder on an unsupported model: {reason}"
        causal = _causal_lm(model)
        self.decoder, self.lm_head = causal.model, causal.lm_head
        self.layers = list(self.decoder.layers)

    def start(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, steps: int, n: int = 1, *,
              compiled: bool = False) -> torch.Tensor:
        """Prefill the cache with prompts `ids` [B, P] (left-padded, `mask` [B, P] bool, rotary
        `positions` [B, P]) and size it for `steps` more tokens; the logits [N, V] that predict
        the first response token of each of the N = B*n rows. Each prompt is prefilled once and its
        cache rows repeated for its `n` samples (row i*n + j is sample j of prompt i). `compiled`
        runs `prefill` through `torch.compile` (`compiled_prefill`)."""
        run = compiled_prefill(ids.device.type) if compiled else prefill
        logits, self.key_mask, self.cos, self.sin, self.cache = run(self.decoder, self.lm_head, ids, mask, positions,
                                                                    steps, n)
        self.width = self.filled = ids.shape[1]
        return logits

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append `tokens` [N] at the next position; the logits [N, V] that predict the one after."""
        x = self.decoder.embed_tokens(tokens[:, None])  # [N, 1, H]
        start = self.filled
        self.filled += 1
        attend = self.key_mask[:, None, None, : self.filled]  # [N, 1, 1, L]
        for index, layer in enumerate(self.layers):
            x = _block(layer, x, attend, self.cos, self.sin, self.cache, index, start=start)  # [N, 1, H]
        return self.lm_head(self.decoder.norm(x))[:, -1]  # [N, V]

    def compiled_step(self, tokens: torch.Tensor) -> torch.Tensor:
        """`static_step` through `torch.compile` (CUDA graphs on a GPU): see `compiled_decode_step`."""
        self._static_state(tokens.device)
        logits = compiled_decode_step(tokens.device.type)(self.decoder, self.lm_head, tokens, self.position, self.columns,
                                                          self.key_mask, self.cos, self.sin, self.cache)
        self.filled += 1
        return logits

    def compiled_chunk(self, logits: torch.Tensor, noise: torch.Tensor, temperature: torch.Tensor,
                       running: torch.Tensor, eos: int, pad: int) -> tuple[torch.Tensor, ...]:
        """`decode_chunk` through `torch.compile`: k = noise.shape[1] sampled tokens and decode steps
        in one call (see `decode_chunk` and `compiled_decode_chunk`)."""
        self._static_state(logits.device)
        out = compiled_decode_chunk(logits.device.type)(self.decoder, self.lm_head, logits, self.position, self.columns,
                                                        self.key_mask, self.cos, self.sin, self.cache, noise,
                                                        temperature, running, eos, pad)
        self.filled += noise.shape[1]
        return out

    def _static_state(self, device: torch.device) -> None:
        if not hasattr(self, "position"):
            self.position = torch.tensor([self.filled], device=device)  # [1], the column this token fills
            self.columns = torch.arange(self.key_mask.shape[1], device=device)  # [P+S]

    def static_step(self, tokens: torch.Tensor) -> torch.Tensor:
        """`step` with every shape fixed and the position on the device: the step attends over the
        whole [P+S] cache through a validity mask instead of a slice that grows by one each token,
        writes its keys and values with a tensor index, and advances `self.position` in place, so
        one traced graph (torch.compile, a CUDA graph) serves every token of the call."""
        self._static_state(tokens.device)
        logits = static_decode_step(self.decoder, self.lm_head, tokens, self.position, self.columns, self.key_mask,
                                    self.cos, self.sin, self.cache)
        self.filled += 1
        return logits


def prefill(decoder: nn.Module, lm_head: nn.Module, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
            steps: int, n: int = 1) -> tuple[torch.Tensor, ...]:
    """The prefill of `LeanDecoder.start` as a free function of tensors and modules (so `torch.compile`
    keys its graph on the model and the shapes): (logits [N, V], key_mask [N, P+S], cos, sin
    [N, 1, P+S, D], cache: per layer (keys, values) [N, Hkv, P+S, D], zeros past column P)."""
    rows, width = ids.shape
    key_mask = torch.ones(rows, width + steps, dtype=torch.bool, device=ids.device)  # [B, P+S]
    key_mask[:, :width] = mask
    after = positions[:, -1:] + 1 + torch.arange(steps, device=ids.device)  # [B, S]
    x = decoder.embed_tokens(ids)  # [B, P, H]
    cos, sin = decoder.rotary_emb(x, torch.cat([positions, after], 1))  # [B, P+S, D] each
    cos, sin = cos[:, None], sin[:, None]  # [B, 1, P+S, D]
    causal = torch.ones(width, width, dtype=torch.bool, device=ids.device).tril()  # [P, P]
    # a padding query attends to itself too: no all-masked row (NaN on some kernels); nothing reads it
    attend = (causal & mask[:, None, :]) | torch.eye(width, dtype=torch.bool, device=ids.device)  # [B, P, P]
    cache: list[tuple[torch.Tensor, torch.Tensor]] = []
    for index, layer in enumerate(decoder.layers):
        x = _block(layer, x, attend[:, None], cos, sin, cache, index, start=0, new_cache=steps)  # [B, P, H]
    logits = lm_head(decoder.norm(x[:, -1:]))[:, -1]  # [B, V]
    if n > 1:  # the prompts' rows repeated for their samples
        key_mask = key_mask.repeat_interleave(n, 0)  # [N, P+S]
        cos, sin = cos.repeat_interleave(n, 0), sin.repeat_interleave(n, 0)  # [N, 1, P+S, D]
        cache = [(keys.repeat_interleave(n, 0), values.repeat_interleave(n, 0)) for keys, values in cache]
        logits = logits.repeat_interleave(n, 0)  # [N, V]
    return logits, key_mask, cos, sin, cache


def _block(layer: nn.Module, x: torch.Tensor, attend: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           cache: list[tuple[torch.Tensor, torch.Tensor]], index: int, *, start: int,
           new_cache: int | None = None) -> torch.Tensor:
    """One decoder block on x [N, L, H] whose first position is cache column `start`, rotary tables
    `cos`, `sin` [N, 1, P+S, D]; with `new_cache` (the prefill) this layer's cache is appended to
    `cache` with room for that many more columns."""
    attention = layer.self_attn
    rows, length, _ = x.shape
    h = layer.input_layernorm(x)  # [N, L, H]
    shape = (rows, length, -1, attention.head_dim)
    q = attention.q_proj(h).view(shape).transpose(1, 2)  # [N, Hq, L, D]
    k = attention.k_proj(h).view(shape).transpose(1, 2)  # [N, Hkv, L, D]
    v = attention.v_proj(h).view(shape).transpose(1, 2)  # [N, Hkv, L, D]
    cos, sin = cos[:, :, start : start + length], sin[:, :, start : start + length]  # [N, 1, L, D]
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    if new_cache is not None:
        total = length + new_cache
        # zeros, not empty: the static step reads the columns not yet written (masked out), and
        # a masked column still multiplies its value by a weight of 0, which NaN garbage poisons
        cache.append((k.new_zeros(rows, k.shape[1], total, k.shape[3]),  # [N, Hkv, P+S, D]
                      v.new_zeros(rows, v.shape[1], total, v.shape[3])))
    keys, values = cache[index]
    keys[:, :, start : start + length] = k
    values[:, :, start : start + length] = v
    keys, values = keys[:, :, : start + length], values[:, :, : start + length]  # [N, Hkv, T, D]
    groups = q.shape[1] // k.shape[1]
    if length == 1:  # the query heads of one kv head as a block of queries: no repeated keys
        out = F.scaled_dot_product_attention(q.reshape(rows, k.shape[1], groups, -1), keys, values,
                                             attn_mask=attend, scale=attention.scaling)  # [N, Hkv, G, D]
        out = out.reshape(rows, 1, -1)  # [N, 1, Hq*D]
    else:
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=attend, scale=attention.scaling,
                                             enable_gqa=groups > 1)  # [N, Hq, L, D]
        out = out.transpose(1, 2).reshape(rows, length, -1)  # [N, L, Hq*D]
    x = x + attention.o_proj(out)  # [N, L, H]
    return x + layer.mlp(layer.post_attention_layernorm(x))  # [N, L, H]


def static_decode_step(decoder: nn.Module, lm_head: nn.Module, tokens: torch.Tensor, position: torch.Tensor,
                       columns: torch.Tensor, key_mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       cache: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """One decode step with static shapes (`LeanDecoder.static_step`): tokens [N] at cache column
    `position` [1]; writes that column of every layer's cache, advances `position` by one in place,
    and returns the logits [N, V]. A free function of tensors and modules, so `torch.compile` keys
    its graph on the model and the shapes, not on a decoder object made anew for every call."""
    x = decoder.embed_tokens(tokens[:, None])  # [N, 1, H]
    rows = x.shape[0]
    attend = (key_mask & (columns <= position))[:, None, None]  # [N, 1, 1, P+S]
    cos, sin = cos.index_select(2, position), sin.index_select(2, position)  # [N, 1, 1, D]
    for layer, (keys, values) in zip(decoder.layers, cache):
        attention = layer.self_attn
        h = layer.input_layernorm(x)  # [N, 1, H]
        shape = (rows, 1, -1, attention.head_dim)
        q = _rotate(attention.q_proj(h).view(shape).transpose(1, 2), cos, sin)  # [N, Hq, 1, D]
        k = _rotate(attention.k_proj(h).view(shape).transpose(1, 2), cos, sin)  # [N, Hkv, 1, D]
        v = attention.v_proj(h).view(shape).transpose(1, 2)  # [N, Hkv, 1, D]
        keys.index_copy_(2, position, k)
        values.index_copy_(2, position, v)
        groups = q.shape[1] // k.shape[1]
        out = F.scaled_dot_product_attention(q.reshape(rows, k.shape[1], groups, -1), keys, values,
                                             attn_mask=attend, scale=attention.scaling)  # [N, Hkv, G, D]
        x = x + attention.o_proj(out.reshape(rows, 1, -1))  # [N, 1, H]
        x = x + layer.mlp(layer.post_attention_layernorm(x))  # [N, 1, H]
    position.add_(1)
    return lm_head(decoder.norm(x))[:, -1]  # [N, V]


def decode_chunk(decoder: nn.Module, lm_head: nn.Module, logits: torch.Tensor, position: torch.Tensor,
                 columns: torch.Tensor, key_mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 cache: list[tuple[torch.Tensor, torch.Tensor]], noise: torch.Tensor, temperature: torch.Tensor,
                 running: torch.Tensor, eos: int, pad: int) -> tuple[torch.Tensor, ...]:
    """k = noise.shape[1] tokens sampled and decoded, what `NativeGenerator`'s loop does for k steps:

        per step i:  scaled = logits / temperature;  token = argmax(scaled + noise[:, i])  (Gumbel-max)
                     logprob = log_softmax(scaled)[token];  rows not `running`: token pad, logprob 0
                     running &= token != eos;  logits = static_decode_step(token)

    from `logits` [N, V] (predicting the chunk's first token) with the precomputed Gumbel `noise`
    [N, k, V] of those steps (greedy: zeros and temperature 1) and `temperature` f32[] (a tensor, so
    no graph is specialised on its value). Returns (tokens i64[N, k], logprobs f32[N, k], alive
    bool[N, k]: the rows running when each token was drawn, running [N] after the chunk, logits
    [N, V] predicting the next chunk's first token). The cache needs k free columns from `position`:
    the chunk decodes its last token too, which the next chunk (or nothing) reads."""
    tokens, logprobs, alive = [], [], []
    for step in range(noise.shape[1]):
        scaled = logits.float() / temperature  # [N, V]
        token, logprob = argmax_and_logprob(scaled, scaled + noise[:, step])  # [N], [N]
        alive.append(running)
        token = token.masked_fill(~running, pad)  # [N]
        tokens.append(token)
        logprobs.append(logprob.masked_fill(~running, 0.0))
        running = running & (token != eos)  # [N]; a finished row's pad is no EOS to it: it stays finished
        logits = static_decode_step(decoder, lm_head, token, position, columns, key_mask, cos, sin, cache)  # [N, V]
    return torch.stack(tokens, 1), torch.stack(logprobs, 1), torch.stack(alive, 1), running, logits


_COMPILED: dict[tuple[str, str], object] = {}


def _compiled(function, device_type: str, *, cuda_graphs: bool = True):
    """`function` under `torch.compile`, once per device type and shared by every generator: dynamo
    keys its graphs on the modules and the shapes, so a model compiles once per shape and every later
    call of the same shapes reuses the graph (and Inductor's on-disk cache serves a later process).
    On CUDA the mode is "reduce-overhead": CUDA graphs over the static cache, whose tensors are
    written in place (UNTESTED on a GPU so far: docs/gpu.md); `cuda_graphs` False keeps the default
    mode there (the prefill, run once a call, whose outputs the chunks then write). On the CPU
    Inductor's C++ wrapper calls the kernels without Python in between: 9.4 against 11.4 ms a call
    of 8 rows x 16 tokens with the Python wrapper (eager 15.0; docs/benchmarks.md)."""
    key = (function.__name__, device_type)
    if key not in _COMPILED:
        mode = "reduce-overhead" if device_type == "cuda" and cuda_graphs else None
        options = {"cpp_wrapper": True} if device_type == "cpu" else None
        _COMPILED[key] = torch.compile(function, dynamic=False, mode=mode, options=options)
    return _COMPILED[key]


def compiled_decode_step(device_type: str):
    """`static_decode_step` under `torch.compile` (`_compiled`): one graph per (rows, cache length)."""
    return _compiled(static_decode_step, device_type)


def compiled_decode_chunk(device_type: str):
    """`decode_chunk` under `torch.compile` (`_compiled`): one graph per (rows, cache length, k)."""
    return _compiled(decode_chunk, device_type)


def compiled_prefill(device_type: str):
    """`prefill` under `torch.compile` (`_compiled`, no CUDA graphs): a graph per (prompts, width, steps, n)."""
    return _compiled(prefill, device_type, cuda_graphs=False)

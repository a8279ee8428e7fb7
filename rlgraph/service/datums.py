"""A Tinker batch as rlgraph's containers, checked field by field.

A datum is Tinker's: `tokens` (the model input, L ids) and `loss_fn_inputs`, each [L]:
`target_tokens` (the token each position predicts), `weights`, `logprobs` (the sampler's),
`advantages`. rlgraph scores a sequence as a prompt and a response, so datum i becomes one
rollout row: prompt = tokens[0], response = target_tokens, which is the same sequence when
`target_tokens[t] == tokens[t + 1]` (Tinker's next-token layout, the only one the SDK's helpers
build). A datum whose targets are not its next inputs is refused, naming the position.

Every bad value is a `CallError` naming `data[i].<field>`; nothing here touches a model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import attrs
import torch

from rlgraph.batches import Prompts, Rollouts
from rlgraph.service.errors import CallError
from rlgraph.service.losses import KNOWN_INPUTS, NEEDS, LossBatch


@attrs.frozen
class Datum:
    """One training example: input `tokens` and its per-position `loss_fn_inputs` (lists or tensors)."""

    tokens: Sequence[int]
    loss_fn_inputs: Mapping[str, Sequence[float] | torch.Tensor] = attrs.field(factory=dict)


@attrs.frozen
class Limits:
    """What one call may hold: `max_datums` per forward/backward, `max_tokens` per sequence (the
    model's context), `max_samples` per sample call, `max_new_tokens` per sampled sequence; and what
    a key may hold: `max_models` training models, `max_samplers` samplers; a training model keeps its
    `kept_snapshots` newest sampler snapshots (an RL loop makes one a step; older ones are dropped).
    Every limit is a field so tests can make it small."""

    vocab_size: int
    max_tokens: int
    max_datums: int = 256
    max_samples: int = 64
    max_new_tokens: int = 256
    max_models: int = 32
    max_samplers: int = 64
    kept_snapshots: int = 4
    # What the HTTP server reads before any work is done on a request (docs/security.md):
    max_body_bytes: int = 16 * 1024 * 1024  # a body, counted as it is read (chunked bodies too)
    body_seconds: float = 60.0  # the whole body must arrive within this (a trickled body is cut: 408)
    max_json_depth: int = 32  # nesting of a JSON body (the SDK's deepest request nests 6)
    chars_per_token: int = 32  # an OpenAI text prompt longer than max_tokens * this is refused untokenised
    # ... and what one API key may hold on it:
    max_queued_calls: int = 256  # calls waiting or running (429 past it: the SDK retries later)
    max_queued_bytes: int = 64 * 2**20  # ... and their request bodies (decoded, they are what a queue holds)
    max_kept_results: int = 1024  # finished results kept retrievable (the key's oldest go first)
    max_kept_bytes: int = 256 * 2**20  # ... within their requests' bytes (a result is no larger than its request)
    max_sessions: int = 256  # SDK sessions (the key's oldest go first)
    max_saved_states: int = 1024  # state files in --state-dir (save_state, named sampler weights): disk is shared

    @property
    def max_prompt_chars(self) -> int:
        return self.max_tokens * self.chars_per_token


def check_tokens(tokens: object, field: str, limits: Limits, *, room: int = 0) -> list[int]:
    """`tokens` as a list of ids in the vocabulary, at most `max_tokens - room` long (the length is
    checked first: a long list is refused before anything walks it)."""
    count = math.prod(tokens.shape) if hasattr(tokens, "shape") else len(tokens) if isinstance(tokens, (list, tuple)) \
        else None
    if count is not None and count > limits.max_tokens - room:
        raise CallError(f"holds {count} tokens; the model's context is {limits.max_tokens}"
                        + (f" and {room} more are needed" if room else ""), field=field, status=413,
                        fix="send shorter sequences")
    if hasattr(tokens, "tolist"):  # a tensor or a numpy array (the SDK's TensorData.to_numpy())
        tokens = tokens.tolist()
    if not isinstance(tokens, (list, tuple)) or not tokens:
        raise CallError(f"needs a non-empty list of token ids, got {_short(tokens)}", field=field)
    bad = next((i for i, t in enumerate(tokens) if isinstance(t, bool) or not isinstance(t, int)
                or not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise CallError(f"token {bad} is {_short(tokens[bad])}, not an id of the vocabulary 0..{limits.vocab_size - 1}",
                        field=field, fix="tokenize with the model's tokenizer (get_tokenizer())")
    return list(tokens)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) < 60 else text[:57] + "..."


def _floats(value: object, field: str, length: int) -> torch.Tensor:
    try:
        tensor = torch.as_tensor(value, dtype=torch.float32).flatten() if not isinstance(value, torch.Tensor) \
            else value.detach().to(torch.float32).flatten()
    except (TypeError, ValueError, RuntimeError):
        raise CallError(f"needs {length} numbers, got {_short(value)}", field=field) from None
    if tensor.numel() != length:
        raise CallError(f"has {tensor.numel()} values; the datum has {length} input tokens, one value each",
                        field=field)
    if not bool(torch.isfinite(tensor).all()):
        position = int((~torch.isfinite(tensor)).nonzero()[0])
        raise CallError(f"value {position} is {float(tensor[position])}, not finite", field=field,
                        fix="send finite numbers (a NaN advantage or log-prob would poison the update)")
    return tensor


def check_datums(data: Sequence[Datum], loss_fn: str, limits: Limits) -> list[tuple[list[int], dict[str, torch.Tensor]]]:
    """Each datum's tokens and its loss inputs as tensors [L], checked; the loss's required inputs present."""
    if not isinstance(data, (list, tuple)) or not data:
        raise CallError("needs a non-empty list of datums", field="data")
    if len(data) > limits.max_datums:
        raise CallError(f"holds {len(data)} datums; this server takes at most {limits.max_datums} per call",
                        field="data", status=413, fix="split the batch over several forward_backward calls")
    checked = []
    for i, datum in enumerate(data):
        where = f"data[{i}]"
        tokens = check_tokens(datum.tokens, f"{where}.model_input", limits, room=1)
        inputs: dict[str, torch.Tensor] = {}
        for name, value in datum.loss_fn_inputs.items():
            if name not in KNOWN_INPUTS:
                raise CallError(f"unknown loss input {name!r} (known: {', '.join(KNOWN_INPUTS)})",
                                field=f"{where}.loss_fn_inputs.{name}")
            if name == "target_tokens":
                targets = check_tokens(value, f"{where}.loss_fn_inputs.target_tokens", limits, room=1)
                inputs[name] = torch.tensor(targets, dtype=torch.long)
                if len(targets) != len(tokens):
                    raise CallError(f"has {len(targets)} tokens; model_input has {len(tokens)}, one target each",
                                    field=f"{where}.loss_fn_inputs.target_tokens")
            else:
                inputs[name] = _floats(value, f"{where}.loss_fn_inputs.{name}", len(tokens))
        for name in NEEDS.get(loss_fn, ("target_tokens", "logprobs", "advantages")):
            if name not in inputs:
                raise CallError(f"{loss_fn} needs loss input {name!r}", field=f"{where}.loss_fn_inputs.{name}",
                                fix=f"loss_fn_inputs needs {', '.join(NEEDS.get(loss_fn, ()))}")
        _check_next_token_layout(tokens, inputs["target_tokens"].tolist(), where)
        checked.append((tokens, inputs))
    return checked


def _check_next_token_layout(tokens: list[int], targets: list[int], where: str) -> None:
    for t in range(len(tokens) - 1):
        if targets[t] != tokens[t + 1]:
            raise CallError(f"target_tokens[{t}] is {targets[t]} but model_input[{t + 1}] is {tokens[t + 1]}: rlgraph "
                            "trains on sequences, where each target is the next input token",
                            field=f"{where}.loss_fn_inputs.target_tokens",
                            fix="build datums as model_input = seq[:-1], target_tokens = seq[1:]")


def to_rollouts(checked: Sequence[tuple[list[int], Mapping[str, torch.Tensor]]], pad_id: int) -> tuple[Rollouts, LossBatch]:
    """Datums as one rollout row each (prompt = the first token, response = the targets, right-padded
    to the longest, T) and their loss inputs as [N, T] tensors."""
    steps = max(len(tokens) for tokens, _ in checked)
    rows = len(checked)
    response = torch.full((rows, steps), pad_id, dtype=torch.long)  # [N, T]
    mask = torch.zeros(rows, steps, dtype=torch.bool)  # [N, T]
    fields = {name: torch.zeros(rows, steps) for name in ("weights", "logprobs", "advantages")}  # [N, T] each
    for i, (tokens, inputs) in enumerate(checked):
        length = len(tokens)
        response[i, :length] = inputs["target_tokens"]
        mask[i, :length] = True
        fields["weights"][i, :length] = inputs.get("weights", torch.ones(length))
        for name in ("logprobs", "advantages"):
            if name in inputs:
                fields[name][i, :length] = inputs[name]
    first = torch.tensor([[tokens[0]] for tokens, _ in checked], dtype=torch.long)  # [N, 1]
    # weights and advantages ride as metadata columns, read in the plan by rg.column (programs.py)
    columns = {name: list(fields[name]) for name in ("weights", "advantages")}  # N rows of [T] each
    rollouts = Rollouts(first, torch.ones_like(first, dtype=torch.bool), response, mask,
                        fields["logprobs"] * mask, torch.arange(rows), meta=columns)
    return rollouts, LossBatch(response, mask, fields["weights"], fields["logprobs"], fields["advantages"])


def to_prompts(tokens: list[int]) -> Prompts:
    """One prompt, B = 1."""
    ids = torch.tensor([tokens], dtype=torch.long)  # [1, P]
    return Prompts(ids, torch.ones_like(ids, dtype=torch.bool))

"""A local role's live state (`LMWorker`: its model, optimizer and version) and its checkpoint state:
its weights as a checkpoint holds them (a LoRA role's adapters only), the checks that a checkpoint
fits the roles before anything is loaded (all or nothing), and how a set of weights is described in
an error."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from rlgraph.backends.protocols import ExecutorState


@attrs.define
class LMWorker:
    """A model role. `optimizer=None` makes it frozen (a reference model).

    `kind="critic"` marks a value model (`rlgraph.backends.local.critic.Critic`): `values` and its
    updates use `model.values(rollouts)` in place of the log-probs.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None = None
    version: int = 0
    kind: str = "lm"


class CheckpointMismatch(ValueError):
    """A checkpoint that does not fit the executor it is loaded into."""


def optimizer_kind(optimizer: Any) -> str | None:
    inner = getattr(optimizer, "optimizer", optimizer)  # a sharded executor wraps its optimizer
    return None if inner is None else type(inner).__name__


def check_role_state(role: str, expected: Mapping[str, torch.Tensor], optimizer_kind: str | None,
                     state: ExecutorState, where: str) -> None:
    """Refuse a checkpoint role that does not match: missing, other tensor names or shapes, other optimizer."""
    if role not in state.roles:
        raise CheckpointMismatch(f"{where} has no role {role!r} (it has {', '.join(state.roles) or 'none'}); "
                                 "was it written by another algorithm?")
    held = state.roles[role]
    missing, extra = sorted(set(expected) - set(held.model)), sorted(set(held.model) - set(expected))
    shapes = [name for name, tensor in expected.items()
              if name in held.model and tuple(held.model[name].shape) != tuple(tensor.shape)]
    if (missing or extra or shapes) and (is_adapter_set(expected) or is_adapter_set(held.model)):
        raise CheckpointMismatch(f"{where}: role {role!r} holds {describe_weights(held.model)}; this run has "
                                 f"{describe_weights(expected)}\n  fix: resume with the settings the checkpoint was "
                                 "written with (model.lora), or start a new run")
    if missing or extra:
        raise CheckpointMismatch(f"{where}: role {role!r} has other weights than the model (missing {missing[:3]}, "
                                 f"unexpected {extra[:3]}): another architecture")
    if shapes:
        name = shapes[0]
        raise CheckpointMismatch(f"{where}: role {role!r} weight {name!r} is {tuple(held.model[name].shape)}, "
                                 f"the model's is {tuple(expected[name].shape)}: another model shape")
    if held.optimizer_kind != optimizer_kind:
        raise CheckpointMismatch(f"{where}: role {role!r} was trained with {held.optimizer_kind or 'no optimizer'}, "
                                 f"this run uses {optimizer_kind or 'none'}")


def checkpoint_weights(worker: LMWorker) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint keeps of a role: every tensor of its state dict, except for a
    trainable role that also has frozen parameters (LoRA adapters over a frozen base), which keeps
    only its trainable parameters: the frozen ones never change, so they come back from the
    model source on resume, and the optimizer (built over the parameters that require grad) holds
    exactly these. A role with no parameters (a LoRA policy's reference view) keeps nothing."""
    state = worker.model.state_dict()
    if worker.optimizer is None:
        return state
    trainable = {name for name, param in worker.model.named_parameters() if param.requires_grad}
    frozen = any(not param.requires_grad for param in worker.model.parameters())
    return {name: tensor for name, tensor in state.items() if name in trainable} if trainable and frozen else state


def load_checkpoint_weights(worker: LMWorker, weights: Mapping[str, torch.Tensor]) -> None:
    """Load what `checkpoint_weights` gave (checked by `check_role_state` first): all of the state
    dict, or only the trainable tensors, the frozen base staying as the model source built it."""
    expected = checkpoint_weights(worker)
    assert set(expected) == set(weights), sorted(set(expected) ^ set(weights))[:4]
    if len(expected) == len(worker.model.state_dict()):
        worker.model.load_state_dict(dict(weights), strict=True)
        return
    result = worker.model.load_state_dict(dict(weights), strict=False)
    assert not result.unexpected_keys, result.unexpected_keys[:4]


def is_adapter_set(weights: Mapping[str, torch.Tensor]) -> bool:
    return any(".lora_" in name for name in weights)


def describe_weights(weights: Mapping[str, torch.Tensor]) -> str:
    """What a role's checkpoint tensors are, for a mismatch message: "LoRA adapters r=8 on
    q_proj,v_proj", "full weights (27 tensors)" or "no weights" (peft's `<module>.lora_A.<adapter>.weight`
    is [r, in]; the rank and the wrapped modules are read from those)."""
    if not weights:
        return "no weights (a view of another role's weights)"
    ranks, targets = set(), set()
    for name, tensor in weights.items():
        module, found, _ = name.partition(".lora_A.")
        if found:
            ranks.add(int(tensor.shape[0]))
            targets.add(module.rsplit(".", 1)[-1])
    if not ranks:
        return f"full weights ({len(weights)} tensors)"
    rank = f"r={min(ranks)}" if len(ranks) == 1 else f"r={min(ranks)}..{max(ranks)}"
    return f"LoRA adapters {rank} on {','.join(sorted(targets))}"

"""FSDP2's shard format, in one place: what a rank holds of a role and how the whole comes back.

A role that trains or runs forward passes is `fully_shard`ed over its group's ranks: each decoder
layer is an FSDP2 unit (when it holds at least `WorldSpec.fsdp_unit_params` parameters, 1M by
default: every real LLM's layers; a tiny model's layers stay in the root unit, where per-layer
collectives would cost more than they save) and the role's forward (`RoleForward`: the chunked
log-prob head, or the critic's values) is the root, so each rank holds only its dim-0 shards
between steps (`torch.chunk` order). The optimizer steps the local shards (`LocalShardOptimizer`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rlgraph.backends.local.state import LMWorker
from rlgraph.backends.local.logprobs import role_outputs
from rlgraph.batches import Rollouts

# torch 2.13 renamed all_gather_into_tensor (deprecated there); older releases have only the old name.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class RoleForward(torch.nn.Module):
    """The FSDP2 root of a role: its forward is the role's per-token output, so the root's
    all-gather (embeddings, final norm, LM head) happens in a forward FSDP2 sees."""

    def __init__(self, module: torch.nn.Module, kind: str):
        super().__init__()
        self.module = module
        self.kind = kind

    def forward(self, rollouts: Rollouts, temperature: float = 1.0, with_entropy: bool = False, packed: bool = False,
                vocab: bool = False):
        return role_outputs(self.module, self.kind, rollouts, temperature=temperature, with_entropy=with_entropy,
                            packed=packed, vocab=vocab)


def role_module(worker: LMWorker) -> torch.nn.Module:
    """The model a role's FSDP2 root runs (a `base_of` view has none of its own: the view itself,
    which holds no parameters)."""
    return worker.model.module if isinstance(worker.model, RoleForward) else worker.model


def decoder_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a Hugging Face model (`...DecoderLayer`), each its own FSDP2 unit."""
    return [m for m in module.modules() if type(m).__name__.endswith("DecoderLayer")]


def engine_dtype(device: torch.device) -> torch.dtype:
    """The dtype a generation engine holds its weights in, and so the dtype a weight sync moves:
    bf16 on CUDA (the fp32 master shards are cast before they are gathered: half the bytes), fp32 on CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def gather_full(params: list[torch.Tensor], dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """The full tensors of FSDP2-sharded parameters (dim-0 shards on a 1-D mesh) with one
    all-gather for the whole list, instead of one `full_tensor()` collective per parameter.
    `dtype`: cast the local shards before the all-gather (a cast is elementwise, so gathering
    cast shards gives exactly the cast full tensors, for fewer bytes on the wire)."""
    sharded = [p for p in params if isinstance(p, DTensor)]
    if not sharded:
        return [p.detach() if dtype is None else p.detach().to(dtype) for p in params]
    mesh = sharded[0].device_mesh
    mesh = mesh["shard"] if mesh.ndim > 1 else mesh  # HSDP: every replica holds all the shards
    ranks = mesh.size()
    locals_, rows = [], []
    for p in sharded:
        per_rank = -(-p.shape[0] // ranks)  # torch.chunk's shard rows; the last shards may be shorter or empty
        local = p.to_local().detach().reshape(-1)
        local = local if dtype is None else local.to(dtype)
        width = per_rank * math.prod(p.shape[1:])
        locals_.append(torch.nn.functional.pad(local, (0, width - local.numel())))
        rows.append(per_rank)
    flat = torch.cat(locals_).to(mesh.device_type)  # [sum of padded shard sizes]; cpu_offload shards come from the host
    gathered = torch.empty(ranks * flat.numel(), dtype=flat.dtype, device=flat.device)
    _all_gather(gathered, flat, group=mesh.get_group())  # one collective per bucket
    gathered = gathered.view(ranks, -1)  # [ranks, sum of padded shard sizes]
    fulls, offset = {}, 0
    for p, piece, per_rank in zip(sharded, locals_, rows):
        block = gathered[:, offset:offset + piece.numel()].reshape(ranks * per_rank, *p.shape[1:])
        fulls[id(p)] = block[:p.shape[0]]  # drop the padding of the last shards
        offset += piece.numel()
    return [fulls[id(p)] if id(p) in fulls else p.detach() if dtype is None else p.detach().to(dtype) for p in params]


def shard_rows(full: torch.Tensor, position: int, ways: int) -> torch.Tensor:
    """The dim-0 shard rank `position` of `ways` holds under FSDP2 (`torch.chunk`; possibly empty)."""
    chunks = torch.chunk(full, ways, dim=0)
    return chunks[position] if position < len(chunks) else full[:0]


def on_host(worker: LMWorker) -> bool:
    """Whether FSDP2 keeps `worker`'s shards, and so its optimizer state, in host memory (cpu_offload):
    then an offload step has nothing to move, and an onload must not pull the state away from them."""
    return any(local_shard(param).device.type == "cpu" for param in worker.model.parameters())


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (sharing its storage), or the tensor itself."""
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach()


class LocalShardOptimizer:
    """An elementwise optimizer (SGD, AdamW) stepping each rank's shards of FSDP2 parameters in place.

    Elementwise updates give the same numbers on a shard as on the whole tensor, and stepping plain
    tensors avoids a DTensor dispatch per operation per parameter (on the CPU demo that was ~15 ms
    of a 100 ms step). The optimizer state is sharded by construction. Not for optimizers that take
    whole-tensor statistics (LAMB, Shampoo, Muon): those need the DTensor parameters.
    """

    def __init__(self, params: Any, build: Any):
        self.params = [p for p in params if p.requires_grad]
        self.shards = [torch.nn.Parameter(local_shard(p)) for p in self.params]  # aliases of the shards' storage
        self.optimizer = build(self.shards)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in (*self.params, *self.shards):
            param.grad = None

    def step(self) -> None:
        for shard, param in zip(self.shards, self.params):
            shard.grad = None if param.grad is None else local_shard(param.grad)
        self.optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)


class HostBuffers:
    """Host copies of the optimizer state an offload step parks, allocated once and reused every step:
    pinned where an accelerator is present (`pin`), so the device-to-host and host-to-device copies
    run asynchronously (until the executor synchronizes), instead of a fresh pageable tensor per
    tensor per step. Keyed by (role, the state's position, its name); a shape or dtype change
    allocates anew."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.buffers: dict[tuple, torch.Tensor] = {}

    def park(self, key: tuple, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` copied into its host buffer (which is returned: the optimizer state now)."""
        buffer = self.buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = self.buffers[key] = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=self.pin)
        buffer.copy_(tensor, non_blocking=self.pin)
        return buffer

    def restore(self, buffer: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A device copy of a parked buffer (the buffer stays, for the next park)."""
        return buffer.to(device, non_blocking=self.pin)


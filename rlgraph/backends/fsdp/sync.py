"""Weight sync: the FSDP2 executor fills its generation engines from the trained shards.

A group that generates holds a generation engine: a full, unsharded copy of the model it serves
(bf16 on CUDA) that the native KV-cache generator runs, or a vLLM engine. `sync_weights` fills it
bucket by bucket (colocated: every rank all-gathers one bucket at a time; split: the training
group's first rank broadcasts each gathered bucket to the generating ranks), and the engine then
refuses any other version than the one it was given. A LoRA role's engine is a plain model, synced
with merged weights (W + B A * scale, gathered bucket by bucket, a layer's base and adapters in
the same bucket), so it needs no peft. Where that engine runs on the role's own base
(`shared_base`, `rlgraph.backends.fsdp.build.shares_base`) a sync sends the adapted linears alone:
every other engine weight is the role's base tensor itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rlgraph.backends.fsdp.shards import engine_dtype, gather_full, local_shard, role_module
from rlgraph.backends.protocols import ModelRef
from rlgraph.backends.vllm.engine import VLLMEngine


class WeightSync:
    """The `FSDPExecutor`'s weight-sync commands (a mixin: it uses the executor's `models`,
    `engines`, `served`, `adapters`, `sync_groups`, `rank`, `_live` and `_comm_device`)."""

    def sync_weights(self, model: ModelRef | None, route: Any = None) -> ModelRef:
        """Fill the engines of `route.dst` with `route.role`'s FSDP2 weights, one bucket at a time."""
        role = route.role
        trains = self.rank in route.src
        if trains:
            self._live(model)
        group = None if route.colocated else self.sync_groups[sync_ranks(route.src, route.dst)]
        buckets = list(self._buckets(role, route)) if trains else []
        layout = [self._served_layout(role, bucket) for bucket in buckets] if trains else None
        version = model.version if trains else None
        if group is not None and self.rank in sync_ranks(route.src, route.dst):
            box = [(version, layout)]  # the generating ranks learn the version and the buckets' names and shapes
            dist.broadcast_object_list(box, src=route.src[0], group=group)
            version, layout = box[0]
        receives = self.rank in route.dst
        engine = self.engines.get(role) if receives else None
        if isinstance(engine, VLLMEngine):
            engine.wake_up(["weights"])  # before loading; the KV cache wakes at the offload before generate
        for index, names_shapes in enumerate(layout):
            fulls = self._served_bucket(role, buckets[index]) if trains else None
            if group is not None:
                fulls = self._broadcast_bucket(names_shapes, fulls, route, group)
            if receives:
                self._load_bucket(engine, [name for name, _ in names_shapes], fulls)
            del fulls  # at most one gathered bucket is alive at a time
        if receives:
            self.served[role] = version
            if isinstance(engine, VLLMEngine):
                engine.finish_sync(version)
        return ModelRef(role, version)

    @staticmethod
    def _load_bucket(engine: Any, names: list[str], fulls: list[torch.Tensor]) -> None:
        if isinstance(engine, VLLMEngine):
            engine.load_weights(zip(names, fulls))  # Hugging Face names; vLLM fuses q/k/v, gate/up itself
            return
        engine_params = dict(engine.named_parameters())
        with torch.no_grad():
            for name, full in zip(names, fulls):
                engine_params[name].copy_(full)

    def _buckets(self, role: str, route: Any) -> Iterator[list[tuple[str, Any]]]:
        """The trained model's parameters in order, grouped into buckets of <= `route.bucket_bytes` as
        they travel (the engine's dtype); a LoRA layer's base weight and adapters are never split
        (they merge into one tensor)."""
        bucket, size = [], 0
        element = engine_dtype(self.device).itemsize
        for layer in _merge_units(role_module(self.models[role]).named_parameters()):
            if role in self.shared_base and not any(".lora_" in name for name, _ in layer):
                continue  # the engine holds this very tensor (`shares_base`): nothing to send

            nbytes = sum(param.numel() for _, param in layer) * element
            if bucket and size + nbytes > route.bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.extend(layer)
            size += nbytes
        if bucket:
            yield bucket

    def _served_layout(self, role: str, bucket: list[tuple[str, Any]]) -> list[tuple[str, tuple[int, ...]]]:
        """The names and shapes the engine receives for `bucket` (LoRA: the plain model's, no adapters)."""
        if role not in self.adapters:
            return [(name, tuple(param.shape)) for name, param in bucket]
        from rlgraph.backends.lora import plain_name

        return [(plain_name(name), tuple(param.shape)) for name, param in bucket
                if plain_name(name) is not None and self._served(role, plain_name(name))]

    def _served(self, role: str, name: str) -> bool:
        """Whether the engine takes `name` from a sync: all of a role's weights, or, where the engine
        runs on the role's own base (`shares_base`), the adapted ones (merged) only."""
        return role not in self.shared_base or name in self.adapters[role]

    def _served_bucket(self, role: str, bucket: list[tuple[str, Any]]) -> list[torch.Tensor]:
        """`bucket`'s full tensors (one all-gather) as the engine takes them, in its dtype: a LoRA
        role's merged first, in fp32 (base + scaled B A), then cast."""
        dtype = engine_dtype(self.device)
        if role not in self.adapters:
            return gather_full([param for _, param in bucket], dtype)
        from rlgraph.backends.lora import merge_adapters

        fulls = gather_full([param for _, param in bucket])
        with torch.no_grad():
            merged = merge_adapters(dict(zip([name for name, _ in bucket], fulls)), self.adapters[role])
            return [full.to(dtype) for name, full in merged.items() if self._served(role, name)]

    def _broadcast_bucket(self, names_shapes, fulls, route, group) -> list[torch.Tensor] | None:
        """The trainer's first rank sends one flat bucket, in the engine's dtype, to the generating ranks."""
        if self.rank not in sync_ranks(route.src, route.dst):
            return fulls
        shapes = [shape for _, shape in names_shapes]
        sizes = [torch.Size(shape).numel() for shape in shapes]
        dtype = engine_dtype(self.device)
        if self.rank == route.src[0]:
            flat = torch.cat([full.to(dtype).reshape(-1) for full in fulls]).to(self._comm_device())
        else:
            flat = torch.empty(sum(sizes), dtype=dtype, device=self._comm_device())
        dist.broadcast(flat, src=route.src[0], group=group)
        return [piece.view(shape) for piece, shape in zip(flat.split(sizes), shapes)]

    def weights_report(self, role: str) -> dict[str, Any]:
        """What this rank holds of `role`: parameter elements held locally and in the whole model,
        the version its engine serves, and the largest |engine - gathered FSDP2 weight| (every rank
        of the role's group must call it: the comparison all-gathers)."""
        report: dict[str, Any] = {"served": self.served.get(role)}
        if role in self.models:
            params = list(role_module(self.models[role]).named_parameters())
            report["local_numel"] = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for _, p in params)
            report["global_numel"] = sum(p.numel() for _, p in params)
            if role in self.engines and not isinstance(self.engines[role], VLLMEngine):
                held = {local_shard(p).untyped_storage().data_ptr() for _, p in params}
                report["engine_numel"] = sum(p.numel() for p in self.engines[role].parameters())
                report["engine_shared_numel"] = sum(p.numel() for p in self.engines[role].parameters()
                                                    if p.untyped_storage().data_ptr() in held)
                engine = dict(self.engines[role].named_parameters())
                served = zip([name for name, _ in self._served_layout(role, params)], self._served_bucket(role, params))
                report["engine_diff"] = max(float((engine[name].float() - full.float()).abs().max()) for name, full in served)
        return report


def _merge_units(named: Iterator[tuple[str, Any]]) -> Iterator[list[tuple[str, Any]]]:
    """Consecutive parameters that merge into one served tensor: a LoRA layer's `base_layer`
    tensors and its adapters (peft registers them together); any other parameter on its own."""
    unit, key = [], None
    for name, param in named:
        layer = name.split(".base_layer.")[0] if ".base_layer." in name else name.split(".lora_")[0]
        if unit and layer != key:
            yield unit
            unit = []
        unit.append((name, param))
        key = layer
    if unit:
        yield unit


def sync_ranks(src: tuple[int, ...], dst: tuple[int, ...]) -> tuple[int, ...]:
    """The ranks of a split sync's broadcast: the trainer's first rank and the generating ranks."""
    return tuple(sorted({src[0], *dst}))

"""Start-up weights as files, and each rank reading only its own shard of them.

    write_weights(model.state_dict(), path)            # once, on the controller: safetensors, atomic
    source = WeightSource.of(path)                     # on a rank: nothing is read yet
    with parameters_on_meta():
        module = build()                               # parameters on the meta device, buffers real
    fully_shard(...)                                   # FSDP2 shards the meta parameters
    fill_shards(root, module, source, device)          # allocate, then read only this rank's rows

A `WorldSpec` whose roles carry a weights file pickles to a few kilobytes, whatever the model's
size, and a rank of an FSDP2 group holds its shard plus one parameter's rows in flight instead of
the full model (what it held before: the pickled copy and the built module, both full).

Tied parameters (Qwen2.5-0.5B's embedding and LM head) are one tensor under two names: the file
keeps the first name and records the others in its metadata (safetensors refuses shared storage),
and a reader resolves either name.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, Shard

from rlgraph.errors import ConfigError

ALIASES = "rlgraph.aliases"  # metadata key: {dropped name: the stored name holding the same tensor}


def write_weights(weights: Mapping[str, torch.Tensor], path: str | os.PathLike) -> Path:
    """`weights` as one safetensors file at `path`, written to a temporary name then renamed, so a
    reader never sees half a file. Tensors sharing storage are stored once (see the module doc)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    stored, aliases, seen = {}, {}, {}
    for name, tensor in weights.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.dtype)
        if tensor.numel() > 0 and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        stored[name] = tensor.detach().to("cpu").contiguous()
    partial = path.with_name(path.name + ".partial")
    save_file(stored, str(partial), metadata={ALIASES: json.dumps(aliases)})
    os.replace(partial, path)
    return path


class SafetensorsFile:
    """One safetensors file, each read a plain `pread` of the bytes asked for. Not `safe_open`'s mmap:
    a mapped file's pages count in the process's resident memory for as long as the file is open, so
    a rank filling its shards from a bf16 checkpoint would peak at its shards plus every page it read
    (3.1 GiB for Qwen2.5-1.5B); a read leaves only the tensor it returns (the page cache is the
    kernel's, reclaimable, and in no process's RSS)."""

    DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        with open(self.path, "rb") as file:
            try:
                (length,) = struct.unpack("<Q", file.read(8))
                header = json.loads(file.read(min(length, 100 << 20)))  # safetensors caps its header at 100 MB
                assert isinstance(header, dict)
            except (struct.error, ValueError, AssertionError):
                raise ConfigError(f"{self.path} is not a safetensors file (its header does not read as one)",
                                  fix="write start-up weights with write_weights or save_pretrained(safe_serialization=True)") from None
        self._metadata = header.pop("__metadata__", None) or {}
        self._entries, self._data = header, 8 + length

    def keys(self) -> list[str]:
        return list(self._entries)

    def metadata(self) -> dict[str, str]:
        return self._metadata

    def tensor(self, name: str) -> torch.Tensor:
        shape = self._entries[name]["shape"]
        return self.rows(name, 0, shape[0]) if shape else self._read(name, 0, 1).reshape(())

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of dim 0 (clamped as a slice is), read from the file alone."""
        shape = self._entries[name]["shape"]
        start, stop, _ = slice(start, stop).indices(shape[0])
        return self._read(name, start, stop, math.prod(shape[1:])).reshape(max(stop - start, 0), *shape[1:])

    def _read(self, name: str, start: int, stop: int, row: int = 1) -> torch.Tensor:
        entry = self._entries[name]
        dtype = self.DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ConfigError(f"{self.path}: tensor {name!r} is stored as {entry['dtype']}, which start-up weights "
                              f"cannot be read in (one of {', '.join(self.DTYPES)})",
                              fix="save the weights in float32, bfloat16 or float16")
        count = max(stop - start, 0) * row
        buffer = bytearray(count * dtype.itemsize)
        if count:
            with open(self.path, "rb") as file:
                file.seek(self._data + entry["data_offsets"][0] + start * row * dtype.itemsize)
                if file.readinto(buffer) != len(buffer):
                    raise ConfigError(f"{self.path} ends before the data of tensor {name!r}: a truncated safetensors file",
                                      fix="write the file again (an interrupted copy or download?)")
            return torch.frombuffer(buffer, dtype=dtype)
        return torch.empty(0, dtype=dtype)


class WeightSource:
    """Named tensors read on demand: from a safetensors file (`write_weights`), the safetensors files
    of a Hugging Face model directory (`of_model_dir`), or an in-memory state dict (a
    `RoleSpec(weights=...)` given directly). `rows(name, start, stop)` reads only those rows of dim 0."""

    def __init__(self, tensors: Mapping[str, torch.Tensor] | None, handle: Any, aliases: Mapping[str, str], where: str,
                 handles: Mapping[str, Any] | None = None):
        self._tensors, self.where = tensors, where
        # stored name -> the open file holding it (one file, or each shard of a model directory)
        self._handles = dict(handles) if handles is not None else (
            {name: handle for name in handle.keys()} if handle is not None else {})
        names = set(tensors) if tensors is not None else set(self._handles)
        self._aliases = {alias: stored for alias, stored in aliases.items() if stored in names}
        self.names = frozenset(names | set(self._aliases))

    @classmethod
    def of_model_dir(cls, directory: str | os.PathLike) -> WeightSource | None:
        """The weights of a Hugging Face model directory (`model.safetensors`, or the shards of a
        large model), read where they lie: an FSDP2 rank takes only its rows, with no copy written
        first. Tied weights the directory stores once (`tie_word_embeddings`: the LM head is the
        embedding) are read under both names. None when the directory holds no safetensors."""
        directory = Path(directory)
        files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
        if not files:
            return None
        handles = {}
        for file in files:
            handle = SafetensorsFile(file)
            handles.update({name: handle for name in handle.keys()})
        config_file = directory / "config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        # Only where the config says so: an untied head missing from the files must not read the embedding.
        tied = {"lm_head.weight": "model.embed_tokens.weight"} if config.get("tie_word_embeddings") else {}
        return cls(None, None, tied, str(directory), handles)

    @classmethod
    def of(cls, weights: str | os.PathLike | Mapping[str, torch.Tensor]) -> WeightSource:
        if isinstance(weights, Mapping):
            return cls(weights, None, {}, "the RoleSpec's weights")
        path = Path(weights)
        if not path.is_file():
            raise ConfigError(f"the start-up weights file {str(path)!r} (RoleSpec.weights_file) does not exist",
                              fix="write it with WorldSpec.of_executor(..., weights_dir=<run directory>), on a "
                                  "filesystem every worker reads (several nodes: a shared one)")
        handle = SafetensorsFile(path)
        return cls(None, handle, json.loads((handle.metadata() or {}).get(ALIASES, "{}")), str(path))

    def _stored(self, name: str) -> str:
        if name not in self.names:
            raise KeyError(f"{self.where} has no tensor {name!r}")
        return self._aliases.get(name, name)

    def tensor(self, name: str) -> torch.Tensor:
        stored = self._stored(name)
        return self._tensors[stored] if self._tensors is not None else self._handles[stored].tensor(stored)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        stored = self._stored(name)
        if self._tensors is not None:
            return self._tensors[stored][start:stop]
        return self._handles[stored].rows(stored, start, stop)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every name (aliases included) as a full tensor: what `load_state_dict(strict=True)` takes."""
        return {name: self.tensor(name) for name in sorted(self.names)}


class LoraStartSource:
    """A LoRA role's start-up weights when its source is the plain model (a model directory, a warm
    start's merged base): the frozen base read from `base` under the peft model's names
    (`...q_proj.base_layer.weight` is `...q_proj.weight` there; `names` maps one to the other) and
    the adapters drawn on the rank (`RoleSpec.build_lora_on_meta`), as full tensors. The same
    reading interface as `WeightSource`, so `fill_shards` takes only each shard's rows of both."""

    def __init__(self, base: WeightSource, names: Mapping[str, str], adapters: Mapping[str, torch.Tensor]):
        self.base, self.adapters, self.where = base, dict(adapters), f"{base.where} and the drawn adapters"
        self._plain = {name: plain for name, plain in names.items() if plain in base.names}
        self.names = frozenset(self._plain) | frozenset(self.adapters)

    @classmethod
    def of(cls, base: WeightSource, module: torch.nn.Module, adapters: Mapping[str, torch.Tensor]) -> LoraStartSource:
        from rlgraph.backends.lora import plain_name

        names = {name: plain_name(name) for name in module.state_dict(keep_vars=True) if plain_name(name) is not None}
        return cls(base, names, adapters)

    def tensor(self, name: str) -> torch.Tensor:
        return self.adapters[name] if name in self.adapters else self.base.tensor(self._plain_of(name))

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        if name in self.adapters:
            return self.adapters[name][start:stop]
        return self.base.rows(self._plain_of(name), start, stop)

    def _plain_of(self, name: str) -> str:
        if name not in self._plain:
            raise KeyError(f"{self.where} has no tensor {name!r}")
        return self._plain[name]


def holds_adapters(source: WeightSource) -> bool:
    """Whether `source` is a LoRA model's (peft names, adapters included) rather than a plain base."""
    return any(".lora_" in name for name in source.names)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside register their parameters on the meta device (no memory, no values)
    and keep their buffers real: rotary `inv_freq` and the like are computed at construction and
    are in no state dict, so they could not be filled in later."""
    register = torch.nn.Module.register_parameter

    def register_on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def missing_names(module: torch.nn.Module, source: WeightSource) -> list[str]:
    """The module's parameter and persistent-buffer names `source` lacks (none: it can fill the module)."""
    return sorted(set(module.state_dict(keep_vars=True)) - source.names)


def fill_shards(root: torch.nn.Module, module: torch.nn.Module, source: WeightSource, device: torch.device) -> None:
    """Allocate `root`'s meta parameters (FSDP2-sharded DTensors or plain) on `device` and copy into
    each one only its local rows from `source`, read by `module`'s names (`module` is `root`'s
    model, the names a state dict has). Buffers keep their values; persistent ones are read too."""
    allocate(root, device)
    with torch.no_grad():
        for name, tensor in module.state_dict(keep_vars=True).items():
            if name in source.names:
                _fill(tensor, name, source)


def allocate(root: torch.nn.Module, device: torch.device) -> None:
    """Give `root`'s meta parameters storage on `device`, uninitialised (what `fill_shards` fills, or
    a generation engine's first `sync_weights`); buffers keep their values and tied parameters stay tied."""
    buffers = [buffer.detach().clone() for buffer in root.buffers()]
    owners: dict[int, list[tuple[torch.nn.Module, str]]] = {}  # a tied parameter: every (module, name) holding it
    for owner in root.modules():
        for key, param in owner._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((owner, key))
    root.to_empty(device=device)  # new tensors for everything: buffers are copied back, ties restored
    for places in owners.values():
        first = places[0][0]._parameters[places[0][1]]
        for owner, key in places[1:]:
            owner._parameters[key] = first
    with torch.no_grad():
        for kept, fresh in zip(buffers, root.buffers(), strict=True):
            fresh.copy_(kept)


def _fill(tensor: torch.Tensor, name: str, source: WeightSource) -> None:
    """Copy `tensor`'s local part of `name`: a DTensor sharded on dim 0 reads only its rows."""
    if not isinstance(tensor, DTensor):
        tensor.copy_(source.tensor(name))
        return
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    # FSDP2 shards dim 0 only (the other dims are whole); a layout sharding another dim is not handled here.
    assert all(p.dim == 0 for p in tensor.placements if isinstance(p, Shard)), (name, tensor.placements)
    assert all(o == 0 for o in offset[1:]) and tuple(shape[1:]) == tuple(tensor.shape[1:]), (name, shape, offset)
    local = tensor.to_local()
    assert tuple(local.shape) == tuple(shape), (name, local.shape, shape)
    if local.numel():
        local.copy_(source.rows(name, offset[0], offset[0] + shape[0]))

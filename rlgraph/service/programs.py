"""The service's calls as rlgraph programs: each call runs as a compiled plan on its tenant's executor.

    forward            lp = logprobs(policy, data); the loss of lp           -> logprobs, elementwise_loss
    forward_backward   policy, lp = update(policy, data, loss, step=False, outputs=True)
                       (gradients added to the tenant's; no optimizer step)  -> logprobs, elementwise_loss
    optim_step         policy = optimizer_step(policy, lr=..., betas=..., ...)
    sample             ro = generate(policy, prompt, n=..., ...)             -> rollouts
    logprobs           lp = logprobs(policy, data)  (prompt log-probs, compute_logprobs)

A datum's loss inputs enter as the batch's metadata columns (`rg.column(data, "advantages")`),
its sampler log-probs as `data.logprobs`. `Plans` compiles each (call, settings) once and keeps
it; `run` executes a plan with the one plan runner (`PlanRunner`) over the tenant's executor and
returns the metrics and the values the program hands back (`outputs`). The plan's memory and FLOP
estimates are for the served model (its config) at the compiler's nominal sizes, but a sample
plan's, which are its call's (one prompt, `num_samples`, `max_tokens`): the program itself has
symbolic dims, so one plan serves every batch.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import rlgraph as rg
from rlgraph.plan.compiled import Compiled
from rlgraph.runtime.plan_runner import PlanRunner
from rlgraph.service.losses import tinker_loss

COLUMNS = ("weights", "advantages")  # per-token loss inputs carried as metadata columns of the batch


def _inputs(data: Any) -> tuple[Any, ...]:
    """The loss inputs of the datums: mask, weights, sampler log-probs, advantages (f32[N,T] but the mask)."""
    weights, adv = (rg.column(data, name) for name in COLUMNS)
    return data.mask, weights, data.logprobs, adv


@rg.algorithm
def forward(state: rg.State, data: rg.Rollouts, *, loss_fn="cross_entropy", loss_config=None):
    lp = rg.logprobs(state.policy, data)                            # f32[N,T]
    value, per_token = tinker_loss(lp, *_inputs(data), loss_fn=loss_fn, config=loss_config or {})  # f32[], f32[N,T]
    return state, {"loss:sum": value}, {"logprobs": lp, "elementwise_loss": per_token}


@rg.algorithm
def forward_backward(state: rg.State, data: rg.Rollouts, *, loss_fn="cross_entropy", loss_config=None):
    inputs = _inputs(data)

    def loss(lp):                                                   # lp: f32[N,T], with gradients
        return tinker_loss(lp, *inputs, loss_fn=loss_fn, config=loss_config or {})[0]

    # step=False: the gradients wait in the adapter for optim_step (Tinker's two calls).
    policy, lp = rg.update(state.policy, data, loss, grad_clip=None, step=False, outputs=True)
    # The reported loss, from the log-probs the update trained on.
    value, per_token = tinker_loss(lp, *inputs, loss_fn=loss_fn, config=loss_config or {})  # f32[], f32[N,T]
    return state.replace(policy=policy), {"loss:sum": value}, {"logprobs": lp, "elementwise_loss": per_token}


@rg.algorithm
def optim_step(state: rg.State, data: rg.Rollouts, *, learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-12,
               weight_decay=0.0, grad_clip_norm=0.0):
    policy = rg.optimizer_step(state.policy, lr=learning_rate, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay,
                               grad_clip=grad_clip_norm if grad_clip_norm > 0 else None)  # Tinker: 0 = no clipping
    return state.replace(policy=policy), {}


@rg.algorithm
def sample(state: rg.State, prompt: rg.Prompts, *, num_samples=1, temperature=1.0, top_p=1.0, max_tokens=16, stop=()):
    ro = rg.generate(state.policy, prompt, n=num_samples, temperature=temperature, top_p=top_p,
                     max_new_tokens=max_tokens, stop=stop)           # Rollouts[N,T] (Rollouts[B,T] for n=1)
    return state, {}, {"rollouts": ro}


@rg.algorithm
def logprobs(state: rg.State, data: rg.Rollouts):
    return state, {}, {"logprobs": rg.logprobs(state.policy, data)}  # f32[N,T]


CALLS = {"forward": forward, "forward_backward": forward_backward, "optim_step": optim_step, "sample": sample,
         "logprobs": logprobs}


class Plans:
    """The compiled plan of each (call, settings), compiled on first use; the `size` most recent kept."""

    def __init__(self, model: Mapping[str, Any] | None = None, size: int = 128, mesh: str = "cpu:1",
                 engine: str = "native"):
        self.mesh = mesh  # "cpu:2": the tenants live on 2 ranks (`rlgraph serve --runtime spmd --nproc 2`)
        self.engine = engine  # the sample plan's generation engine: "vllm" adds its sync_weights step
        self.models = {"policy": dict(model)} if model is not None else {}  # the served model's HF config
        self.size = size
        self._compiled: OrderedDict[tuple, Compiled] = OrderedDict()
        self._lock = threading.Lock()  # the scheduler's thread runs calls; HTTP handlers ask for plans

    def get(self, call: str, lora: Mapping[str, Any] | None = None, **settings: Any) -> Compiled:
        """The plan of `call` with `settings` (its hyper-parameters); `lora` ({"r", "target_modules"}):
        the trained adapter, so the plan's memory counts a LoRA tenant's state, not the whole model's."""
        key = (call, _frozen(lora), *sorted((name, _frozen(value)) for name, value in settings.items()))
        with self._lock:
            return self._get(key, call, lora, settings)

    def _get(self, key: tuple, call: str, lora: Mapping[str, Any] | None, settings: Mapping[str, Any]) -> Compiled:
        compiled = self._compiled.get(key)
        if compiled is None:
            sizes = ({"B": 1, "n": settings["num_samples"], "P": 8, "T": settings["max_tokens"]} if call == "sample"
                     else None)  # a sample call is one prompt
            # Every rank holds every tenant: no offload, and the executor checkpoints no activations.
            compiled = rg.compile(CALLS[call], mesh=self.mesh, placement=rg.colocated(offload=False, checkpointing=False),
                                  sizes=sizes, models=self.models, lora={"policy": dict(lora)} if lora else None,
                                  **self._engine_options(call), **settings)
            self._compiled[key] = compiled
            if len(self._compiled) > self.size:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(key)
        return compiled

    def _engine_options(self, call: str) -> dict[str, Any]:
        """A sample plan's engine; on vLLM, whose engine holds its own copy of the weights, the sampled
        policy counts as trained elsewhere (the tenants' calls), so the plan syncs it before generating."""
        if call != "sample":
            return {}
        return {"engine": "vllm", "trained": ("policy",)} if self.engine == "vllm" else {"engine": "native"}


def run(compiled: Compiled, executor: Any, batch: Any) -> tuple[dict[str, float], dict[str, Any]]:
    """Execute `compiled` on `executor` (a tenant's or a sampler's) with the one plan runner; returns
    (metrics, outputs). A runner per call: it asks the executor for the live versions afresh."""
    runner = PlanRunner(compiled, executor)
    _, metrics = runner.run(batch)
    return metrics, runner.outputs


def describe(plans: list[tuple[str, Compiled]]) -> list[dict[str, str]]:
    """Each plan a call runs as text: its traced program (like a jaxpr) and the placement plan."""
    return [{"name": name, "program": str(compiled.source), "plan": compiled.as_text()} for name, compiled in plans]


def as_text(plans: list[tuple[str, Compiled]]) -> str:
    return "\n\n".join(f"{item['program']}\n{item['plan']}" for item in describe(plans))


def _frozen(value: Any) -> Any:
    if isinstance(value, Mapping):
        return tuple(sorted((key, _frozen(item)) for key, item in value.items()))
    return tuple(value) if isinstance(value, list) else value

"""The primitives: the only ops with side effects on workers.

`generate`, `logprobs`, `values`, `score` and `update`. Each is declared once here with its
signature (checked at trace time), its spec rule and a one-line meaning; executors register how to
run them (`rlgraph.runtime`). Calling a primitive outside an `@rg.algorithm` is an error: they
only make sense as steps of a traced dataflow.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from typing import Any

import attrs
import torch.fx as fx

from rlgraph.ir import ops
from rlgraph.ir import specs as S
from rlgraph.ir.errors import SpecError, TraceError, user_location


@attrs.frozen
class Primitive:
    name: str
    signature: inspect.Signature
    spec_rule: Callable[..., S.Spec]
    doc: str


PRIMITIVES: dict[str, Primitive] = {}


def primitive_name(node: fx.Node) -> str | None:
    if node.op != "call_function":
        return None
    info = ops.op_info(node.target)
    return info.name if info is not None and info.name in PRIMITIVES else None


def _expect(spec: Any, kind: type, what: str, prim: str, position: str) -> None:
    if not isinstance(spec, kind):
        raise SpecError(f"rg.{prim}: {position} must be {what}, got {spec}", user_location())


def _bind(prim: Primitive, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    try:
        bound = prim.signature.bind(*args, **kwargs)
    except TypeError as exc:
        known = [p for p in prim.signature.parameters]
        bad = [k for k in kwargs if k not in known]
        hint = ""
        if bad:
            keywords = [k for k, p in prim.signature.parameters.items() if p.kind == p.KEYWORD_ONLY]
            if len(bad[0]) <= 2:  # one-letter typos have no character overlap to rank by
                keywords = [k for k in keywords if len(k) == len(bad[0])]
            close = difflib.get_close_matches(bad[0], keywords, n=1, cutoff=0.6 if len(bad[0]) > 2 else 0.0)
            hint = f"did you mean {close[0]!r}? " if close else ""
        raise TraceError(
            f"rg.{prim.name}{prim.signature}: {exc}", user_location(),
            fix=f"{hint}rg.{prim.name} takes {', '.join(known)}",
        ) from None
    bound.apply_defaults()
    return bound


def declare(spec_rule: Callable[..., S.Spec]):
    """Turn a signature-only function into a primitive recorded by the active tracer."""

    def wrap(template: Callable[..., Any]):
        prim = Primitive(template.__name__, inspect.signature(template), spec_rule, (template.__doc__ or "").strip())

        def primitive(*args: Any, **kwargs: Any) -> Any:
            if not ops.ACTIVE_TRACERS:
                raise TraceError(
                    f"rg.{prim.name} was called outside an algorithm", user_location(),
                    fix="call primitives inside a function decorated with @rg.algorithm, then run or compile it",
                )
            bound = _bind(prim, args, kwargs)
            positional = [v for k, v in bound.arguments.items() if prim.signature.parameters[k].kind != inspect.Parameter.KEYWORD_ONLY]
            keyword = {k: v for k, v in bound.arguments.items() if prim.signature.parameters[k].kind == inspect.Parameter.KEYWORD_ONLY}
            return ops.ACTIVE_TRACERS[-1].record_op(primitive, tuple(positional), keyword)

        primitive.__name__ = primitive.__qualname__ = prim.name
        primitive.__doc__ = template.__doc__
        primitive.__signature__ = prim.signature  # type: ignore[attr-defined]
        primitive.__rlgraph_op__ = ops.OpInfo(prim.name, template, spec_rule)  # type: ignore[attr-defined]
        PRIMITIVES[prim.name] = prim
        return primitive

    return wrap


# -- spec rules ---------------------------------------------------------------------------------


def _generate_spec(model, prompts, *, n, temperature, top_p, max_new_tokens) -> S.Spec:
    _expect(model, S.ModelSpec, "a language-model version such as state.policy", "generate", "the model")
    _expect(prompts, S.RecordSpec, "Prompts[B,P]", "generate", "the prompts")
    if prompts.kind != "Prompts":
        raise SpecError(f"rg.generate: the prompts must be Prompts[B,P], got {prompts}", user_location())
    if not isinstance(n, int) or n < 1:
        raise TraceError(f"rg.generate: n must be a positive int (samples per prompt), got {n!r}", user_location())
    if temperature < 0 or not 0 < top_p <= 1:
        raise TraceError(f"rg.generate: need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}", user_location())
    return S.ROLLOUTS


def _scored_batch(prim: str, model: Any, batch: Any, model_kind: str) -> None:
    _expect(model, S.ModelSpec, f"a model version (state.<role>)", prim, "the model")
    if model.kind != model_kind:
        raise SpecError(f"rg.{prim}: {model} is a {model.kind} model; rg.{prim} needs a {model_kind} model", user_location())
    _expect(batch, S.RecordSpec, "Rollouts[N,T]", prim, "the batch")
    if batch.kind != "Rollouts":
        raise SpecError(f"rg.{prim}: expects Rollouts[N,T], got {batch}", user_location(),
                        fix="generate rollouts first: ro = rg.generate(state.policy, prompts, n=...)")


def _logprobs_spec(model, rollouts, *, temperature, entropy) -> S.Spec:
    _scored_batch("logprobs", model, rollouts, "lm")
    token = S.f32(S.N, S.T)
    return S.TupleSpec((token, token)) if entropy else token


def _values_spec(model, rollouts) -> S.Spec:
    _scored_batch("values", model, rollouts, "critic")
    return S.f32(S.N, S.T)


def _score_spec(reward, rollouts) -> S.Spec:
    _expect(reward, S.RewardSpec, "a reward role such as state.reward", "score", "the reward")
    _expect(rollouts, S.RecordSpec, "Rollouts[N,T]", "score", "the rollouts")
    return S.f32(S.N)


def _update_spec(model, batch, *captures, stats=(), **config) -> S.Spec:
    _expect(model, S.ModelSpec, "a trainable model version (state.policy or state.critic)", "update", "the model")
    _expect(batch, S.RecordSpec, "Rollouts[N,T]", "update", "the batch")
    return S.TupleSpec((model.next(), S.StatsSpec(tuple(stats))))


# -- the primitives -----------------------------------------------------------------------------


@declare(_generate_spec)
def generate(model, prompts, *, n=1, temperature=1.0, top_p=1.0, max_new_tokens=None):
    """Sample `n` responses per prompt from `model`: Prompts[B,P] -> Rollouts[N=B*n, T]."""


@declare(_logprobs_spec)
def logprobs(model, rollouts, *, temperature=1.0, entropy=False):
    """Per-token log-probs f32[N,T] of the rollouts' responses under `model` (and entropy)."""


@declare(_values_spec)
def values(model, rollouts):
    """Per-token value estimates f32[N,T] from a critic."""


@declare(_score_spec)
def score(reward, rollouts):
    """Rewards f32[N] from a reward function or reward model."""


UPDATE_DEFAULTS = dict(epochs=1, minibatches=1, micro_batch_size=None, grad_clip=1.0, temperature=1.0, shuffle=False)


def update(model, batch, loss, *, epochs=1, minibatches=1, micro_batch_size=None, grad_clip=1.0,
           temperature=1.0, shuffle=False):
    """Train `model` on `batch` by minimising the traced `loss` closure; returns `model@v+1`.

    The closure receives the model's per-token output with gradients (log-probs f32[N,T] for a
    language model, values for a critic; a second parameter receives the entropy) and returns a
    scalar loss or `(loss, {metric: scalar})`. Values it uses from the algorithm are captured as
    inputs of the update; per-rollout ones ([N, ...]) are split with the micro-batches.
    """
    from rlgraph.ir.trace import trace_loss  # the loss is traced by a child tracer

    if not ops.ACTIVE_TRACERS:
        raise TraceError("rg.update was called outside an algorithm", user_location(),
                         fix="call primitives inside a function decorated with @rg.algorithm")
    config = dict(epochs=epochs, minibatches=minibatches, micro_batch_size=micro_batch_size,
                  grad_clip=grad_clip, temperature=temperature, shuffle=shuffle)
    return trace_loss(_update_primitive, model, batch, loss, config)


@declare(_update_spec)
def _update_primitive(model, batch, *captures, stats=(), epochs=1, minibatches=1, micro_batch_size=None,
                      grad_clip=1.0, temperature=1.0, shuffle=False):
    """(recorded form of rg.update: the loss closure lives in node.meta['program'])"""


PRIMITIVES["update"] = attrs.evolve(PRIMITIVES.pop("_update_primitive"), name="update", doc=update.__doc__.strip())
_update_primitive.__rlgraph_op__ = ops.OpInfo("update", _update_primitive.__rlgraph_op__.impl, _update_spec)
_update_primitive.__name__ = "update"

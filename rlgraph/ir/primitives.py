"""The primitives: the only ops with side effects on workers.

`generate`, `logprobs`, `values`, `score` and `update` run on workers; `filter_groups` runs on the
controller and is the one primitive with a loop (it re-runs its *refill region* on fresh prompts).
Each is declared once here with its signature (checked at trace time), its spec rule and a
one-line meaning; executors register how to run them (`rlgraph.runtime`). Calling a primitive
outside an `@rg.algorithm` is an error: they only make sense as steps of a traced dataflow.

Rows: `generate(..., n=1)` gives `Rollouts[B,T]` (one row per prompt), any other `n` gives
`Rollouts[N,T]`; the per-rollout results of `logprobs`, `values` and `score` have the rows of
their rollouts, so a per-prompt value mixed with a per-sample one fails at trace time.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from typing import Any

import attrs
import torch
import torch.fx as fx

from rlgraph.ir import ops
from rlgraph.ir import specs as S
from rlgraph.ir.number_checks import check_number
from rlgraph.errors import SpecError, TraceError, user_location


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


def declare(spec_rule: Callable[..., S.Spec], *, returns: int | None = None, quiet: tuple[str, ...] = ()):
    """Turn a signature-only function into a primitive recorded by the active tracer.

    `returns=k`: the user gets the first k outputs of a tuple-valued primitive; the rest (its
    statistics) stay in the program and become metrics. `quiet`: keywords left out of the node at
    their default, so that programs which do not use a later option print as they did.
    """

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
            keyword = {k: v for k, v in bound.arguments.items() if prim.signature.parameters[k].kind == inspect.Parameter.KEYWORD_ONLY
                       and not (k in quiet and v is prim.signature.parameters[k].default)}
            outputs = ops.ACTIVE_TRACERS[-1].record_op(primitive, tuple(positional), keyword)
            return outputs if returns is None else outputs[:returns]

        primitive.__name__ = primitive.__qualname__ = prim.name
        primitive.__doc__ = template.__doc__
        primitive.__signature__ = prim.signature  # type: ignore[attr-defined]
        primitive.__rlgraph_op__ = ops.OpInfo(prim.name, template, spec_rule)  # type: ignore[attr-defined]
        PRIMITIVES[prim.name] = prim
        return primitive

    return wrap


# -- spec rules ---------------------------------------------------------------------------------


def _generate_spec(model, prompts, *, n, temperature, top_p, max_new_tokens, stop, prim="generate") -> S.Spec:
    _expect(model, S.ModelSpec, "a language-model version such as state.policy", prim, "the model")
    _expect(prompts, S.RecordSpec, "Prompts[B,P]", prim, "the prompts")
    if prompts.kind != "Prompts":
        raise SpecError(f"rg.{prim}: the prompts must be Prompts[B,P], got {prompts}", user_location(),
                        fix="generate from the algorithm's prompts; rollouts already hold responses: score or "
                        "train on them directly (rg.score, rg.logprobs, rg.update)")
    if not isinstance(n, int) or n < 1:
        raise TraceError(f"rg.{prim}: n must be a positive int (samples per prompt), got {n!r}", user_location())
    length = "max_new_tokens" if prim == "generate" else "max_total_tokens"
    check_number(f"rg.{prim}", length, max_new_tokens, low=1, integer=True, optional=True,
                 why="the response length T; None uses the run's rollout.max_new_tokens")
    check_number(f"rg.{prim}", "temperature", temperature, low=0)  # "hot" from the CLI is refused here, named
    check_number(f"rg.{prim}", "top_p", top_p, low=0, low_open=True, high=1)
    if temperature < 0 or not 0 < top_p <= 1:
        raise TraceError(f"rg.{prim}: need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}", user_location())
    if not isinstance(stop, (tuple, list)) or not all(isinstance(item, str) and item for item in stop):
        raise TraceError(f"rg.generate: stop must be a tuple (or list) of non-empty strings, got {stop!r}", user_location(),
                         fix="e.g. stop=('\\n\\n',); a response ends after the first of them")
    return rollouts_spec(S.B if n == 1 else S.N)


# Columns of the per-episode statistics f32[N, E] that `rollout` returns beside its rollouts.
EPISODE_FIELDS = ("reward", "turns", "tool_calls", "tool_errors", "tool_truncated", "observation_tokens",
                  "env_seconds", "budget_cut", "env_errors")
MAX_TURNS = 1000  # a cap past this is a mistake (each turn is a decode and an env call per row), not a budget
GENERATORS = ("generate", "rollout")  # primitives that sample from a model: generation phase, weight sync first


def _rollout_spec(model, env, prompts, *, n, temperature, top_p, max_turns, max_tokens_per_turn, max_total_tokens,
                  step_timeout) -> S.Spec:
    _expect(model, S.ModelSpec, "a language-model version such as state.policy", "rollout", "the model")
    _expect(env, S.EnvSpec, "an environment role such as state.env", "rollout", "the environment")
    rows = _generate_spec(model, prompts, n=n, temperature=temperature, top_p=top_p,
                          max_new_tokens=max_total_tokens, stop=(), prim="rollout").rows
    check_number("rg.rollout", "max_turns", max_turns, low=1, high=MAX_TURNS, integer=True,
                 why="a turn is one policy answer and one environment step per row")
    check_number("rg.rollout", "max_tokens_per_turn", max_tokens_per_turn, low=1, integer=True, optional=True,
                 why="None: a turn may use what is left of max_total_tokens")
    check_number("rg.rollout", "step_timeout", step_timeout, low=0, low_open=True, optional=True,
                 why="seconds one environment step may take; None lifts the limit (a hung env then hangs the run)")
    if max_tokens_per_turn is not None and max_total_tokens is not None and max_tokens_per_turn > max_total_tokens:
        raise TraceError(f"rg.rollout: max_tokens_per_turn={max_tokens_per_turn} is more than max_total_tokens="
                         f"{max_total_tokens}, the whole response of all turns", user_location(),
                         fix="lower max_tokens_per_turn, or raise max_total_tokens")
    return S.TupleSpec((rollouts_spec(rows), S.f32(rows, len(EPISODE_FIELDS)), S.f32(rows, S.T)))


def rollouts_spec(rows: S.Dim) -> S.RecordSpec:
    """`Rollouts[rows,T]`: the fields of `S.ROLLOUTS` with `rows` as their first dim."""
    fields = tuple((name, attrs.evolve(spec, shape=(rows, *spec.shape[1:]))) for name, spec in S.ROLLOUTS.fields)
    return S.RecordSpec("Rollouts", fields, rows)


def _scored_batch(prim: str, model: Any, batch: Any, model_kind: str) -> None:
    _expect(model, S.ModelSpec, "a model version (state.<role>)", prim, "the model")
    if model.kind != model_kind:
        raise SpecError(f"rg.{prim}: {model} is a {model.kind} model; rg.{prim} needs a {model_kind} model", user_location())
    expect_rollouts(prim, batch, "the batch")


def expect_rollouts(prim: str, batch: Any, position: str) -> None:
    """`batch` must be the spec of Rollouts: Prompts have no responses to score, read or train on."""
    _expect(batch, S.RecordSpec, "Rollouts[N,T]", prim, position)
    if batch.kind != "Rollouts":
        raise SpecError(f"rg.{prim}: {position} must be Rollouts[N,T] (sampled responses), got {batch}",
                        user_location(), fix=f"generate rollouts first and pass them: ro = rg.generate(state.policy, "
                        f"prompts, n=...), then rg.{prim}(..., ro, ...)")


def _logprobs_spec(model, rollouts, *, temperature, entropy, vocab=False, micro_batch_tokens=None) -> S.Spec:
    # micro_batch_tokens: set by `rg.compile(micro_batch_tokens=)` (the `pack` pass), not by the user
    _scored_batch("logprobs", model, rollouts, "lm")
    if vocab:
        _check_vocab("rg.logprobs", vocab, entropy=entropy, micro_batch_tokens=micro_batch_tokens)
        return S.f32(rollouts.rows, S.T, S.V)
    token = S.f32(rollouts.rows, S.T)
    return S.TupleSpec((token, token)) if entropy else token


def _check_vocab(prim: str, vocab: Any, **exclusive: Any) -> None:
    """`vocab=True` (a distribution over the vocabulary per token) excludes the per-token extras."""
    if not isinstance(vocab, bool):
        raise TraceError(f"{prim}(vocab={vocab!r}): vocab must be True or False", user_location())
    for name, value in exclusive.items():
        if value not in (None, False):
            raise TraceError(f"{prim}(vocab=True, {name}={value!r}): the vocabulary's log-probs f32[N,T,V] come "
                             f"without {name}", user_location(),
                             fix=f"drop {name}, or vocab=False")


def _values_spec(model, rollouts, *, micro_batch_tokens=None) -> S.Spec:
    _scored_batch("values", model, rollouts, "critic")
    return S.f32(rollouts.rows, S.T)


def _score_spec(reward, rollouts) -> S.Spec:
    _expect(reward, S.RewardSpec, "a reward role such as state.reward", "score", "the reward")
    expect_rollouts("score", rollouts, "the rollouts")
    return S.f32(rollouts.rows)


def _update_spec(model, batch, *captures, stats=(), outputs=False, **config) -> S.Spec:
    _expect(model, S.ModelSpec, "a trainable model version (state.policy or state.critic)", "update", "the model")
    expect_rollouts("update", batch, "the batch")
    if outputs:  # the model's per-token outputs of the training forward, beside the new version
        return S.TupleSpec((model.next(), S.f32(batch.rows, S.T), S.StatsSpec(tuple(stats))))
    return S.TupleSpec((model.next(), S.StatsSpec(tuple(stats))))


FILTER_STATS = ("rounds", "kept_groups", "filled_groups")


MAX_REFILL_ROUNDS = 1000  # rounds of one filter_groups; more is a mistake, not a budget


def _filter_groups_spec(rollouts, rewards, keep, *, max_rounds) -> S.Spec:
    _expect(rollouts, S.RecordSpec, "Rollouts[N,T]", "filter_groups", "the rollouts")
    if rollouts.kind != "Rollouts":
        raise SpecError(f"rg.filter_groups: expects Rollouts[N,T] first, got {rollouts}", user_location())
    rows = rollouts.rows
    for what, spec, ok, example in (
        ("the rewards", rewards, lambda d: d.is_floating_point, "r = rg.score(state.reward, ro)"),
        ("keep", keep, lambda d: d == torch.bool, "keep = F.group_has_variance(r, ro.group)"),
    ):
        if not (isinstance(spec, S.TensorSpec) and spec.shape == (rows,) and ok(spec.dtype)):
            kind = "bool" if what == "keep" else "float"
            raise SpecError(f"rg.filter_groups: {what} must be a {kind} tensor [{rows}], one per rollout, got {spec}",
                            user_location(), fix=example)
    check_number("rg.filter_groups", "max_rounds", max_rounds, low=1, high=MAX_REFILL_ROUNDS, integer=True,
                 why="each round generates a whole batch; a huge cap is a run that never ends when no group is kept")
    return S.TupleSpec((rollouts, rewards, S.StatsSpec(FILTER_STATS)))


# -- the primitives -----------------------------------------------------------------------------


@declare(_generate_spec)
def generate(model, prompts, *, n=1, temperature=1.0, top_p=1.0, max_new_tokens=None, stop=()):
    """Sample `n` responses per prompt from `model`: Prompts[B,P] -> Rollouts[N=B*n, T]; a response
    ends at EOS, after `max_new_tokens`, or after the first of the `stop` strings (kept, tuple)."""


@declare(_rollout_spec)
def rollout(model, env, prompts, *, n=1, temperature=1.0, top_p=1.0, max_turns=4, max_tokens_per_turn=None,
            max_total_tokens=None, step_timeout=30.0):
    """Multi-turn episodes with environment `env` (state.env): `n` per prompt, each up to `max_turns`
    policy turns of at most `max_tokens_per_turn` tokens, all turns and observations within
    `max_total_tokens` (the response length T; None: the run's rollout.max_new_tokens).

    Returns `(Rollouts[N,T], episodes f32[N,E], turn_rewards f32[N,T])`: the response holds every
    turn, `mask` marks only the policy's tokens (observations are context: `context_mask`);
    `episodes[:, k]` is the statistic `EPISODE_FIELDS[k]` (column 0: the env's reward, summed over
    turns); `turn_rewards` holds each turn's reward at that turn's last policy token."""


@declare(_logprobs_spec, quiet=("vocab",))
def logprobs(model, rollouts, *, temperature=1.0, entropy=False, vocab=False):
    """Per-token log-probs f32[N,T] of the rollouts' responses under `model` (and entropy).

    `vocab=True`: the log-softmax over the whole vocabulary at every response position instead,
    f32[N,T,V] (0 at padding): 4*N*T*V bytes, which the plan counts where the value moves."""


@declare(_values_spec)
def values(model, rollouts):
    """Per-token value estimates f32[N,T] from a critic."""


@declare(_score_spec)
def score(reward, rollouts):
    """Rewards f32[N] from a reward function or reward model."""


NONFINITE_POLICIES = ("raise", "skip")


def update(model, batch, loss, *, epochs=1, minibatches=1, micro_batch_size=None, grad_clip=1.0,
           temperature=1.0, shuffle=False, on_nonfinite="raise", step=True, outputs=False, micro_batch_tokens=None,
           vocab=False):
    """Train `model` on `batch` by minimising the traced `loss` closure; returns `model@v+1`.

    The closure receives the model's per-token output with gradients (log-probs f32[N,T] for a
    language model, values for a critic; a second parameter receives the entropy) and returns a
    scalar loss or `(loss, {metric: scalar})`. Values it uses from the algorithm are captured as
    inputs of the update; per-rollout ones ([N, ...]) are split with the micro-batches.

    A mini-batch whose gradient norm is NaN or inf never reaches the weights: `on_nonfinite="raise"`
    stops the run naming the update, the mini-batch and the rows; `"skip"` drops that mini-batch's
    step and counts it (`<role>/skipped_steps`).

    `step=False` only accumulates: the loss's gradients are added to the ones the model holds, no
    optimizer step is taken and none are cleared (`rg.optimizer_step` applies them later; Tinker's
    forward_backward). It needs `grad_clip=None` (clip when stepping) and `on_nonfinite="raise"`;
    a NaN or inf gradient norm raises and leaves the gradients as that call made them (a caller
    that goes on restores the ones it had: the service does).
    `outputs=True` also returns the training forward's per-token outputs, detached:
    `policy, lp = rg.update(..., outputs=True)` (f32[N,T], the last epoch's for each row).
    `micro_batch_tokens=k` packs the rows into micro-batches of at most k real tokens, run without
    padding (position ids restart in each row, attention stays within it); the loss, gradients
    and statistics are those of the padded micro-batches. Exclusive with `micro_batch_size`.
    `vocab=True`: the closure's one parameter is the model's log-softmax over the whole vocabulary,
    f32[N,T,V] with gradients (a full-distribution divergence, GKD's), not the sampled tokens' log-probs.
    """
    from rlgraph.ir.entrypoints import trace_loss  # the loss is traced by a child tracer

    if not ops.ACTIVE_TRACERS:
        raise TraceError("rg.update was called outside an algorithm", user_location(),
                         fix="call primitives inside a function decorated with @rg.algorithm")
    if on_nonfinite not in NONFINITE_POLICIES:
        raise TraceError(f"rg.update(on_nonfinite={on_nonfinite!r}) is not a policy", user_location(),
                         fix=f"use one of {', '.join(map(repr, NONFINITE_POLICIES))}")
    _check_update_config(epochs, minibatches, micro_batch_size, grad_clip, temperature)
    _check_micro_batch_tokens(micro_batch_tokens, micro_batch_size)
    _check_accumulation(step, outputs, grad_clip, on_nonfinite)
    expect_rollouts("update", getattr(batch, "spec", type(batch).__name__), "the batch")  # before the loss closure is traced
    config = dict(epochs=epochs, minibatches=minibatches, micro_batch_size=micro_batch_size,
                  grad_clip=grad_clip, temperature=temperature, shuffle=shuffle, on_nonfinite=on_nonfinite)
    if not step or outputs:  # only when asked, so the programs (and printed plans) of every other update are as before
        config.update(step=step, outputs=outputs)
    if micro_batch_tokens is not None:
        config.update(micro_batch_tokens=micro_batch_tokens)
    if vocab:
        _check_vocab("rg.update", vocab, outputs=outputs, micro_batch_tokens=micro_batch_tokens)
        config.update(vocab=True)
    return trace_loss(_update_primitive, model, batch, loss, config)


def _check_update_config(epochs: Any, minibatches: Any, micro_batch_size: Any, grad_clip: Any, temperature: Any) -> None:
    """Refuse settings that would silently train wrongly: grad_clip <= 0 scales every step by a
    negative or zero factor (gradient ascent or no step), 0 epochs or micro-batches of 0 rows do nothing."""
    check_number("rg.update", "epochs", epochs, low=1, integer=True)
    check_number("rg.update", "minibatches", minibatches, low=1, integer=True)
    check_number("rg.update", "micro_batch_size", micro_batch_size, low=1, integer=True, optional=True)
    check_number("rg.update", "grad_clip", grad_clip, low=0, low_open=True, optional=True,
                 why="a negative clip turns the step into gradient ascent; None turns clipping off")
    check_number("rg.update", "temperature", temperature, low=0, low_open=True)


def _check_micro_batch_tokens(micro_batch_tokens: Any, micro_batch_size: Any) -> None:
    """A token budget is a whole number >= 1, and it replaces the row count: not both."""
    check_number("rg.update", "micro_batch_tokens", micro_batch_tokens, low=1, integer=True, optional=True,
                 why="the most real tokens (prompt + response) one packed micro-batch holds")
    if micro_batch_tokens is not None and micro_batch_size is not None:
        raise TraceError(f"rg.update(micro_batch_size={micro_batch_size}, micro_batch_tokens={micro_batch_tokens}): both "
                         "size the micro-batches", user_location(),
                         fix="give micro_batch_tokens (packed, by tokens) or micro_batch_size (padded, by rows)")


def _check_accumulation(step: Any, outputs: Any, grad_clip: Any, on_nonfinite: str) -> None:
    """`step=False` leaves the gradients to a later `optimizer_step`: clipping a part of them, or
    skipping a part by dropping them all, would change what that step applies."""
    for name, value in (("step", step), ("outputs", outputs)):
        if not isinstance(value, bool):
            raise TraceError(f"rg.update({name}={value!r}): {name} must be True or False", user_location())
    if not step and grad_clip is not None:
        raise TraceError(f"rg.update(step=False, grad_clip={grad_clip}): an accumulating update cannot clip a part of "
                         "the gradients it leaves", user_location(),
                         fix="grad_clip=None here, and clip in rg.optimizer_step(model, grad_clip=...)")
    if not step and on_nonfinite != "raise":
        raise TraceError(f"rg.update(step=False, on_nonfinite={on_nonfinite!r}): an accumulating update has no step "
                         "to skip; a non-finite gradient raises", user_location(), fix="on_nonfinite='raise'")


@declare(_update_spec)
def _update_primitive(model, batch, *captures, stats=(), epochs=1, minibatches=1, micro_batch_size=None,
                      grad_clip=1.0, temperature=1.0, shuffle=False, on_nonfinite="raise", step=True, outputs=False,
                      micro_batch_tokens=None, vocab=False):
    """(recorded form of rg.update: the loss closure lives in node.meta['program'])"""


PRIMITIVES["update"] = attrs.evolve(PRIMITIVES.pop("_update_primitive"), name="update", doc=update.__doc__.strip())
_update_primitive.__rlgraph_op__ = ops.OpInfo("update", _update_primitive.__rlgraph_op__.impl, _update_spec)
_update_primitive.__name__ = "update"


OPTIMIZER_STATS = ("grad_norm",)


def _optimizer_step_spec(model, *, lr, betas, eps, weight_decay, grad_clip) -> S.Spec:
    _expect(model, S.ModelSpec, "a trainable model version (state.policy or state.critic)", "optimizer_step",
            "the model")
    check_number("rg.optimizer_step", "lr", lr, low=0, optional=True)
    check_number("rg.optimizer_step", "eps", eps, low=0, low_open=True, optional=True)
    check_number("rg.optimizer_step", "weight_decay", weight_decay, low=0, optional=True)
    check_number("rg.optimizer_step", "grad_clip", grad_clip, low=0, low_open=True, optional=True,
                 why="None measures the norm without clipping")
    if betas is not None and not (isinstance(betas, tuple) and len(betas) == 2
                                  and all(isinstance(b, float) and 0 <= b < 1 for b in betas)):
        raise TraceError(f"rg.optimizer_step: betas must be a pair of floats in [0, 1), got {betas!r}", user_location(),
                         fix="betas=(0.9, 0.95)")
    return S.TupleSpec((model.next(), S.StatsSpec(OPTIMIZER_STATS)))


@declare(_optimizer_step_spec)
def _optimizer_step_primitive(model, *, lr=None, betas=None, eps=None, weight_decay=None, grad_clip=None):
    """(recorded form of rg.optimizer_step)"""


def optimizer_step(model, *, lr=None, betas=None, eps=None, weight_decay=None, grad_clip=None):
    """Apply the gradients `model` holds (accumulated by `rg.update(..., step=False)`) with its
    optimizer, then clear them; returns `model@v+1`. Each setting given replaces the optimizer's
    own for this and later steps (None keeps it); `grad_clip` clips to that global norm (None:
    measured only). A NaN or inf gradient norm changes no weight: the gradients are dropped and
    the step raises. Its statistic `grad_norm` becomes the metric `<role>/grad_norm`."""
    new_model, _stats = _optimizer_step_primitive(model, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                                  grad_clip=grad_clip)
    return new_model


PRIMITIVES["optimizer_step"] = attrs.evolve(PRIMITIVES.pop("_optimizer_step_primitive"), name="optimizer_step",
                                            doc=optimizer_step.__doc__.strip())
_optimizer_step_primitive.__rlgraph_op__ = ops.OpInfo("optimizer_step", _optimizer_step_primitive.__rlgraph_op__.impl,
                                                      _optimizer_step_spec)
_optimizer_step_primitive.__name__ = "optimizer_step"


@declare(_filter_groups_spec, returns=2)
def filter_groups(rollouts, rewards, keep, *, max_rounds=4):
    """Keep the groups whose `keep` is True and refill the batch to B groups from fresh prompts.

    `keep` is bool[N], constant within a group (e.g. `F.group_has_variance(r, ro.group)`). The
    *refill region* (every step before this one that depends on the prompts: generate, score,
    keep's math) re-runs on a fresh batch of prompts until B groups are kept or `max_rounds`
    rounds have run; then the first B kept groups are returned, topped up with dropped groups
    when short. Same specs out as in: `(Rollouts[N,T], f32[N])`, groups renumbered 0..B-1. Its
    statistics (`filter/rounds`, `filter/kept_groups`, `filter/filled_groups`) become metrics.
    """


# -- the refill loop of filter_groups ---------------------------------------------------------


@attrs.frozen
class RefillLoop:
    """What `filter_groups` re-runs on fresh prompts, by node name.

    `nodes`: the filter's ancestors that depend on the prompts input `prompts`, in program order
    (generate, score, keep's math; in a lowered program also the transfers between them). Nodes
    that do not depend on the prompts (model versions, weight syncs, constants) run once.
    """

    filter: str
    prompts: str
    nodes: tuple[str, ...]
    max_rounds: int


def ancestors(node: fx.Node) -> set[fx.Node]:
    """Every node `node` depends on, directly or not (itself excluded)."""
    found: set[fx.Node] = set()
    stack = list(node.all_input_nodes)
    while stack:
        current = stack.pop()
        if current not in found:
            found.add(current)
            stack.extend(current.all_input_nodes)
    return found


def refill_region(filter_node: fx.Node) -> list[fx.Node]:
    """The refill region of a `filter_groups` node, in program order (see `RefillLoop`)."""
    upstream = ancestors(filter_node)
    on_prompts: set[fx.Node] = set()
    for node in filter_node.graph.nodes:
        if node is filter_node:
            break
        if _is_prompts(node) or any(arg in on_prompts for arg in node.all_input_nodes):
            on_prompts.add(node)
    return [node for node in filter_node.graph.nodes if node in upstream and node in on_prompts and node.op != "placeholder"]


def refill_loops(graph: fx.Graph) -> tuple[RefillLoop, ...]:
    """One `RefillLoop` per `filter_groups` node of `graph`, in program order."""
    prompts = next((node.name for node in graph.nodes if _is_prompts(node)), "")
    return tuple(
        RefillLoop(node.name, prompts, tuple(n.name for n in refill_region(node)), node.kwargs["max_rounds"])
        for node in graph.nodes if primitive_name(node) == "filter_groups"
    )


def _is_prompts(node: fx.Node) -> bool:
    spec = node.meta.get("spec")
    return node.op == "placeholder" and isinstance(spec, S.RecordSpec) and spec.kind == "Prompts"

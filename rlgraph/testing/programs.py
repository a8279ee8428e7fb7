"""Random well-typed algorithms: a strategy that writes an `@rg.algorithm` as source and traces it.

Each draw picks a sampler (n), optional dynamic sampling (`rg.filter_groups`), an advantage estimator (a group estimator, a greedy-rollout baseline as ReMax, token-level REINFORCE++ returns, or a critic with GAE), where
the old log-probs come from, a policy loss and its aggregation, an optional KL penalty against a
reference model, an optional entropy bonus, micro-batching and epochs, and renders a function of
the same shape as the library's own algorithms. The draw's `repr` is that source, so a failing
property prints a program you can paste and run.

    @given(rgt.algorithms())
    def test_every_program_compiles(generated):
        rgt.assert_plan_invariants(rg.compile(generated.algorithm, mesh="gpu:8", roles=generated.roles, **generated.hparams))
"""

from __future__ import annotations

import itertools
import linecache
from typing import Any

import attrs
from hypothesis import strategies as st

from rlgraph.ir import specs as S

GROUP_ESTIMATORS = (
    "F.group_normalize(r, ro.group)",
    "F.group_normalize(r, ro.group, scale=False)",
    "F.rloo(r, ro.group)",
    "F.gpg(r, ro.group)",
    "F.reinforce_pp_baseline(r, ro.group, ro.mask)",
    "F.opo(r, ro.group, ro.mask)",
    "r - r.mean()",
)
# Advantages that need more than (r, ro): each is (setup lines, a token-level [N, T] advantage).
OTHER_ADVANTAGES = {
    "greedy_baseline": (  # ReMax: a second, greedy generation per prompt is the baseline
        ["greedy = rg.generate(state.policy, prompts, n=1, temperature=0.0, max_new_tokens=max_new_tokens)",
         "greedy_r = rg.score(state.reward, greedy)"],
        "F.remax(r, greedy_r[ro.group])[:, None]"),
    "reinforce_pp": (  # token-level returns whitened over the batch
        [], "F.reinforce_pp(F.rewards_at_last_token(r, ro.mask), ro.mask, gamma=0.99)"),
}
POLICY_LOSSES = ("ppo_clip", "gspo", "cispo", "gpg_loss")
AGGREGATIONS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm")
KL_ESTIMATORS = ("kl_k1", "kl_k2", "kl_k3", "kl_abs")
_COUNTER = itertools.count()


@attrs.frozen(repr=False)
class GeneratedAlgorithm:
    """A drawn algorithm: its source, the traced `rg.algorithm`, the roles it needs, its hparams."""

    source: str
    algorithm: Any
    roles: dict[str, S.Spec]
    hparams: dict[str, Any]

    @property
    def model_roles(self) -> tuple[str, ...]:
        """Roles holding a model, e.g. ("policy", "ref"), for `tiny_executor`."""
        return tuple(role for role, spec in self.roles.items() if isinstance(spec, S.ModelSpec))

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # hypothesis prints draws with this
        printer.text(repr(self))

    def __repr__(self) -> str:
        return f"{self.source}\n# hparams: {self.hparams!r}"


def render(*, n: int, estimator: str | None, critic: bool, recompute_old: bool, loss: str, agg: str,
           kl: str | None, kl_coef: float, entropy_coef: float, dynamic_sampling: bool = False) -> str:
    """The source of one algorithm; `estimator` is ignored when `critic` is set (GAE is used)."""
    lines = [
        "@rg.algorithm",
        f"def generated(state: rg.State, prompts: rg.Prompts, *, n={n}, max_new_tokens=4, micro_batch_size=None, epochs=1):",
        "    ro = rg.generate(state.policy, prompts, n=n, max_new_tokens=max_new_tokens)",
        "    r = rg.score(state.reward, ro)",
    ]
    if dynamic_sampling:
        lines.append("    ro, r = rg.filter_groups(ro, r, F.group_has_variance(r, ro.group), max_rounds=2)")
    if critic:
        lines += ["    values = rg.values(state.critic, ro)",
                  "    adv, returns = F.gae(F.rewards_at_last_token(r, ro.mask), values, ro.mask, gamma=1.0, lam=0.95)"]
    elif estimator in OTHER_ADVANTAGES:
        setup, advantage = OTHER_ADVANTAGES[estimator]
        lines += [f"    {line}" for line in setup] + [f"    adv = {advantage}"]
    else:
        lines.append(f"    adv = ({estimator})[:, None]")
    lines.append("    old = rg.logprobs(state.policy, ro)" if recompute_old else "    old = ro.logprobs")
    if kl:
        lines.append("    ref = rg.logprobs(state.ref, ro)")
    params = "lp, entropy" if entropy_coef else "lp"
    lines += ["", f"    def loss({params}):",
              f"        value, clip_frac, approx_kl = F.{loss}(lp, old, adv, ro.mask, agg=F.{agg})"]
    if kl:
        lines.append(f"        value = value + {kl_coef} * F.token_mean(F.{kl}(lp, ref), ro.mask)")
    if entropy_coef:
        lines.append(f"        value = value - {entropy_coef} * F.entropy_bonus(entropy, ro.mask)")
    lines += ['        return value, {"clip_frac": clip_frac, "approx_kl": approx_kl}', "",
              "    policy = rg.update(state.policy, ro, loss, epochs=epochs, micro_batch_size=micro_batch_size)"]
    if critic:
        lines += ["", "    def critic_loss(v):",
                  "        value, clip_frac = F.value_loss(v, values, returns, ro.mask)",
                  '        return value, {"clip_frac": clip_frac}', "",
                  "    critic = rg.update(state.critic, ro, critic_loss, epochs=epochs, micro_batch_size=micro_batch_size)",
                  '    return state.replace(policy=policy, critic=critic), {"reward": r.mean()}']
    else:
        lines.append('    return state.replace(policy=policy), {"reward": r.mean()}')
    return "\n".join(lines) + "\n"


def build(source: str) -> Any:
    """Execute generated source and return its `generated` algorithm (source kept for tracebacks)."""
    import rlgraph as rg
    from rlgraph import functional as F

    filename = f"<rlgraph.testing generated {next(_COUNTER)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    namespace: dict[str, Any] = {"rg": rg, "F": F}
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - our own generated source
    return namespace["generated"]


@st.composite
def algorithms(draw, *, critic: bool | None = None, kl: bool | None = None,
               dynamic_sampling: bool | None = None) -> GeneratedAlgorithm:
    """Random well-typed algorithms over the primitives (`critic`, `kl`, `dynamic_sampling` force
    those parts on or off; dynamic sampling is `rg.filter_groups` with 2 rounds, which needs a
    prompt source to run)."""
    with_critic = draw(st.booleans()) if critic is None else critic
    with_kl = draw(st.booleans()) if kl is None else kl
    options = dict(
        n=draw(st.sampled_from([1, 2, 4])),
        estimator=None if with_critic else draw(st.sampled_from(GROUP_ESTIMATORS + tuple(OTHER_ADVANTAGES))),
        critic=with_critic,
        recompute_old=draw(st.booleans()),
        loss=draw(st.sampled_from(POLICY_LOSSES)),
        agg=draw(st.sampled_from(AGGREGATIONS)),
        kl=draw(st.sampled_from(KL_ESTIMATORS)) if with_kl else None,
        kl_coef=0.01,
        entropy_coef=draw(st.sampled_from([0.0, 0.001])),
        dynamic_sampling=draw(st.booleans()) if dynamic_sampling is None else dynamic_sampling,
    )
    if options["estimator"] == "greedy_baseline":  # its second generation reads the batch, which a refill replaces
        options["dynamic_sampling"] = False
    source = render(**options)
    roles: dict[str, S.Spec] = {"policy": S.ModelSpec("policy"), "reward": S.RewardSpec("reward")}
    if with_kl:
        roles["ref"] = S.ModelSpec("ref")
    if with_critic:
        roles["critic"] = S.ModelSpec("critic", kind="critic")
    hparams = {"micro_batch_size": draw(st.sampled_from([None, 1, 3])), "epochs": draw(st.integers(1, 2))}
    return GeneratedAlgorithm(source, build(source), roles, hparams)

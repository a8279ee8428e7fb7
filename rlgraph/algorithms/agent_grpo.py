"""Agent GRPO: GRPO on multi-turn episodes with an environment (`rg.rollout`, docs/agents.md).

    ro, episodes, _ = rg.rollout(policy, env, prompts, n, max_turns, ...)   # every turn in one response
    r   = episodes[:, "reward"]                                          # the env's reward, summed over turns
    A_i = (r_i - mean(r_group)) / (std(r_group) + eps)
    L   = token_mean( -min(rho * A, clip(rho, 1-eps, 1+eps) * A) + beta * KL_k3(pi || pi_ref) )  over ro.mask

The loss and the KL run over `ro.mask`, the policy's tokens only: an observation is context for
the turns after it, never a target. Estimator and loss are chosen by name as in `grpo`.

Metrics: those of `grpo` (reward, response_length/* count the policy's tokens), and per step
env/turns, env/tool_calls, env/tool_errors, env/observation_tokens (means per episode),
env/budget_cut (fraction of episodes ended by a token or turn budget), env/env_errors (fraction
ended by a step past its timeout or a dead environment worker, `env_workers`), and time/env_s_per_step
(wall-clock seconds of one environment step, averaged over the step's env calls).
"""

from torch import Tensor

import rlgraph as rg
from rlgraph import functional as F
from rlgraph.algorithms.hparams import check_hparams
from rlgraph.algorithms.metrics import loss_metrics, rollout_metrics
from rlgraph.ir.ops import traceable
from rlgraph.ir.primitives import EPISODE_FIELDS

_COLUMN = {name: index for index, name in enumerate(EPISODE_FIELDS)}


@traceable
def episode_stats(episodes: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Per-step means over episodes f32[N, E] (columns `EPISODE_FIELDS`): turns, tool calls, tool errors,
    observation tokens, the fraction cut by a budget, the fraction ended by an env worker's failure,
    and environment seconds per env step."""
    mean = episodes.mean(dim=0)  # [E]
    steps = episodes[:, _COLUMN["turns"]].sum().clamp(min=1.0)  # []
    seconds = episodes[:, _COLUMN["env_seconds"]].sum() / steps  # []
    return (mean[_COLUMN["turns"]], mean[_COLUMN["tool_calls"]], mean[_COLUMN["tool_errors"]],
            mean[_COLUMN["observation_tokens"]], mean[_COLUMN["budget_cut"]], mean[_COLUMN["env_errors"]], seconds)


def episode_metrics(episodes) -> dict:
    """The `env/...` metrics of a step from a rollout's episode statistics (module docstring)."""
    names = ("env/turns", "env/tool_calls", "env/tool_errors", "env/observation_tokens", "env/budget_cut",
             "env/env_errors", "time/env_s_per_step")  # time/: wall-clock, which comparisons of two runs skip
    return dict(zip(names, episode_stats(episodes)))


@rg.algorithm
def agent_grpo(state: rg.State, prompts: rg.Prompts, *, n=8, max_turns=4, max_tokens_per_turn=None,
               max_total_tokens=None, step_timeout=30.0, estimator="group_normalize", loss="ppo_clip", clip=0.2,
               kl=0.0, temperature=1.0, top_p=1.0, epochs=1, micro_batch_size=None):
    check_hparams("agent_grpo", group_estimator=estimator, n=n, clip=clip, kl=kl, epochs=epochs,
                  micro_batch_size=micro_batch_size)
    estimate, policy_loss = F.get_estimator(estimator), F.get_loss(loss)
    ro, episodes, turn_rewards = rg.rollout(state.policy, state.env, prompts, n=n, temperature=temperature, top_p=top_p,
                                 max_turns=max_turns, max_tokens_per_turn=max_tokens_per_turn,
                                 max_total_tokens=max_total_tokens, step_timeout=step_timeout)  # Rollouts[N, T], [N, E]
    r = episodes[:, _COLUMN["reward"]]                                  # [N]
    adv = estimate(r, ro.group, n=n, mask=ro.mask if estimate.takes_mask else None)[:, None]  # [N, 1]
    ref = rg.logprobs(state.ref, ro, temperature=temperature) if kl else None  # [N, T]
    clipping = policy_loss.supported(clip_low=clip, clip_high=clip)

    def loss(lp, entropy):                                               # lp, entropy: [N, T]
        surrogate, *metrics = policy_loss(lp, ro.logprobs, adv, ro.mask, **clipping)
        kl_term = F.token_mean(F.kl_k3(lp, ref), ro.mask) if kl else None  # []
        total = surrogate + kl * kl_term if kl else surrogate            # []
        return total, {**dict(zip(policy_loss.metrics, metrics)), **loss_metrics(lp, ro, entropy, kl=kl_term)}

    policy = rg.update(state.policy, ro, loss, epochs=epochs, temperature=temperature, micro_batch_size=micro_batch_size)
    return (state.replace(policy=policy), {**rollout_metrics(r, ro), **episode_metrics(episodes)},
            transcript_outputs(ro, episodes, turn_rewards))


def transcript_outputs(ro, episodes, turn_rewards) -> dict:
    """What the run's samples.jsonl shows of each episode (rlgraph.agents.transcripts): the turns'
    tokens, which of them are the policy's, each turn's reward and the episode's; gathered whole to
    the controller by the plan (an output, like any other)."""
    return {"rollouts": ro, "episodes": episodes, "turn_rewards": turn_rewards}


__all__ = ["agent_grpo", "episode_metrics", "episode_stats", "transcript_outputs"]

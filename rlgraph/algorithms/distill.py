"""On-policy distillation (Thinking Machines, 2025; tinker-cookbook): frozen teachers score the student's tokens.

The student samples, one or more frozen teachers score the student's own tokens ("On-Policy
Distillation", Thinking Machines blog, 2025), and the per-token advantage is

    A_t = -(log pi_student(y_t) - sum_k w_k log pi_teacher_k(y_t))  [+ reward_weight * group_normalize(r)]
    L   = token_mean( max(-A rho, -A clip(rho, 1-eps, 1+eps)) )

Minimising it minimises the reverse KL from the student to the teachers' weighted geometric mixture
(one teacher: KL(student || teacher)), on the states the student visits. `teachers` names the
state roles (default the one role `teacher`; `rlgraph train`: `model.teachers`), `teacher_weights`
their w_k (default equal, summing to 1). A teacher may have another size than the student; it must
share the tokenizer. `reward_weight > 0` adds a task reward's group-normalised advantage (n >= 2).
"""

import sys

import rlgraph as rg
from rlgraph import functional as F
from rlgraph.algorithms.hparams import check_hparams
from rlgraph.algorithms.metrics import loss_metrics, rollout_metrics
from rlgraph.ir.number_checks import check_number
from rlgraph.errors import TraceError, user_location


@rg.algorithm
def distill(state: rg.State, prompts: rg.Prompts, *, n=4, teachers=("teacher",), teacher_weights=None, reward_weight=0.0,
            clip=0.2, temperature=1.0, top_p=1.0, stop=(), max_new_tokens=None, epochs=1, micro_batch_size=None):
    teachers, weights = check_teachers("distill", teachers, teacher_weights)
    check_number("distill", "reward_weight", reward_weight, low=0, why="a negative weight rewards failing the task")
    check_hparams("distill", n=n, clip=clip, max_new_tokens=max_new_tokens, epochs=epochs,
                  micro_batch_size=micro_batch_size, **({"group_estimator": "group_normalize"} if reward_weight else {}))
    ro = rg.generate(state.policy, prompts, n=n, temperature=temperature, top_p=top_p,
                     max_new_tokens=max_new_tokens, stop=stop)               # Rollouts[N, T]
    teacher_lp = teacher_logprobs(state, ro, teachers, weights, temperature)  # [N, T]
    adv = F.distill_advantage(ro.logprobs, teacher_lp, ro.mask)              # [N, T]
    metrics = {"distill/reverse_kl": F.token_mean(-adv, ro.mask)}            # k1 estimate of KL(student || teacher)
    if reward_weight:
        r = rg.score(state.reward, ro)                                       # [N]
        adv = adv + reward_weight * F.group_normalize(r, ro.group)[:, None]  # [N, T]
        metrics.update(rollout_metrics(r, ro))

    def loss(lp, entropy):                                                   # lp, entropy: [N, T], with gradients
        value, clip_frac, approx_kl = F.ppo_clip(lp, ro.logprobs, adv, ro.mask, clip_low=clip)
        return value, {"clip_frac": clip_frac, "approx_kl": approx_kl, **loss_metrics(lp, ro, entropy)}

    policy = rg.update(state.policy, ro, loss, epochs=epochs, temperature=temperature, micro_batch_size=micro_batch_size)
    return state.replace(policy=policy), metrics


def teacher_logprobs(state, ro, teachers, weights, temperature):
    """sum_k w_k log pi_teacher_k(y_t) [N, T]: each teacher one `logprobs` step on its own role."""
    total = None
    for role, weight in zip(teachers, weights):
        lp = rg.logprobs(getattr(state, role), ro, temperature=temperature)  # [N, T]
        lp = lp if weight == 1.0 else weight * lp                          # [N, T]
        total = lp if total is None else total + lp
    return total


def check_teachers(owner, teachers, teacher_weights):
    """(the teachers' role names, their weights: equal by default) after checking both; lists (YAML) become tuples."""
    where = user_location(sys._getframe(1))  # the algorithm's line
    teachers = (teachers,) if isinstance(teachers, str) else tuple(teachers) if isinstance(teachers, list) else teachers
    teacher_weights = tuple(teacher_weights) if isinstance(teacher_weights, list) else teacher_weights
    if not isinstance(teachers, tuple) or not teachers or not all(isinstance(t, str) and t.isidentifier() for t in teachers) \
            or len(set(teachers)) != len(teachers) or "policy" in teachers:
        raise TraceError(f"{owner}: teachers={teachers!r} must be a tuple of distinct state role names other than "
                         "'policy'", where, fix="teachers=('teacher',), or ('teacher', 'teacher_code') with both roles declared")
    if teacher_weights is None:
        return teachers, (1.0 / len(teachers),) * len(teachers)
    if not isinstance(teacher_weights, tuple) or len(teacher_weights) != len(teachers):
        raise TraceError(f"{owner}: teacher_weights={teacher_weights!r} needs one weight per teacher "
                         f"({len(teachers)}: {', '.join(teachers)})", where, fix="teacher_weights=(0.5, 0.5)")
    for index, weight in enumerate(teacher_weights):
        check_number(owner, f"teacher_weights[{index}]", weight, low=0, where=where)
    if abs(sum(teacher_weights) - 1.0) > 1e-6:
        raise TraceError(f"{owner}: teacher_weights={teacher_weights!r} sum to {sum(teacher_weights):g}, not 1 (the "
                         "target is their weighted geometric mixture)", where, fix="scale them to sum to 1")
    return teachers, tuple(float(w) for w in teacher_weights)

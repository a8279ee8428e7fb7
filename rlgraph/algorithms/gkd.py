"""GKD (Agarwal et al., 2024, arXiv 2306.13649): a generalised JSD to a teacher on student and teacher sequences.

Generalised knowledge distillation ("On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes", Algorithm 1):

    L = lam * E_{y ~ student}[ JSD_beta(t || s) ] + (1 - lam) * E_{y ~ off-policy}[ JSD_beta(t || s) ]
    JSD_beta = beta KL(t || m) + (1 - beta) KL(s || m),  m = beta t + (1 - beta) s

`beta` interpolates from the forward KL (0) to the reverse KL (1), TRL `GKDTrainer`'s convention
(`rlgraph.functional.distill`). `lam` is the on-policy fraction: the expected gradient of the
paper's coin (student with probability lam) is taken every step, as one optimizer step over two
accumulated updates, lam times the student's sequences' and 1 - lam times the off-policy ones'.
The off-policy sequences are sampled from the (first) teacher (the paper's supervised-KD data; a dataset's
answers inside a traced step need a primitive rlgraph does not have yet). `vocab=True`: the exact
JSD_beta over the whole vocabulary at every position (`F.generalized_jsd`): the teachers' log-softmax
f32[N,T,V] (`rg.logprobs(..., vocab=True)`; several teachers: their weighted geometric mixture,
renormalised) against the student's, which `rg.update(vocab=True)` hands the loss with gradients;
4*N*T*V bytes per teacher call and per training forward. `vocab=False`: the sampled-token estimate
`F.gkd_loss`, for vocabularies too large to hold [N,T,V].
"""

import torch

import rlgraph as rg
from rlgraph import functional as F
from rlgraph.algorithms.distill import check_teachers, teacher_logprobs
from rlgraph.algorithms.hparams import check_hparams
from rlgraph.ir.number_checks import check_number
from rlgraph.errors import TraceError, user_location


@rg.algorithm
def gkd(state: rg.State, prompts: rg.Prompts, *, n=4, beta=0.5, lam=1.0, teachers=("teacher",), teacher_weights=None,
        vocab=False, temperature=1.0, top_p=1.0, stop=(), max_new_tokens=None, grad_clip=1.0, micro_batch_size=None):
    teachers, weights = check_teachers("gkd", teachers, teacher_weights)
    check_number("gkd", "beta", beta, low=0, high=1, why="0 is the forward KL, 1 the reverse KL")
    check_number("gkd", "lam", lam, low=0, high=1, why="the fraction of the gradient from the student's own sequences")
    check_hparams("gkd", n=n, max_new_tokens=max_new_tokens, micro_batch_size=micro_batch_size)
    if not isinstance(vocab, bool):
        raise TraceError(f"gkd: vocab={vocab!r} must be True (the exact JSD over the vocabulary) or False (its "
                         "sampled-token estimate)", user_location(), fix="vocab=True")
    sample = dict(n=n, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, stop=stop)
    parts = (("student", state.policy, lam), ("teacher", getattr(state, teachers[0]), 1.0 - lam))
    parts = [part for part in parts if part[2] > 0]                              # lam 0 or 1: one source
    policy, metrics = state.policy, {}
    for index, (source, model, share) in enumerate(parts):
        ro = rg.generate(model, prompts, **sample)                               # Rollouts[N, T]
        if vocab:
            loss = vocab_jsd_loss(ro, teacher_vocabulary(state, ro, teachers, weights, temperature), beta, share)
        else:
            loss = jsd_loss(ro, teacher_logprobs(state, ro, teachers, weights, temperature), beta, share)
        if len(parts) == 1:
            policy = rg.update(policy, ro, loss, temperature=temperature, grad_clip=grad_clip,
                               micro_batch_size=micro_batch_size, vocab=vocab)
        else:
            policy = rg.update(policy, ro, loss, temperature=temperature, grad_clip=None, step=False,
                               micro_batch_size=micro_batch_size, vocab=vocab)
        metrics[f"gkd/{source}_tokens"] = ro.mask.sum()
    if len(parts) > 1:
        policy = rg.optimizer_step(policy, grad_clip=grad_clip)
    return state.replace(policy=policy), metrics


def jsd_loss(ro, teacher_lp, beta, share):
    """The loss closure of one source's rows: `share` times their JSD_beta estimate."""
    def loss(lp):                                                                # lp: [N, T], with gradients
        jsd, rho = F.gkd_loss(lp, ro.logprobs, teacher_lp, ro.mask, beta=beta)   # [], []
        return share * jsd, {"jsd": jsd.detach(), "importance_weight": rho}
    return loss


def teacher_vocabulary(state, ro, teachers, weights, temperature):
    """log of the teachers' weighted geometric mixture over the vocabulary, renormalised, [N, T, V]."""
    if len(teachers) == 1:
        return rg.logprobs(getattr(state, teachers[0]), ro, temperature=temperature, vocab=True)  # [N, T, V]
    total = None
    for role, weight in zip(teachers, weights):
        lp = weight * rg.logprobs(getattr(state, role), ro, temperature=temperature, vocab=True)  # [N, T, V]
        total = lp if total is None else total + lp
    return torch.log_softmax(total, dim=-1)  # [N, T, V]


def vocab_jsd_loss(ro, teacher_vocab_lp, beta, share):
    """The loss closure of one source's rows: `share` times their exact JSD_beta, token-averaged."""
    def loss(vocab_lp):                                                          # [N, T, V], with gradients
        jsd = F.token_mean(F.generalized_jsd(vocab_lp, teacher_vocab_lp, beta=beta), ro.mask)  # []
        return share * jsd, {"jsd": jsd.detach()}
    return loss

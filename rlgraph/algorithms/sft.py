"""Supervised fine-tuning as a graph function: maximise the log-likelihood of demonstrations.

    L = -token_mean(log pi(y_t | x, y_<t))
"""

import rlgraph as rg
from rlgraph import functional as F
from rlgraph.algorithms.hparams import check_hparams


@rg.algorithm
def sft(state: rg.State, batch: rg.Rollouts, *, micro_batch_size=None):
    check_hparams("sft", micro_batch_size=micro_batch_size)
    def loss(lp):                                    # lp: [N, T]
        return -F.token_mean(lp, batch.mask)

    policy = rg.update(state.policy, batch, loss, micro_batch_size=micro_batch_size)
    return state.replace(policy=policy), {}

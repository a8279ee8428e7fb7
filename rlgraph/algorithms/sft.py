"""Supervised fine-tuning as a graph function: maximise the log-likelihood of demonstrations.

    L = -token_mean(log pi(y_t | x, y_<t))

`next_token_loss` is the closure SFT and continued pre-training (`pretrain`) both minimise.
"""

import rlgraph as rg
from rlgraph import functional as F
from rlgraph.algorithms.hparams import check_hparams


def next_token_loss(batch: rg.Rollouts):
    """The update closure -token_mean(log pi, mask): every token under the batch's mask is a target."""
    def loss(lp):                                    # lp: [N, T]
        return -F.token_mean(lp, batch.mask)

    return loss


@rg.algorithm
def sft(state: rg.State, batch: rg.Rollouts, *, micro_batch_size=None):
    check_hparams("sft", micro_batch_size=micro_batch_size)
    policy = rg.update(state.policy, batch, next_token_loss(batch), micro_batch_size=micro_batch_size)
    return state.replace(policy=policy), {}

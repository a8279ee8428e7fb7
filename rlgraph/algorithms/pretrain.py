"""Continued pre-training: next-token prediction over packed raw text (`rlgraph.data.pretrain`).

    L   = -token_mean(log pi(x_t | x_<t of its own document))       every token of every segment
    ppl = exp(L)                                                     from the update's own forward

The batch is SFT's (`Rollouts` of teacher-forced responses): each segment of a pack is a row whose
prompt is the one start token, so the loss is SFT's closure (`next_token_loss`) and a run can go
PT -> SFT -> RL in stages (docs/training.md). Compiled with `micro_batch_tokens=k` (the config's
train.micro_batch_tokens) the rows run packed, unpadded, attention kept inside each document.
"""

import rlgraph as rg
from rlgraph import functional as F
from rlgraph.algorithms.hparams import check_hparams
from rlgraph.algorithms.sft import next_token_loss


@rg.algorithm
def pretrain(state: rg.State, batch: rg.Rollouts, *, micro_batch_size=None):
    check_hparams("pretrain", micro_batch_size=micro_batch_size)
    policy, lp = rg.update(state.policy, batch, next_token_loss(batch), micro_batch_size=micro_batch_size,
                           outputs=True)                                     # lp: [N, T], detached
    nll = -F.masked_mean(lp, batch.mask)                                     # [] over the step's tokens
    return state.replace(policy=policy), {"nll": nll, "perplexity": nll.exp(),
                                          "tokens": F.masked_sum(batch.mask.float(), batch.mask)}

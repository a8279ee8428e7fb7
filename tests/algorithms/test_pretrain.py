import functools
import math

import pytest
import torch

import rlgraph.testing as rgt
from rlgraph.algorithms import pretrain, sft
from rlgraph.data.pretrain import segment_batch
from rlgraph.errors import TraceError
from rlgraph.runtime.eager import Interpreter
from tests.helpers import make_executor, params_of

# two packs of 6 tokens, cut into segments at document ends (ids of the character vocabulary, 2 = EOS)
SEGMENTS = [[21, 22, 2, 23, 24, 25], [26, 2], [27, 28, 29, 2]]


def batch():
    return segment_batch(SEGMENTS, start_id=1, pad_id=0)


def test_pretrain_is_the_sft_update_plus_its_perplexity():
    text = str(pretrain.trace())
    assert "outputs=True" in text and "token_mean lp" in text and "perplexity=" in text
    runs = {}
    for algorithm in (pretrain, sft):
        executor = make_executor(seed=3)
        _, metrics = Interpreter(executor).run(algorithm.trace(), batch())
        runs[algorithm.name] = metrics, params_of(executor)
    (pt, pt_params), (tuned, tuned_params) = runs["pretrain"], runs["sft"]
    assert pt["policy/loss"] == tuned["policy/loss"]  # the same closure on the same batch ...
    assert all(torch.equal(a, b) for a, b in zip(pt_params, tuned_params))  # ... and the same step
    assert pt["nll"] == pytest.approx(pt["policy/loss"], rel=1e-6)  # the update's own forward
    assert pt["perplexity"] == pytest.approx(math.exp(pt["nll"]), rel=1e-6)
    assert pt["tokens"] == sum(len(segment) for segment in SEGMENTS)


def test_the_nll_is_the_mean_over_every_token_of_log_softmax():
    executor = make_executor(seed=3)
    model, b = executor.models["policy"].model, batch()
    with torch.no_grad():  # by hand: the model on [start, segment], each token predicted from its prefix
        total = 0.0
        for segment in SEGMENTS:
            ids = torch.tensor([[1, *segment]])
            logits = model(input_ids=ids).logits[0, :-1]  # [len, V]
            total -= torch.log_softmax(logits.float(), -1).gather(1, ids[0, 1:, None]).sum().item()
    _, metrics = Interpreter(executor).run(pretrain.trace(), b)
    assert metrics["nll"] == pytest.approx(total / sum(map(len, SEGMENTS)), rel=1e-5)


def test_micro_batches_do_not_change_the_step():
    rgt.assert_update_microbatch_invariant(pretrain, executor=functools.partial(rgt.tiny_executor, ("policy",)),
                                           batches=[batch(), batch()])


@pytest.mark.parametrize("value", [0, -1, 1.5])
def test_bad_micro_batch_size_is_refused(value):
    with pytest.raises(TraceError, match="pretrain: micro_batch_size="):
        pretrain.trace(micro_batch_size=value)

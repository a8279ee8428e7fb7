"""`rg.column`: per-row values of a batch's metadata as a typed program value; each bad use named."""

import attrs
import pytest
import torch

import rlgraph as rg
from rlgraph import functional as F
from rlgraph.batches import BatchError
from rlgraph.errors import SpecError, TraceError
from rlgraph.runtime.eager import Interpreter
from tests.helpers import make_executor, prompts


def rollouts_with(meta):
    executor = make_executor()
    ro = executor.generate(executor.current("policy"), prompts(2), n=2, max_new_tokens=3)  # Rollouts[4, 3]
    return executor, attrs.evolve(ro, meta=meta(ro))


def test_a_column_reads_one_tensor_per_row_and_moves_with_the_rows():
    _, ro = rollouts_with(lambda ro: {"advantages": [torch.full((3,), float(i)) for i in range(4)], "score": [1, 2, 3, 4]})
    assert torch.equal(rg.column(ro, "advantages"), torch.arange(4.0)[:, None].expand(4, 3))  # [N, T]
    assert torch.equal(rg.column(ro, "score", per_token=False), torch.tensor([1.0, 2.0, 3.0, 4.0]))  # [N]
    picked = ro.select(torch.tensor([2, 0]))  # a micro-batch's rows keep their own values
    assert torch.equal(rg.column(picked, "advantages")[:, 0], torch.tensor([2.0, 0.0]))


def test_a_traced_column_is_an_input_of_the_loss_and_runs_as_eager_math():
    @rg.algorithm
    def weighted_sft(state: rg.State, ro: rg.Rollouts):
        w = rg.column(ro, "weights")                                   # f32[N,T]
        policy = rg.update(state.policy, ro, lambda lp: -F.masked_sum(w * lp, ro.mask))
        return state.replace(policy=policy), {"w": w.mean()}

    text = str(weighted_sft.trace())
    assert "f32[N,T] = column[per_token=True] ro 'weights'" in text
    executor, ro = rollouts_with(lambda ro: {"weights": [torch.full((3,), 0.5)] * 4})
    _, metrics = Interpreter(executor).run(weighted_sft.trace(), ro)
    assert metrics["w"] == 0.5 and metrics["policy/loss"] > 0  # -sum(0.5 * lp) over tokens: lp < 0


def test_bad_columns_are_named():
    _, ro = rollouts_with(lambda ro: {"advantages": [torch.zeros(2)] * 4, "text": ["a"] * 4})
    with pytest.raises(BatchError, match=r"no metadata column 'weights' \(it has: advantages, text\)"):
        rg.column(ro, "weights")
    with pytest.raises(BatchError, match=r"meta\['advantages'\] row 0 has shape \(2,\); each row needs a float tensor \[3\]"):
        rg.column(ro, "advantages")
    with pytest.raises(BatchError, match=r"meta\['text'\] row 0 is str 'a'; each row needs a float tensor \[3\]"):
        rg.column(ro, "text")


@pytest.mark.parametrize("key, kwargs, error, match", [
    ("mask", {}, TraceError, r"'mask' is a field of Rollouts; read it as batch.mask"),
    ("not a name", {}, TraceError, r"the key must be a name such as 'advantages'"),
    ("adv", {"per_token": "yes"}, TraceError, r"per_token must be True or False"),
])
def test_bad_traced_columns_name_the_line(key, kwargs, error, match):
    @rg.algorithm
    def algo(state: rg.State, ro: rg.Rollouts):
        return state, {"a": rg.column(ro, key, **kwargs).mean()}

    with pytest.raises(error, match=match) as caught:
        algo.trace()
    assert "test_columns.py" in str(caught.value)


def test_prompts_have_no_per_token_column():
    @rg.algorithm
    def algo(state: rg.State, prompts: rg.Prompts):
        return state, {"a": rg.column(prompts, "difficulty").mean()}

    with pytest.raises(SpecError, match=r"Prompts have no response tokens(.|\n)*per_token=False"):
        algo.trace()

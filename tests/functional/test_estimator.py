import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import rlgraph as rg
from rlgraph import functional as F


@F.estimator
def leave_one_out(r):                                  # r: f32[n], one group
    return r - (r.sum() - r) / (r.shape[0] - 1)        # [n]


@F.estimator
def length_penalised(r, mask, *, coef=0.1):            # r: f32[n], mask: bool[n, T]
    shaped = r - coef * mask.sum(-1).to(r.dtype)       # [n]
    return shaped - shaped.mean()


def groups(b, n):
    return torch.arange(b).repeat_interleave(n)        # [B*n], contiguous like rg.generate


@given(st.integers(1, 5), st.integers(2, 6), st.data())
def test_leave_one_out_equals_rloo(b, n, data):
    r = torch.tensor(data.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, -2.0]), min_size=b * n, max_size=b * n)))
    torch.testing.assert_close(leave_one_out(r, groups(b, n), n=n), F.rloo(r, groups(b, n)))


@given(st.integers(1, 5), st.integers(2, 6), st.data())
def test_permuting_groups_and_rows_within_a_group_permutes_the_advantages(b, n, data):
    r = torch.tensor(data.draw(st.lists(st.floats(-3, 3, width=32), min_size=b * n, max_size=b * n)))
    group_order = torch.tensor(data.draw(st.permutations(range(b))), dtype=torch.long)
    row_order = torch.tensor(data.draw(st.permutations(range(n))), dtype=torch.long)
    rows = (group_order[:, None] * n + row_order[None, :]).flatten()   # [B*n]
    adv = leave_one_out(r, groups(b, n), n=n)
    torch.testing.assert_close(leave_one_out(r[rows], groups(b, n), n=n), adv[rows], rtol=1e-5, atol=1e-5)


def test_per_row_arguments_and_hyper_parameters_are_split_with_the_groups():
    r, mask = torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]]).bool()
    adv = length_penalised(r, groups(2, 2), mask, n=2, coef=0.5)
    torch.testing.assert_close(adv, torch.tensor([0.25, -0.25, -0.5, 0.5]))


def test_bad_groupings_are_refused_with_a_clear_error():
    r = torch.zeros(6)
    with pytest.raises(ValueError, match="do not split into groups of n=4"):
        leave_one_out(r, groups(3, 2), n=4)
    with pytest.raises(ValueError, match="contiguous blocks"):
        leave_one_out(r, torch.tensor([0, 1, 0, 1, 2, 2]), n=2)


def test_an_estimator_traces_as_one_node_named_after_the_function():
    @rg.algorithm
    def probe(state: rg.State, prompts: rg.Prompts, *, n=4):
        ro = rg.generate(state.policy, prompts, n=n)
        adv = leave_one_out(rg.score(state.reward, ro), ro.group, n=n)   # [N]
        return state, {"adv": adv.mean()}

    text = str(probe.trace())
    assert "d:f32[N] = leave_one_out[n=4] b c" in text
    assert sum(" = " in line for line in text.splitlines()) == 5        # generate, score, group, estimator, mean


def test_registry_by_name():
    assert F.get_estimator("leave_one_out") is leave_one_out and "length_penalised" in F.ESTIMATORS
    with pytest.raises(KeyError, match="did you mean 'leave_one_out'"):
        F.get_estimator("leave_one_uot")
    with pytest.raises(ValueError, match="taken by the op"):
        F.estimator(lambda r: r, name="rloo")


def test_every_code_block_of_the_tutorial_runs():
    import pathlib
    import re

    text = (pathlib.Path(__file__).parents[2] / "docs/tutorials/new-estimator.md").read_text()
    namespace: dict = {}
    for index, block in enumerate(re.findall(r"```python\n(.*?)```", text, re.S)):
        exec(compile(block, f"new-estimator.md block {index}", "exec"), namespace)
    assert namespace["state"]["policy"].version == 2

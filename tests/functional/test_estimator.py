import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import rlgraph as rg
from rlgraph import functional as F
from rlgraph.ir import ops


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


def test_an_estimator_is_registered_by_name_with_its_calling_convention():
    assert F.get_estimator("leave_one_out").op is leave_one_out and "length_penalised" in F.ESTIMATORS
    by_name = F.get_estimator("length_penalised")                     # takes the mask: a per-row `mask` argument
    assert by_name.takes_mask and not F.get_estimator("leave_one_out").takes_mask
    r, mask = torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]]).bool()
    torch.testing.assert_close(by_name(r, groups(2, 2), n=2, mask=mask, coef=0.5),
                               length_penalised(r, groups(2, 2), mask, n=2, coef=0.5))
    torch.testing.assert_close(F.get_estimator("leave_one_out")(r, groups(2, 2), n=2, mask=mask),
                               leave_one_out(r, groups(2, 2), n=2))


def test_names_of_ops_and_of_registered_estimators_are_refused_without_side_effects():
    with pytest.raises(ValueError, match="taken by the op"):
        F.estimator(lambda r: r, name="rloo")
    with pytest.raises(ValueError, match="registered already"):
        F.estimator(lambda r: r, name="dr_grpo")                      # a registry name, not an op name
    assert ops.OPS["rloo"] is F.rloo and "dr_grpo" not in ops.OPS
    assert F.ESTIMATORS["rloo"].op is F.rloo and F.ESTIMATORS["dr_grpo"].op is F.group_normalize


def test_redefining_an_estimator_replaces_it():
    def define():                                                     # as a re-run notebook cell would
        @F.estimator(name="redefined_probe")
        def probe(r):
            return r - r.mean()
        return probe

    first, second = define(), define()
    assert first is not second and F.get_estimator("redefined_probe").op is second


def test_every_code_block_of_the_tutorial_runs():
    import pathlib
    import re

    text = (pathlib.Path(__file__).parents[2] / "docs/tutorials/new-estimator.md").read_text()
    namespace: dict = {}
    for index, block in enumerate(re.findall(r"```python\n(.*?)```", text, re.S)):
        exec(compile(block, f"new-estimator.md block {index}", "exec"), namespace)
    assert namespace["state"]["policy"].version == 2


def _value_dependent_estimators():
    """Registered when the test runs, not at import: the registry is global to the session."""
    @F.estimator(name="test_branching_estimator")
    def branching_estimator(r):
        if r.max() > 0:  # a Python branch on one group's values: vmap cannot take it
            return r - r.mean()
        return torch.zeros_like(r)

    @F.estimator(name="test_item_estimator")
    def item_estimator(r):
        return r - r.mean().item()

    return {"branching_estimator": branching_estimator, "item_estimator": item_estimator}


@pytest.mark.parametrize("function, what, line", [
    ("branching_estimator", "a Python `if`", "if r.max() > 0:"),
    ("item_estimator", "`.item()`", "return r - r.mean().item()"),
])
def test_a_value_dependent_estimator_gets_rlgraphs_own_error_at_its_line(function, what, line):
    import re

    from rlgraph.algorithms import grpo
    from rlgraph.errors import TraceError

    fn = _value_dependent_estimators()[function]
    expected = (rf"@F.estimator {fn.__name__}: {re.escape(what)}(.|\n)*at .*test_estimator.py:\d+ in {function}\(\):  "
                rf"{re.escape(line)}(.|\n)*fix: express the choice as tensor math")
    with pytest.raises(TraceError, match=expected):  # traced in an algorithm
        grpo.trace(estimator=fn.__name__)
    with pytest.raises(TraceError, match=expected):  # and called on data
        fn(torch.tensor([1.0, 0.0, 2.0, 2.0]), torch.tensor([0, 0, 1, 1]), n=2)

import pytest

import rlgraph as rg
from rlgraph.errors import VerifyError


def _two_updates(use_stale: bool):
    @rg.algorithm
    def algo(state: rg.State, prompts: rg.Prompts):
        ro = rg.generate(state.policy, prompts)
        first = rg.update(state.policy, ro, lambda lp: -(lp * ro.mask).sum())
        second = rg.update(state.policy if use_stale else first, ro, lambda lp: -(lp * ro.mask).sum())
        return state.replace(policy=second), {}

    return algo


def test_versions_chain_through_updates():
    program = _two_updates(use_stale=False).trace()
    updates = program.primitive_nodes("update")
    assert [str(node.meta["spec"].items[0]) for node in updates] == ["policy@v+1", "policy@v+2"]


def test_verifier_refuses_a_stale_model_version():
    with pytest.raises(VerifyError, match=r"uses policy@v after policy@v\+1") as error:
        _two_updates(use_stale=True).trace()
    # the user's line, as every other trace error names it, and the fix
    assert "\n  at tests/ir/test_program.py:12 in algo():  second = rg.update(state.policy if use_stale" in str(error.value)
    assert "fix: read the version rg.update returned (policy@v+1) instead of state.policy" in str(error.value)


def test_loss_programs_are_nested_and_verified():
    program = _two_updates(use_stale=False).trace()
    subs = [sub for _, sub in program.subprograms()]
    assert len(subs) == 2 and all(sub.kind == "loss" for sub in subs)
    assert all(str(sub.result[0].meta["spec"]) == "f32[]" for sub in subs)

"""In-place changes and Python/numpy conversions of traced values are refused at the user's line
(rlgraph/ir/purity.py), with the out-of-place form to write; the out-of-place forms trace."""

from pathlib import Path

import numpy as np
import pytest
import torch

import rlgraph as rg
from rlgraph import functional as F
from rlgraph.errors import SpecError, TraceError

HERE = Path(__file__).read_text().splitlines()


def assert_points_at(exc: pytest.ExceptionInfo, marker: str) -> None:
    line = next(i + 1 for i, text in enumerate(HERE) if text.rstrip().endswith(f"# {marker}"))
    assert f"test_purity.py:{line}" in str(exc.value), str(exc.value)


def _algorithm(construct: str):
    @rg.algorithm
    def algo(state: rg.State, prompts: rg.Prompts):
        ro = rg.generate(state.policy, prompts, n=4)
        r = rg.score(state.reward, ro)
        adv = F.group_normalize(r, ro.group)
        if construct == "mul_":
            r.mul_(0)  # E-mul_
        elif construct == "+=":
            adv += 1  # E-+=
        elif construct == "-=":
            adv -= adv.mean()  # E--=
        elif construct == "setitem":
            adv[0] = 1  # E-setitem
        elif construct == "torch.relu_":
            torch.relu_(adv)  # E-torch.relu_
        elif construct == "out=":
            torch.add(adv, 1, out=adv)  # E-out=
        elif construct == "inplace=True":
            torch.nn.functional.relu(adv, inplace=True)  # E-inplace=True
        elif construct == "field":
            ro.mask = ro.mask  # E-field

        def loss(lp):
            if construct == "loss mul_":
                lp.mul_(2)  # E-loss mul_
            return F.token_mean(-lp * adv[:, None], ro.mask)

        return state.replace(policy=rg.update(state.policy, ro, loss)), {"r": r.mean()}

    return algo


@pytest.mark.parametrize("construct, fix", [
    ("mul_", "x = x.mul(...)"), ("loss mul_", "x = x.mul(...)"), ("+=", "x = x + other"), ("-=", "x = x - other"),
    ("setitem", "torch.where(mask, value, x)"), ("torch.relu_", "x = torch.relu(x, ...)"), ("out=", "drop out="),
    ("inplace=True", "inplace=False"),
])
def test_in_place_changes_are_refused_at_the_line_with_the_out_of_place_form(construct, fix):
    with pytest.raises(TraceError) as exc:
        _algorithm(construct).trace()
    assert_points_at(exc, f"E-{construct}")
    assert "in-place" in exc.value.summary and "pure" in exc.value.summary
    assert fix in str(exc.value).split("fix:")[1]


def test_assigning_a_field_of_a_traced_record_is_refused():
    with pytest.raises(TraceError) as exc:
        _algorithm("field").trace()
    assert_points_at(exc, "E-field")
    assert "Rollouts[N,T] is immutable; cannot set 'mask'" in str(exc.value)


def test_the_out_of_place_forms_trace():
    @rg.algorithm
    def algo(state: rg.State, prompts: rg.Prompts):
        ro = rg.generate(state.policy, prompts, n=4)
        r = rg.score(state.reward, ro).mul(0)
        adv = F.group_normalize(r, ro.group)
        adv = torch.where(torch.arange(4 * 0 + 1) == 0, 1.0, adv)  # the item assignment, out of place
        adv = torch.relu(adv + 1)
        return state, {"adv": adv.mean()}

    program = algo.trace()
    assert {"mul", "relu", "add"} <= {getattr(n.target, "__name__", n.target) for n in program.graph.nodes}


CONVERSIONS = {
    "np.asarray": (lambda r: np.asarray(r), "numpy array"), "np.array": (lambda r: np.array(r), "numpy array"),
    "torch.tensor": (lambda r: torch.tensor(r), "torch.tensor()"),
    "torch.as_tensor": (lambda r: torch.as_tensor(r), "torch.tensor()"), "len": (lambda r: len(r), "len()"),
    "item": (lambda r: r.mean().item(), ".item()"), "tolist": (lambda r: r.tolist(), ".tolist()"),
    "numpy": (lambda r: r.numpy(), ".numpy()"),
}


@pytest.mark.parametrize("name", sorted(CONVERSIONS))
def test_conversions_to_python_or_numpy_are_refused_at_the_line(name):
    use, what = CONVERSIONS[name]

    @rg.algorithm
    def algo(state: rg.State, prompts: rg.Prompts):
        ro = rg.generate(state.policy, prompts, n=4)
        r = rg.score(state.reward, ro)
        use(r)
        return state, {}

    with pytest.raises(TraceError) as exc:
        algo.trace()
    line = HERE.index(next(text for text in HERE if text.strip().startswith(f'"{name}"') or f' "{name}": ' in text)) + 1
    assert f"test_purity.py:{line}" in str(exc.value), str(exc.value)  # the user's line: the one that converts
    assert what in exc.value.summary and "Python value of a traced value" in exc.value.summary
    assert not isinstance(exc.value, SpecError)  # not reported as a shape mismatch

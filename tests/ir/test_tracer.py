"""Every tracer error names the user's file and line; spec inference gives the documented specs."""

import re
from pathlib import Path

import pytest
import torch

import rlgraph as rg
from rlgraph.ir import specs as S
from rlgraph.errors import SpecError, TraceError

HERE = Path(__file__).read_text().splitlines()


def line_of(marker: str) -> int:
    return next(i + 1 for i, line in enumerate(HERE) if line.rstrip().endswith(f"# {marker}"))


def assert_points_at(exc: pytest.ExceptionInfo, marker: str) -> None:
    text = str(exc.value)
    assert f"test_tracer.py:{line_of(marker)}" in text, text


def test_shape_mismatch_names_dims_and_line():
    @rg.algorithm
    def bad(state: rg.State, prompts: rg.Prompts):
        ro = rg.generate(state.policy, prompts, n=4)
        x = ro.logprobs + ro.prompt_mask  # E-shape
        return state, {"x": x.mean()}

    with pytest.raises(SpecError) as exc:
        bad.trace()
    assert_points_at(exc, "E-shape")
    assert "f32[N,T]" in str(exc.value) and "bool[N,P]" in str(exc.value)
    assert re.search(r"\bT\b.*\bP\b|\bP\b.*\bT\b", exc.value.summary)


def test_dtype_mismatch_names_line():
    @rg.algorithm
    def bad(state: rg.State, prompts: rg.Prompts):
        ro = rg.generate(state.policy, prompts)
        x = torch.where(ro.logprobs, ro.logprobs, 0.0)  # E-dtype
        return state, {"x": x.mean()}

    with pytest.raises(SpecError) as exc:
        bad.trace()
    assert_points_at(exc, "E-dtype")
    assert "where" in str(exc.value)


@pytest.mark.parametrize("construct", ["if", "for", "bool", "float"])
def test_python_control_flow_on_traced_values_is_refused(construct):
    @rg.algorithm
    def bad(state: rg.State, prompts: rg.Prompts):
        ro = rg.generate(state.policy, prompts)
        r = rg.score(state.reward, ro)
        if construct == "if":
            if r.mean() > 0:  # E-if
                pass
        elif construct == "for":
            for _ in r:  # E-for
                pass
        elif construct == "bool":
            bool(r)  # E-bool
        else:
            float(r.mean())  # E-float
        return state, {}

    with pytest.raises(TraceError) as exc:
        bad.trace()
    assert_points_at(exc, f"E-{construct}")
    assert "not known while the algorithm is traced" in str(exc.value)
    assert "fix:" in str(exc.value)


def test_unknown_primitive_argument_suggests_the_right_one():
    @rg.algorithm
    def bad(state: rg.State, prompts: rg.Prompts):
        ro = rg.generate(state.policy, prompts, m=8)  # E-arg
        return state, {}

    with pytest.raises(TraceError) as exc:
        bad.trace()
    assert_points_at(exc, "E-arg")
    assert "did you mean 'n'" in str(exc.value)


def test_missing_state_field_suggests_the_right_one():
    @rg.algorithm
    def bad(state: rg.State, prompts: rg.Prompts):
        ro = rg.generate(state.polcy, prompts)  # E-field
        return state, {}

    with pytest.raises(TraceError) as exc:
        bad.trace()
    assert_points_at(exc, "E-field")
    assert "did you mean 'policy'" in str(exc.value)


def test_missing_record_field_lists_fields():
    @rg.algorithm
    def bad(state: rg.State, prompts: rg.Prompts):
        ro = rg.generate(state.policy, prompts)
        return state, {"x": ro.logprob.mean()}  # E-record

    with pytest.raises(TraceError) as exc:
        bad.trace()
    assert_points_at(exc, "E-record")
    assert "did you mean 'logprobs'" in str(exc.value)


def test_wrong_argument_kind_for_a_primitive():
    @rg.algorithm
    def bad(state: rg.State, prompts: rg.Prompts):
        ro = rg.generate(state.policy, prompts, n=4)
        again = rg.generate(state.policy, ro)  # E-kind
        return state, {}

    with pytest.raises(SpecError) as exc:
        bad.trace()
    assert_points_at(exc, "E-kind")
    assert "Prompts[B,P]" in str(exc.value) and "Rollouts[N,T]" in str(exc.value)


def test_loss_must_be_a_scalar():
    @rg.algorithm
    def bad(state: rg.State, prompts: rg.Prompts):
        ro = rg.generate(state.policy, prompts)

        def loss(lp):
            return lp * 2

        return state.replace(policy=rg.update(state.policy, ro, loss)), {}

    with pytest.raises(SpecError, match="must return a float scalar"):
        bad.trace()


def test_loss_may_not_capture_per_prompt_values():
    @rg.algorithm
    def bad(state: rg.State, prompts: rg.Prompts):
        ro = rg.generate(state.policy, prompts, n=4)
        per_prompt = prompts.mask.float().sum(-1)  # [B]

        def loss(lp):
            return (lp.sum(-1)).mean() + per_prompt.mean()

        return state.replace(policy=rg.update(state.policy, ro, loss)), {}

    with pytest.raises(SpecError, match=r"f32\[B\]"):
        bad.trace()


def test_unknown_hyperparameter():
    @rg.algorithm
    def algo(state: rg.State, prompts: rg.Prompts, *, n=4):
        return state, {}

    with pytest.raises(TraceError, match="did you mean 'n'"):
        algo.trace(nn=3)


def test_primitive_outside_an_algorithm():
    with pytest.raises(TraceError, match="outside an algorithm"):
        rg.generate(None, None)


def test_state_replace_checks_the_role():
    @rg.algorithm
    def bad(state: rg.State, prompts: rg.Prompts):
        return state.replace(policy=state.ref), {}

    with pytest.raises(TraceError, match="expects a version of policy"):
        bad.trace()


def test_specs_of_primitives_and_math():
    @rg.algorithm
    def algo(state: rg.State, prompts: rg.Prompts, *, n=4):
        ro = rg.generate(state.policy, prompts, n=n)
        lp, ent = rg.logprobs(state.ref, ro, entropy=True)
        r = rg.score(state.reward, ro)
        per_seq = (lp * ro.mask).sum(-1)
        return state, {"r": r.mean(), "lp": per_seq.mean(), "ent": ent.mean()}

    program = algo.trace()
    specs = {str(node.meta["spec"]) for node in program.nodes if "spec" in node.meta}
    assert {"Rollouts[N,T]", "f32[N,T]", "f32[N]", "f32[]"} <= specs
    metric_specs = [node.meta["spec"] for node in program.result[1].values()]
    assert all(spec == S.TensorSpec((), torch.float32) for spec in metric_specs)


def test_unused_roles_are_pruned_and_update_bumps_the_version():
    @rg.algorithm
    def algo(state: rg.State, prompts: rg.Prompts):
        ro = rg.generate(state.policy, prompts)
        policy = rg.update(state.policy, ro, lambda lp: -(lp * ro.mask).sum() / ro.mask.sum())
        return state.replace(policy=policy), {}

    program = algo.trace()
    assert [node.target for node in program.inputs] == ["policy", "prompts"]
    state, metrics = program.result
    assert str(state["policy"].meta["spec"]) == "policy@v+1"
    assert "policy" in metrics  # update statistics are reported automatically


def test_one_sample_per_prompt_gives_per_prompt_rollouts():
    """n=1 rollouts hold B rows, so mixing them with per-sample values fails while tracing."""
    @rg.algorithm
    def baseline(state: rg.State, prompts: rg.Prompts):
        ro = rg.generate(state.policy, prompts, n=4)
        greedy = rg.generate(state.policy, prompts, n=1, temperature=0.0)
        r, greedy_r = rg.score(state.reward, ro), rg.score(state.reward, greedy)
        lp = rg.logprobs(state.policy, greedy)
        return state, {"adv": (r - greedy_r[ro.group]).mean(), "lp": lp.mean()}

    text = str(baseline.trace())
    assert "Rollouts[B,T] = generate[n=1" in text and "f32[B] = score reward" in text
    assert "f32[B,T] = logprobs" in text and "f32[N] = getitem" in text

    @rg.algorithm
    def bad(state: rg.State, prompts: rg.Prompts):
        ro = rg.generate(state.policy, prompts, n=4)
        greedy = rg.generate(state.policy, prompts, n=1, temperature=0.0)
        adv = rg.score(state.reward, ro) - rg.score(state.reward, greedy)  # E-rows
        return state, {"adv": adv.mean()}

    with pytest.raises(SpecError) as exc:
        bad.trace()
    assert_points_at(exc, "E-rows")
    assert "f32[N]" in str(exc.value) and "f32[B]" in str(exc.value)


def _trace_with(use):
    @rg.algorithm
    def algo(state: rg.State, prompts: rg.Prompts):
        ro = rg.generate(state.policy, prompts, n=4)
        r = rg.score(state.reward, ro)
        use(r, ro)  # E-use
        return state, {"r": r.mean()}

    return algo


@pytest.mark.parametrize("use, what", [(lambda r, ro: r.mean().item(), ".item()"), (lambda r, ro: r.numpy(), ".numpy()"),
                                       (lambda r, ro: ro.logprobs.tolist(), ".tolist()")])
def test_python_value_of_a_traced_value_gets_its_own_message(use, what):
    with pytest.raises(TraceError) as exc:
        _trace_with(use).trace()
    assert not isinstance(exc.value, SpecError) and "mismatch" not in str(exc.value)
    assert f"{what} asks for the Python value of a traced value" in str(exc.value)


@pytest.mark.parametrize("use, what", [(lambda r, ro: r[r > 0], "boolean indexing"),
                                       (lambda r, ro: ro.logprobs[ro.mask], "boolean indexing"),
                                       (lambda r, ro: torch.unique(r), "unique"),
                                       (lambda r, ro: torch.nonzero(r), "nonzero"),
                                       (lambda r, ro: torch.masked_select(r, r > 0), "masked_select")])
def test_data_dependent_shapes_are_named_as_such_not_as_a_mismatch(use, what):
    with pytest.raises(TraceError) as exc:
        _trace_with(use).trace()
    text = str(exc.value)
    assert what in text and "data-dependent shape" in text and "mismatch" not in text, text
    assert "fix: keep the shape and mask instead" in text


def test_an_integer_index_is_still_a_plain_op():
    _trace_with(lambda r, ro: ro.logprobs[:, 0] + r).trace()

"""The `gkd` algorithm: on-policy (lam=1), mixed (one optimizer step over the student's and the
teacher's sequences, weighted lam and 1 - lam), teacher-only (lam=0), and its refusals."""

import pytest

from rlgraph.algorithms import gkd
from rlgraph.errors import TraceError
from rlgraph.runtime.eager import Interpreter
from tests.algorithms._steps import two_steps
from tests.algorithms.test_distill import with_teachers
from tests.helpers import prompts


def test_on_policy_gkd_trains_on_the_students_sequences():
    text, metrics = two_steps(gkd, executor=with_teachers("teacher"), n=2, beta=0.5, max_new_tokens=4)
    assert "gkd_loss[beta=0.5]" in text and "generate" in text and "optimizer_step" not in text
    assert metrics["policy/jsd"] > 0 and metrics["policy/importance_weight"] == pytest.approx(1.0, abs=1e-3)


def test_mixed_gkd_accumulates_both_sources_into_one_optimizer_step():
    program = gkd.trace(n=2, lam=0.25, beta=0.0, max_new_tokens=4)
    text = str(program)
    assert "generate[n=2 temperature=1.0 top_p=1.0 max_new_tokens=4 stop=()] teacher prompts" in text
    assert text.count("step=False") == 2 and "mul 0.25" in text and "mul 0.75" in text
    assert "optimizer_step[lr=None betas=None eps=None weight_decay=None grad_clip=1.0]" in text
    executor = with_teachers("teacher")
    state, metrics = Interpreter(executor).run(program, prompts(3))
    assert metrics["gkd/student_tokens"] > 0 and metrics["gkd/teacher_tokens"] > 0 and metrics["policy/grad_norm"] > 0


def test_teacher_only_gkd_is_supervised_distillation_on_teacher_samples():
    text = str(gkd.trace(n=2, lam=0.0, beta=1.0))
    assert "] teacher prompts" in text and "] policy prompts" not in text and "optimizer_step" not in text


@pytest.mark.parametrize(("hparams", "message"), [
    (dict(beta=1.5), "beta=1.5"), (dict(beta=-0.1), "beta=-0.1"), (dict(beta="half"), "beta='half'"),
    (dict(lam=2.0), "lam=2.0"), (dict(lam=None), "lam=None"), (dict(n=0), "n=0"),
])
def test_bad_hyper_parameters_are_refused_at_the_line(hparams, message):
    with pytest.raises(TraceError, match=message):
        gkd.trace(**hparams)

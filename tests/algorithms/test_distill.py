"""The `distill` algorithm: its program, two eager steps with a teacher of its own weights, several
teachers, a task reward mixed in, the refusals, and the reverse KL falling as the student learns."""

import pytest
import torch

import rlgraph as rg
from rlgraph.api import DEFAULT_ROLES
from rlgraph.algorithms import distill
from rlgraph.backends.local.state import LMWorker
from rlgraph.backends.local.models import build_causal_lm
from rlgraph.errors import TraceError
from rlgraph.runtime.eager import Interpreter
from tests.algorithms._steps import two_steps
from tests.helpers import TOKENIZER, make_executor, parity_reward, prompts

SHARPEN = 8.0
TWO_TEACHERS = {**DEFAULT_ROLES, "teacher_b": rg.lm("teacher_b")}


def with_teachers(*roles, lr=1e-3, reward=parity_reward):
    """The tiny policy and, for each role, a frozen teacher drawn with its own seed, its output layer
    scaled up so it is far from uniform (two random tiny models are both near uniform: KL ~ 0)."""
    executor = make_executor(lr=lr, reward=reward, max_new_tokens=4)
    for seed, role in enumerate(roles, start=11):
        teacher = build_causal_lm(tokenizer=TOKENIZER, seed=seed).requires_grad_(False)
        teacher.get_output_embeddings().weight.mul_(SHARPEN)
        executor.models[role] = LMWorker(teacher)
    return executor


def test_the_teacher_scores_the_students_tokens_and_the_student_trains():
    text, metrics = two_steps(distill, executor=with_teachers("teacher"), n=2, max_new_tokens=4)
    assert "logprobs[temperature=1.0 entropy=False] teacher a" in text and "distill_advantage" in text
    assert "score" not in text  # no task reward unless asked
    assert metrics["distill/reverse_kl"] > 0 and 0.0 <= metrics["policy/clip_frac"] <= 1.0


def test_several_teachers_with_weights_and_a_task_reward():
    program = distill.trace(roles=TWO_TEACHERS, teachers=("teacher", "teacher_b"), teacher_weights=(0.25, 0.75),
                            reward_weight=0.5, n=2, max_new_tokens=4)
    text = str(program)
    assert "teacher a" in text and "teacher_b a" in text and "mul 0.25" in text and "mul 0.75" in text
    assert "score reward a" in text and "group_normalize" in text
    state, metrics = Interpreter(with_teachers("teacher", "teacher_b")).run(program, prompts(3))
    assert set(metrics) >= {"distill/reverse_kl", "reward", "policy/loss"}


@pytest.mark.parametrize(("hparams", "message"), [
    (dict(teachers=()), "must be a tuple of distinct state role names"),
    (dict(teachers=("teacher", "teacher")), "must be a tuple of distinct state role names"),
    (dict(teachers=("policy",)), "other than 'policy'"),
    (dict(teacher_weights=(0.5, 0.5)), "needs one weight per teacher"),
    (dict(teachers=("teacher", "teacher_b"), teacher_weights=(0.5, 0.6)), "sum to 1.1, not 1"),
    (dict(teachers=("teacher", "teacher_b"), teacher_weights=(-0.5, 1.5)), r"teacher_weights\[0\]=-0.5"),
    (dict(reward_weight=-1.0), "reward_weight=-1.0"),
    (dict(reward_weight=1.0, n=1), "n=1"),
    (dict(teachers=("techer",)), "state has no field 'techer'"),
])
def test_bad_hyper_parameters_are_refused_at_the_line(hparams, message):
    with pytest.raises(TraceError, match=message):
        distill.trace(roles=TWO_TEACHERS, **hparams)


def test_the_reverse_kl_to_the_teacher_falls():
    """20 steps of 4 prompts x 4 samples, AdamW lr 1e-2: the student moves to a sharp random teacher
    (seed 0: the token-mean reverse KL goes from ~5.8 over the first 5 steps to ~0 over the last 5)."""
    executor = with_teachers("teacher", lr=1e-2)
    program, interpreter = distill.trace(n=4, max_new_tokens=4), Interpreter(executor)
    kls = []
    for step in range(20):
        _, metrics = interpreter.run(program, prompts(4, offset=4 * step))
        kls.append(metrics["distill/reverse_kl"])
    first, last = sum(kls[:5]) / 5, sum(kls[-5:]) / 5
    assert last < 0.5 * first, kls

"""The `gkd` algorithm: on-policy (lam=1), mixed (one optimizer step over the student's and the
teacher's sequences, weighted lam and 1 - lam), teacher-only (lam=0), and its refusals."""

import math

import pytest
import torch

import rlgraph as rg
from rlgraph.algorithms import gkd
from rlgraph.algorithms.gkd import teacher_vocabulary, vocab_jsd_loss
from rlgraph.errors import TraceError
from rlgraph.runtime.eager import Interpreter
from tests.algorithms._steps import two_steps
from tests.algorithms.test_distill import TWO_TEACHERS, with_teachers
from tests.helpers import params_of, prompts


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
    (dict(vocab="yes"), "vocab='yes'"), (dict(vocab=1), "vocab=1"), (dict(vocab=None), "vocab=None"),
])
def test_bad_hyper_parameters_are_refused_at_the_line(hparams, message):
    with pytest.raises(TraceError, match=message):
        gkd.trace(**hparams)


@rg.algorithm
def vocabulary_step(state: rg.State, ro: rg.Rollouts, *, beta=0.5):
    """gkd's vocab=True update on given rollouts (the one teacher, share 1)."""
    loss = vocab_jsd_loss(ro, teacher_vocabulary(state, ro, ("teacher",), (1.0,), 1.0), beta, 1.0)
    return state.replace(policy=rg.update(state.policy, ro, loss, grad_clip=None, vocab=True)), {}


def full_distribution(model, ro):
    """log softmax of the model's own logits at each response position [N, T, V] (a plain HF forward)."""
    width, steps = ro.prompt_ids.shape[1], ro.response_ids.shape[1]
    ids = torch.cat([ro.prompt_ids, ro.response_ids], 1)
    mask = torch.cat([ro.prompt_mask, ro.mask], 1).long()
    logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    return logits[:, width - 1 : width - 1 + steps].float().log_softmax(-1)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_vocabulary_gkd_takes_the_exact_jsd_over_the_vocabulary_and_its_gradient(beta):
    """One SGD step (lr 0.1) of the vocab=True loss against JSD_beta written out by hand over every
    vocabulary entry of every real response token, from plain HF forwards: the logged loss is that
    JSD's token mean and the step is -lr times its autograd gradient."""
    executor = with_teachers("teacher")
    student = executor.models["policy"].model
    executor.models["policy"].optimizer = torch.optim.SGD(student.parameters(), lr=0.1)
    ro = executor.generate(executor.current("policy"), prompts(3), n=2, max_new_tokens=4)  # Rollouts[6, 4]
    with torch.no_grad():
        t = full_distribution(executor.models["teacher"].model.eval(), ro)  # [6, 4, V] log t
    before = [p.detach().clone() for p in student.parameters()]
    s = full_distribution(student.eval(), ro)  # [6, 4, V] log s, with gradients
    m = (beta * t.exp() + (1 - beta) * s.exp()).log()  # [6, 4, V] log of the mixture
    kl = lambda p, q: (p.exp() * (p - q)).sum(-1)  # noqa: E731  KL(p || q) from logs, [6, 4]
    per_token = kl(t, s) if beta == 0 else kl(s, t) if beta == 1 else beta * kl(t, m) + (1 - beta) * kl(s, m)
    want = per_token[ro.mask].mean()  # token_mean over the real tokens
    grads = torch.autograd.grad(want, list(student.parameters()))
    program = vocabulary_step.trace(beta=beta)
    text = str(program)
    assert "vocab=True" in text and "f32[N,T,V]" in text and f"generalized_jsd[beta={beta}]" in text
    _, metrics = Interpreter(executor).run(program, ro)
    assert metrics["policy/jsd"] == pytest.approx(want.item(), rel=1e-5) and math.isfinite(metrics["policy/grad_norm"])
    # float32 forwards of the same weights in two orders: ~1e-7 relative per gradient element, times lr 0.1
    for old, new, grad in zip(before, student.parameters(), grads):
        torch.testing.assert_close(new.detach(), old - 0.1 * grad, rtol=0, atol=1e-6)


def test_vocabulary_gkd_mixing_both_sources_and_two_teachers_trains():
    program = gkd.trace(roles=TWO_TEACHERS, n=2, lam=0.5, vocab=True, teachers=("teacher", "teacher_b"),
                        teacher_weights=(0.5, 0.5), max_new_tokens=4)
    text = str(program)
    # per source: each teacher's [N,T,V] log-probs, their mixture renormalised, an update on the student's [N,T,V]
    assert text.count("f32[N,T,V] = logprobs[temperature=1.0 entropy=False vocab=True]") == 4
    assert text.count("log_softmax[dim=-1]") == 2 and text.count("lambda vocab_lp:f32[N,T,V]") == 2
    assert "optimizer_step" in text
    executor = with_teachers("teacher", "teacher_b")
    before = params_of(executor)
    _, metrics = Interpreter(executor).run(program, prompts(3))
    assert metrics["gkd/student_tokens"] > 0 and metrics["gkd/teacher_tokens"] > 0 and metrics["policy/grad_norm"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, params_of(executor)))


def test_the_plan_moves_and_counts_the_teachers_vocabulary_distribution():
    """Split placement, B=32 n=4 T=5, V=47 (the shipped tokenizer): the teacher's f32[N,T,V] is sent
    to the student's rank, 4*128*5*47 bytes, and both ranks' memory grows by the [rows,T,V] tensors."""
    def plan(vocab):
        return rg.compile(gkd, mesh="cpu:2", placement=rg.split({"policy": 1, "teacher": 1}), max_new_tokens=5,
                          sizes={"B": 32, "P": 8, "T": 5}, n=4, lam=1.0, beta=0.0, vocab=vocab)
    sampled, full = plan(False), plan(True)
    assert "send_recv  logprobs:f32[N,T,V]  teacher -> policy  117.5 KiB" in full.as_text()  # 120,320 bytes
    grown = {(group, phase): full.plan.memory[group][phase]["activations"] - sampled.plan.memory[group][phase]["activations"]
             for group, phase in (("teacher", "infer"), ("policy", "train"))}
    assert grown == {("teacher", "infer"): 2 * 4 * 128 * 5 * 47, ("policy", "train"): 3 * 4 * 128 * 5 * 47}

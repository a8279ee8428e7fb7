"""Distillation on the `spmd` transport against the same plan run in one process from the same
weights: the teacher on a rank of its own (split), or colocated with an FSDP2-sharded student."""

from __future__ import annotations

import pytest

import rlgraph as rg
from rlgraph.algorithms import distill, gkd
from rlgraph.backends.local.models import build_causal_lm, load_tokenizer
from rlgraph.backends.world import RoleSpec, WorldSpec
from rlgraph.runtime.plan_runner import PlanRunner
from rlgraph.testing.tiny import length_parity_reward, tiny_prompts

from tests.runtime.test_spmd import _matches_local

pytestmark = pytest.mark.slow
TOKENS = 4


def _teacher_world(tmp_path) -> WorldSpec:
    """A saved random teacher far from the student (both random: their KL is ~0 otherwise) and an SGD student."""
    teacher = build_causal_lm(tokenizer=load_tokenizer(), seed=5)
    teacher.get_output_embeddings().weight.data.mul_(8.0)
    teacher.save_pretrained(tmp_path)  # a model directory, as `model.teachers` names one
    return WorldSpec({"policy": RoleSpec(optimizer="sgd", lr=0.1), "teacher": RoleSpec(source=str(tmp_path))},
                     {"reward": length_parity_reward}, max_new_tokens=TOKENS)


def test_distill_with_the_teacher_on_its_own_rank_matches_local(tmp_path):
    world = _teacher_world(tmp_path)
    compiled = rg.compile(distill, mesh="cpu:2", placement=rg.split({"policy": 1, "teacher": 1}),
                          sizes={"B": 4, "P": 8, "T": TOKENS}, max_new_tokens=TOKENS, n=2)
    text = compiled.as_text()
    assert "teacher   rank 1       infer dp=1" in text and "@teacher   logprobs=logprobs" in text
    assert "teacher   infer" in text  # its memory, counted on its rank
    prompts = tiny_prompts(4)
    assert PlanRunner(compiled, world.build_local()).run(prompts)[1]["distill/reverse_kl"] > 0.1  # a real signal
    _matches_local(compiled, world, prompts, steps=2)  # equal metrics each step, equal student weights after


def test_full_vocabulary_gkd_mixing_both_sources_on_two_fsdp_ranks_with_a_colocated_teacher_matches_local(tmp_path):
    # 0 < lam < 1: two accumulated updates (the student's and the teacher's sequences), then one
    # `optimizer_step` on the FSDP2 shards; the teacher colocated on both ranks, generating too (its
    # engine built with its weights), and the [N,T,V] distributions of both through FSDP2's root.
    world = _teacher_world(tmp_path)
    compiled = rg.compile(gkd, mesh="cpu:2", placement=rg.colocated(offload=True, checkpointing=False),
                          sizes={"B": 4, "P": 8, "T": TOKENS}, max_new_tokens=TOKENS, n=2, lam=0.5, beta=0.5, vocab=True)
    text = compiled.as_text()
    assert "optimizer_step" in text and "offload" in text and "generate   @teacher" in text
    reports = _matches_local(compiled, world, tiny_prompts(4), steps=2)
    assert all(report["local_numel"] < 0.6 * report["global_numel"] for report in reports.values())  # FSDP2 shards

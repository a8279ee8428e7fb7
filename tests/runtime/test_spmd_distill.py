"""Distillation on the `spmd` transport: the teacher on a rank of its own (split), the student on
the other, against the same plan run in one process from the same weights."""

from __future__ import annotations

import pytest

import rlgraph as rg
from rlgraph.algorithms import distill
from rlgraph.backends.local.models import build_causal_lm, load_tokenizer
from rlgraph.backends.world import RoleSpec, WorldSpec
from rlgraph.runtime.plan_runner import PlanRunner
from rlgraph.testing.tiny import length_parity_reward, tiny_prompts

from tests.runtime.test_spmd import _matches_local

pytestmark = pytest.mark.slow
TOKENS = 4


def test_distill_with_the_teacher_on_its_own_rank_matches_local(tmp_path):
    teacher = build_causal_lm(tokenizer=load_tokenizer(), seed=5)
    teacher.get_output_embeddings().weight.data.mul_(8.0)  # far from the student (both random: KL ~ 0 otherwise)
    teacher.save_pretrained(tmp_path)  # a model directory, as `model.teachers` names one
    world = WorldSpec({"policy": RoleSpec(optimizer="sgd", lr=0.1), "teacher": RoleSpec(source=str(tmp_path))},
                      {"reward": length_parity_reward}, max_new_tokens=TOKENS)
    compiled = rg.compile(distill, mesh="cpu:2", placement=rg.split({"policy": 1, "teacher": 1}),
                          sizes={"B": 4, "P": 8, "T": TOKENS}, max_new_tokens=TOKENS, n=2)
    text = compiled.as_text()
    assert "teacher   rank 1       infer dp=1" in text and "@teacher   logprobs=logprobs" in text
    assert "teacher   infer" in text  # its memory, counted on its rank
    prompts = tiny_prompts(4)
    assert PlanRunner(compiled, world.build_local()).run(prompts)[1]["distill/reverse_kl"] > 0.1  # a real signal
    _matches_local(compiled, world, prompts, steps=2)  # equal metrics each step, equal student weights after

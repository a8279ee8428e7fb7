"""Distillation on the `spmd` transport: the teacher on a rank of its own (split), the student on
the other, against the same plan run in one process from the same weights."""

from __future__ import annotations

import pytest

import rlgraph as rg
from rlgraph.algorithms import distill
from rlgraph.backends.local.models import build_causal_lm, load_tokenizer
from rlgraph.backends.world import RoleSpec, WorldSpec
from rlgraph.runtime.plan_runner import PlanRunner
from rlgraph.runtime.spmd import SpmdTransport
from rlgraph.testing.tiny import length_parity_reward, tiny_prompts

from tests.helpers import assert_same_metrics, assert_same_training, state_of

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
    local_executor, prompts = world.build_local(), tiny_prompts(4)
    before = state_of(local_executor.models["policy"])
    with SpmdTransport(compiled.plan, world, device="cpu") as transport:
        for _ in range(2):
            local = PlanRunner(compiled, local_executor).run(prompts)[1]
            spmd = PlanRunner(compiled, transport, controller=world.controller()).run(prompts)[1]
            assert_same_metrics(local, spmd)
            assert local["distill/reverse_kl"] > 0.1
        assert_same_training(local_executor.models["policy"], transport.pull_state("policy"), before, steps=2)

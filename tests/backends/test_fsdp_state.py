"""Checkpoints of FSDP2 roles: the ranks' parts merge into one full state, which loads back.

The merge is plain data (two ranks written out here); the export and import run on a one-rank
gloo job (several ranks, resumed on fresh workers: tests/runtime/test_spmd.py).
"""

from __future__ import annotations

import pickle

import pytest
import torch

import rlgraph as rg
from rlgraph.algorithms import ALGORITHMS
from rlgraph.backends.fsdp.state import full_weights, merge_rank_states
from rlgraph.backends.protocols import ExecutorState
from rlgraph.backends.world import RoleSpec, WorldSpec


def _part(model, group, optimizer, version=3):
    return {"model": model, "group": group, "version": version, "optimizer": optimizer, "optimizer_kind": "adamw"}


def _adam(step, exp_avg):
    return {"state": {0: {"step": torch.tensor(step), "exp_avg": torch.tensor(exp_avg)}}, "param_groups": [{"lr": 0.1}]}


def test_two_ranks_shards_merge_in_the_groups_rank_order():
    weights = {"w": torch.arange(3.0)}
    parts = {  # rank 1 gathered the weights (it is first in the group's order), rank 0 holds the second shard
        0: {"roles": {"policy": _part(None, [1, 0], _adam(2.0, [3.0])), "ref": _part({"r": torch.ones(1)}, [0], None, 0)},
            "shuffle_rng": torch.tensor([7]), "sampling": {"seed": 1, "calls": 4}},
        1: {"roles": {"policy": _part(weights, [1, 0], _adam(2.0, [1.0, 2.0]))},
            "shuffle_rng": torch.tensor([9]), "sampling": {"seed": 1, "calls": 4}},
    }
    state = merge_rank_states(parts)
    assert isinstance(state, ExecutorState) and sorted(state.roles) == ["policy", "ref"]
    policy = state.roles["policy"]
    assert policy.model is weights and policy.version == 3 and policy.optimizer_kind == "adamw"
    assert torch.equal(policy.optimizer["state"][0]["exp_avg"], torch.tensor([1.0, 2.0, 3.0]))  # rank 1's rows, then 0's
    assert float(policy.optimizer["state"][0]["step"]) == 2.0  # a scalar: the same on every rank, not concatenated
    assert state.roles["ref"].optimizer is None  # a frozen role
    assert torch.equal(state.shuffle_rng, torch.tensor([7])) and state.sampling == {"seed": 1, "calls": 4}


def test_full_weights_come_from_the_rank_that_gathered_them():
    weights = {"w": torch.ones(2)}
    assert full_weights("policy", {0: None, 1: weights, 2: None}) == weights
    with pytest.raises(rg.RLGraphError, match="no rank holds role 'critic'"):
        full_weights("critic", {0: None, 1: None})


def _one_rank_executor():
    plan = rg.compile(ALGORITHMS["grpo"], mesh="cpu:1", placement=rg.colocated(checkpointing=False),
                      sizes={"B": 2, "P": 8, "T": 4}, n=2, max_new_tokens=4).plan
    world = WorldSpec({"policy": RoleSpec(optimizer="adamw", lr=0.1)}, max_new_tokens=4, fsdp_unit_params=0)
    return world, world.build(0, plan, torch.device("cpu"))


def _step(executor) -> None:
    """One optimizer step on every parameter (AdamW: the weights move and the state fills)."""
    worker = executor.models["policy"]
    for param in worker.model.parameters():
        param.grad = torch.ones_like(param)
    worker.optimizer.step()


def test_a_checkpoint_taken_through_the_world_loads_back_exactly(gloo):
    world, executor = _one_rank_executor()
    _step(executor)
    # The part travels pickled, as over a pipe or a Ray call (in-process, one rank's gathered CPU
    # tensors may share storage with its live shards).
    state = world.merge_states({0: pickle.loads(pickle.dumps(executor.export_state()))})
    saved = {name: value.clone() for name, value in state.roles["policy"].model.items()}
    assert saved.keys() == world.full_weights("policy", {0: executor.full_state("policy")}).keys()
    _step(executor)
    assert not all(torch.equal(value, saved[name]) for name, value in executor.full_state("policy").items())
    executor.import_state(state, "a test")
    assert all(torch.equal(value, saved[name]) for name, value in executor.full_state("policy").items())
    assert torch.equal(executor.models["policy"].optimizer.state_dict()["state"][0]["exp_avg"],
                       state.roles["policy"].optimizer["state"][0]["exp_avg"])


def test_the_sampling_stream_of_a_checkpoint_is_the_generating_ranks_not_rank_0s():
    # issue 32: on a split placement rank 0 trains and never samples (calls 0), rank 1 generates; a
    # checkpoint that kept rank 0's stream made a resumed run sample other tokens than the uninterrupted one.
    from rlgraph.backends.fsdp.state import sampling_stream

    parts = {0: {"sampling": {"seed": 7, "calls": 0}}, 1: {"sampling": {"seed": 7, "calls": 3}}}
    assert sampling_stream(parts) == {"seed": 7, "calls": 3}
    colocated = {0: {"sampling": {"seed": 7, "calls": 2}}, 1: {"sampling": {"seed": 7, "calls": 2}}}
    assert sampling_stream(colocated) == {"seed": 7, "calls": 2}

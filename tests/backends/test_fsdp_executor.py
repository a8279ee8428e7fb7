"""The FSDP2 executor shards a role as its train layout says (one gloo process; several ranks:
tests/runtime/test_spmd.py)."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

import rlgraph as rg
from rlgraph.algorithms import ALGORITHMS
from rlgraph.backends.fsdp.shards import on_host
from rlgraph.backends.world import RoleSpec, WorldSpec


def _policy_units(cpu_offload: bool) -> list[FSDPModule]:
    plan = rg.compile(ALGORITHMS["grpo"], mesh="cpu:1", placement=rg.colocated(checkpointing=False, cpu_offload=cpu_offload),
                      sizes={"B": 2, "P": 8, "T": 4}, n=2, max_new_tokens=4).plan
    world = WorldSpec({"policy": RoleSpec(optimizer="adamw")}, max_new_tokens=4, fsdp_unit_params=0)
    executor = world.build(0, plan, torch.device("cpu"))
    assert on_host(executor.models["policy"])  # a CPU device: the shards are host memory either way
    return [unit for unit in executor.models["policy"].model.modules() if isinstance(unit, FSDPModule)]


def _offload_policy(unit: FSDPModule) -> object:
    return unit._get_fsdp_state()._fsdp_param_group.offload_policy  # FSDP2 has no public getter


def test_every_fsdp2_unit_of_a_cpu_offload_role_gets_the_cpu_offload_policy(gloo):
    units = _policy_units(cpu_offload=True)
    assert len(units) == 3  # two decoder layers and the root
    assert all(_offload_policy(unit) == CPUOffloadPolicy(pin_memory=False) for unit in units)  # pinning needs CUDA


def test_without_cpu_offload_no_unit_offloads(gloo):
    assert not any(isinstance(_offload_policy(unit), CPUOffloadPolicy) for unit in _policy_units(cpu_offload=False))

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


def _sync_calls(grad_sync: str, micro_batch_size: int | None) -> tuple[list[bool], dict[str, float]]:
    """The `set_requires_gradient_sync` flags one GRPO step sets before each micro-batch's backward."""
    from rlgraph.runtime.plan_runner import PlanRunner
    from rlgraph.testing.tiny import length_parity_reward, tiny_prompts

    compiled = rg.compile(ALGORITHMS["grpo"], mesh="cpu:1", placement=rg.colocated(checkpointing=False, grad_sync=grad_sync),
                          sizes={"B": 4, "P": 8, "T": 4}, n=4, max_new_tokens=4, micro_batch_size=micro_batch_size)
    world = WorldSpec({"policy": RoleSpec(optimizer="sgd", lr=0.1)}, {"reward": length_parity_reward}, max_new_tokens=4)
    executor = world.build(0, compiled.plan, torch.device("cpu"))
    root = executor.models["policy"].model
    calls: list[bool] = []
    original = root.set_requires_gradient_sync
    root.set_requires_gradient_sync = lambda sync, **kw: (calls.append(sync), original(sync, **kw))[1]
    metrics = PlanRunner(compiled, executor).run(tiny_prompts(4))[1]
    return calls, metrics


def test_gradients_sync_once_per_optimizer_step_under_grad_sync_last(gloo):
    last, last_metrics = _sync_calls("last", micro_batch_size=4)  # 16 rows: 4 micro-batches
    assert last == [False, False, False, True]
    each, each_metrics = _sync_calls("each", micro_batch_size=4)
    assert each == [True] * 4
    # One rank: the same gradient sums either way (the sharded and unsharded paths add in the same order)
    assert last_metrics["policy/grad_norm"] == each_metrics["policy/grad_norm"] > 0


def test_weights_gathered_in_the_engines_dtype_equal_the_full_weights_cast(gloo):
    # A weight sync moves the engine's dtype (bf16 on CUDA): casting the shards before the all-gather
    # must give exactly the cast full tensors (a cast is elementwise), at half the bytes.
    from rlgraph.backends.fsdp.shards import engine_dtype, gather_full

    params = list(_policy_units(cpu_offload=False)[-1].parameters())
    gathered = gather_full(params, torch.bfloat16)
    for param, full in zip(params, gathered):
        assert full.dtype == torch.bfloat16
        assert torch.equal(full, param.full_tensor().detach().to(torch.bfloat16))
    assert (engine_dtype(torch.device("cuda")), engine_dtype(torch.device("cpu"))) == (torch.bfloat16, torch.float32)


def test_host_buffers_are_allocated_once_and_reused_every_offload():
    """The offload step parks optimizer state in host buffers it keeps (pinned on CUDA: that path is
    untested without a GPU); here the same logic on pageable CPU tensors."""
    from rlgraph.backends.fsdp.shards import HostBuffers

    buffers = HostBuffers(pin=False)
    moment = torch.randn(5, 3)
    parked = buffers.park(("policy", 0, "exp_avg"), moment)
    assert torch.equal(parked, moment) and parked.data_ptr() != moment.data_ptr()
    back = buffers.restore(parked, torch.device("cpu"))
    back.add_(1.0)  # the optimizer steps on the restored copy
    again = buffers.park(("policy", 0, "exp_avg"), back)
    assert again.data_ptr() == parked.data_ptr() and torch.equal(again, moment + 1.0)  # reused, new values
    other = buffers.park(("policy", 0, "exp_avg"), torch.zeros(2, dtype=torch.float64))  # another shape: a new buffer
    assert other.data_ptr() != parked.data_ptr() and other.dtype == torch.float64
    assert len(buffers.buffers) == 1

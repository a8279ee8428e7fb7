"""The demo's GRPO step on the `local` transport and on `spmd` or `ray` (N workers, FSDP2), side by side.

    .venv/bin/python benchmarks/distributed.py [--runtime spmd|ray] [--nproc 2] [--rounds 3] [--steps 10] [--device cpu]

Both sides run the demo configuration (tiny Qwen2, 32 prompts x 8 samples, 5 new tokens, AdamW
1e-4) from the same weights; rounds alternate local and spmd so machine noise hits both. Reports
samples/s and the ratio, where a spmd step's time goes (per plan step), the controller overhead
(the share of a step when the busiest worker is not running a command), the weight sync's
throughput against a plain copy of the same bytes, and on CUDA the offload/onload throughput
against a pinned host copy.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import rlgraph as rg
from rlgraph.algorithms import ALGORITHMS
from rlgraph.backends.world import RoleSpec, WorldSpec
from rlgraph.plan.mesh import Mesh
from rlgraph.plan.plan import Offload, SyncWeights
from rlgraph.runtime.plan_runner import PlanRunner
from rlgraph.runtime.spmd import SpmdTransport, resolve_device
from rlgraph.testing.tiny import length_parity_reward, tiny_prompts

B, N_SAMPLES, TOKENS = 32, 8, 5


def _compile(mesh, offload: bool = False):
    return rg.compile(ALGORITHMS["grpo"], mesh=mesh, placement=rg.colocated(offload=offload, checkpointing=False),
                      sizes={"B": B, "P": 8, "T": TOKENS}, n=N_SAMPLES, max_new_tokens=TOKENS, engine="native")


def _timed_steps(runner: PlanRunner, prompts, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        runner.run(prompts)
    return time.perf_counter() - start


def _copy_seconds(nbytes: int, repeats: int = 50) -> float:
    source = torch.empty(nbytes // 4)
    target = torch.empty_like(source)
    start = time.perf_counter()
    for _ in range(repeats):
        target.copy_(source)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runtime", choices=("spmd", "ray"), default="spmd")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", default="cpu", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the local side (the machine's cores)")
    args = parser.parse_args()
    device = resolve_device(args.device)
    torch.set_num_threads(args.threads)
    world = WorldSpec({"policy": RoleSpec(optimizer="adamw", lr=1e-4)}, {"reward": length_parity_reward}, max_new_tokens=TOKENS)
    prompts = tiny_prompts(B)
    # On CUDA the plan parks optimizer state and gradients in host memory around generation.
    spmd_plan = _compile(Mesh("cpu" if device == "cpu" else "h100", 1, args.nproc), offload=device == "cuda")
    local = PlanRunner(_compile("cpu:1"), world.build_local())
    if args.runtime == "ray":
        from rlgraph.runtime.ray_transport import RayTransport

        transport = RayTransport(spmd_plan.plan, world, device=device)
    else:
        transport = SpmdTransport(spmd_plan.plan, world, device=device)
    with transport:
        spmd = PlanRunner(spmd_plan, transport, controller=world.controller())
        for runner in (local, spmd):  # warm-up: first-call allocations, spawn-time imports
            _timed_steps(runner, prompts, 2)
            runner.step_seconds.clear()
        transport.busy_s = [0.0] * transport.world
        transport.step_busy.clear()
        times = {"local": [], "spmd": []}
        for _ in range(args.rounds):
            times["local"].append(_timed_steps(local, prompts, args.steps))
            times["spmd"].append(_timed_steps(spmd, prompts, args.steps))
        _report(args, times, spmd, transport)


def _report(args, times, spmd: PlanRunner, transport) -> None:
    steps = args.rounds * args.steps
    rate = {side: B * N_SAMPLES * args.steps / statistics.median(values) for side, values in times.items()}
    print(f"samples/s  local {rate['local']:,.0f}  {args.runtime} x{args.nproc} {rate['spmd']:,.0f}  "
          f"ratio {args.runtime}/local {rate['spmd'] / rate['local']:.2f}  (median of {args.rounds} rounds x {args.steps} steps)")
    wall = sum(times["spmd"])
    print(f"controller overhead: {1 - max(transport.busy_s) / wall:.1%} of a {args.runtime} step "
          f"(busiest worker busy {max(transport.busy_s) / steps * 1e3:.1f} ms of {wall / steps * 1e3:.1f} ms)")
    print(f"{args.runtime} plan steps (ms/iteration): controller time (dispatch, or the whole step when it runs there) "
          "| busiest worker's time on the step's commands")
    for index, seconds in sorted(spmd.step_seconds.items()):
        busy = max(transport.step_busy.get(index, [0.0]))
        print(f"  {spmd.compiled.plan.steps[index].text().splitlines()[0][:66]:<66} {seconds / steps * 1e3:7.2f} "
              f"| {busy / steps * 1e3:7.2f}")
    sync = next(step for step in spmd.compiled.plan.steps if isinstance(step, SyncWeights))
    sync_s = max(transport.step_busy[sync.index]) / steps
    copy_s = _copy_seconds(sync.bytes)
    print(f"weight sync: {sync.bytes / 1e6:.2f} MB in {sync_s * 1e3:.2f} ms = {sync.bytes / sync_s / 1e9:.2f} GB/s; "
          f"a plain copy of the same bytes {sync.bytes / copy_s / 1e9:.2f} GB/s (sync/copy {copy_s / sync_s:.3f})")
    if transport.device == "cuda":
        for step in spmd.compiled.plan.steps:
            if isinstance(step, Offload):
                seconds = max(transport.step_busy[step.index]) / steps
                print(f"{step.direction}: {step.bytes / 1e6:.2f} MB in {seconds * 1e3:.2f} ms = {step.bytes / seconds / 1e9:.2f} GB/s")
        _pinned_round_trip(sync.bytes)


def _pinned_round_trip(nbytes: int) -> None:
    """Device -> pinned host -> device for `nbytes`, the bound an offload/onload can reach (CUDA only)."""
    device_buffer = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    host = torch.empty_like(device_buffer, device="cpu").pin_memory()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        host.copy_(device_buffer, non_blocking=True)
        device_buffer.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    print(f"pinned round trip: {2 * 20 * nbytes / (time.perf_counter() - start) / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()

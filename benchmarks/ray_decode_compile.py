"""Ray actors with `generation.compile=on` sample the eager tokens, compile once per rank, and read
Inductor's disk cache on a second run (what tests/runtime/test_spmd.py checks on the spmd transport;
a check run by hand, not in `make test`, whose time it would add a minute to). Figures: docs/distributed.md.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/ray_decode_compile.py --cache /tmp/ray_decode_inductor
"""
import argparse
import os
import time

import attrs
import ray

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--cache", default="/tmp/ray_decode_inductor", help="TORCHINDUCTOR_CACHE_DIR (empty: a cold compile)")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = parser.parse_args().cache  # before torch is imported; the actors inherit it
import rlgraph as rg  # noqa: E402
from rlgraph.algorithms import ALGORITHMS  # noqa: E402
from rlgraph.backends.local.decode_compile import read_records  # noqa: E402
from rlgraph.backends.world import RoleSpec, WorldSpec  # noqa: E402
from rlgraph.runtime.plan_runner import PlanRunner  # noqa: E402
from rlgraph.runtime.ray_transport import RayTransport  # noqa: E402
from rlgraph.testing.tiny import length_parity_reward, tiny_prompts  # noqa: E402

TOKENS = 4
completions: dict[str, list[str]] = {}


def recording(run: str):
    def reward(texts: list[str], **meta) -> list[float]:  # scored on the controller: this process
        completions.setdefault(run, []).extend(texts)
        return length_parity_reward(texts, **meta)
    return reward


compiled = rg.compile(ALGORITHMS["grpo"], mesh="cpu:2", placement=rg.colocated(offload=False, checkpointing=False),
                      sizes={"B": 4, "P": 8, "T": TOKENS}, max_new_tokens=TOKENS, n=2)
prompts = tiny_prompts(4)
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
for run, mode in (("eager", "off"), ("compiled, cold or warm cache", "on"), ("compiled again, warm cache", "on")):
    world = WorldSpec({"policy": RoleSpec(optimizer="sgd", lr=0.1)}, {"reward": recording(run)},
                      max_new_tokens=TOKENS, decode_compile=mode)
    start = time.perf_counter()
    with RayTransport(compiled.plan, world, device="cpu") as transport:
        PlanRunner(compiled, transport, controller=world.controller()).run(prompts)
    print(f"{run}: one GRPO step on 2 Ray actors in {time.perf_counter() - start:.1f} s (actor start-up included)")
ray.shutdown()
same = all(texts == completions["eager"] for texts in completions.values())
print(f"the compiled actors sampled the eager completions: {same} ({len(completions['eager'])} completions a run)")
print("compile seconds by shape (one entry a rank a compiled run):", read_records())
raise SystemExit(0 if same else 1)

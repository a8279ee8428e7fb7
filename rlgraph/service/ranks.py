"""Where the service's tenants live, seen from the server: in its own process, or on worker ranks.

Both answer the same two things: `call(name, ...)`, a tenant command (`host.COMMANDS`) run
wherever the tenants live (on every rank: each holds every adapter), answered by the first rank
(the ranks agree: the adapters are whole and stepped alike); and `run(compiled, batch)`, a call's
plan executed by the one plan runner (`PlanRunner`), whose outputs the plan gathers from every
data-parallel rank (its `gather` steps). `dp` is how many data-parallel ranks a batch is split over.

    ranks = SpmdRanks("tiny", nproc=2, plan=compiled.plan)   # 2 worker processes, the base sharded
    ranks.call("create", "t1", LoraSpec(rank=8), 16)
    ranks.call("use", "t1", keep="grads"); ranks.run(plan, rollouts); ranks.call("done")
"""

from __future__ import annotations

from typing import Any

from rlgraph.service import programs
from rlgraph.service.host import ServiceWorld, TenantHost


class LocalRanks:
    """The tenants in the server's process (the local runtime)."""

    dp = 1

    def __init__(self, host: TenantHost):
        self.host = host

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.host, name)(*args, **kwargs)

    def run(self, compiled: Any, batch: Any) -> tuple[dict[str, float], dict[str, Any]]:
        return programs.run(compiled, self.host, batch)

    def close(self) -> None:
        self.host.close()


class SpmdRanks:
    """The tenants on `nproc` worker processes (`runtime="spmd"`: `SpmdTransport`) or Ray actors
    (`"ray"`: `RayTransport`, a local cluster or the one `ray.init` joined), each holding its FSDP2
    shard of the base and every adapter whole; the same commands reach either. `plan`: any plan of
    the service on the ranks' mesh (the transport sizes its workers by it)."""

    def __init__(self, model: str, *, nproc: int, plan: Any, seed: int = 0, device: str = "cpu", tokenizer: Any = None,
                 runtime: str = "spmd"):
        from rlgraph.backends.local.executor import LocalExecutor
        from rlgraph.runtime.ray_transport import RayTransport
        from rlgraph.runtime.spmd import SpmdTransport

        self.dp = nproc
        transport = {"spmd": SpmdTransport, "ray": RayTransport}[runtime]
        self.transport = transport(plan, ServiceWorld(model, seed), device=device)
        # The controller runs only the plans' math between gathers: an executor without models.
        self.controller = LocalExecutor({}, {}, tokenizer)

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self.transport.command(name, *args, **kwargs)[0]

    def run(self, compiled: Any, batch: Any) -> tuple[dict[str, float], dict[str, Any]]:
        from rlgraph.runtime.plan_runner import PlanRunner

        runner = PlanRunner(compiled, self.transport, controller=self.controller)
        _, metrics = runner.run(batch)
        return metrics, runner.outputs

    def close(self) -> None:
        self.transport.close()

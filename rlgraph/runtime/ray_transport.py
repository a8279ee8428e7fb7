"""The `ray` transport: each mesh rank is a Ray actor, placed by a Ray placement group.

    transport = RayTransport(compiled.plan, world, address="auto")   # join `ray start --head` ...
    transport = RayTransport(compiled.plan, world)                   # ... or start a local cluster
    runner = PlanRunner(compiled, transport, controller=world.controller())

The controller is the Ray driver (this process). The plan's ranks get one placement group with a
bundle per rank (`{"CPU": k}`, plus `{"GPU": 1}` on CUDA), packed onto as few nodes as possible
(`PACK`), so ranks that share a node are consecutive, as the mesh numbers them node-major. Each
rank is one actor holding one `Worker` (every role the plan places on that rank: colocated roles
share the actor). The actors form one torch.distributed process group (gloo on CPU, NCCL on CUDA)
with rank 0's node as the rendezvous; it carries FSDP2, the plan's rank-to-rank moves and weight
syncs, exactly as in the spmd transport. Commands, pipelining and failure reports are the shared
`WorkerPool`'s; only how a rank is reached differs (an actor method call instead of a pipe).

Faults: an actor that dies (killed, out of memory, its node lost) makes its pending call raise
`RayActorError`; the pool reports it naming the plan step, stage, role, rank and node. A run with
checkpoints resumes from the latest one after such a failure (docs/distributed.md).
"""

from __future__ import annotations

import os
import pickle
import socket
from typing import Any

import attrs
import torch

from rlgraph.plan.plan import Plan
from rlgraph.runtime.errors import WorkerFailure
from rlgraph.runtime.worker_pool import DEFAULT_TIMEOUT_S, START_TIMEOUT_S, WorkerPool, resolve_device, start_worker
from rlgraph.user_files import loaded_files

PING_S = 3.0  # a live actor's health thread answers in milliseconds; 3 s covers a loaded node


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise WorkerFailure("the ray runtime needs Ray: pip install 'rlgraph[ray]'") from None
    return ray


class RankActor:
    """One mesh rank inside a Ray actor (made remote by `RayTransport`)."""

    def __init__(self, rank: int, threads: int):
        self.rank = rank
        self.worker = None
        torch.set_num_threads(threads)

    def rendezvous(self) -> tuple[str, int, int]:
        """This node's address, a free port on it (rank 0's is the process group's rendezvous) and
        this actor's process id (named when the actor stops answering)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return _ray().util.get_node_ip_address(), port, os.getpid()

    def start(self, world: int, master: tuple[str, int], recipe: bytes, files: dict[str, str], device: str,
              timeout_s: float):
        from rlgraph.runtime.worker import describe_error
        from rlgraph.user_files import unpickle

        try:  # the recipe is rebuilt here, after the user's files loaded: a failure names the rank
            plan, spec = unpickle(recipe, files, f"rank {self.rank}")
            # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU, so it is device 0 here
            self.worker = start_worker(self.rank, world, master, plan, spec, device, timeout_s, local_device=0)
        except BaseException as error:  # noqa: BLE001 - a failure to start is reported like any other
            return "error", describe_error(error)
        return "ok", (None, 0.0)

    def call(self, command: str, args: tuple) -> tuple[str, Any]:
        from rlgraph.runtime.worker import serve

        return serve(self.worker, command, args)

    def ping(self) -> bool:
        return True


class RayTransport(WorkerPool):
    """`plan.mesh.size` Ray actors in one placement group; `world.build(rank, plan, device)` builds each one's executor."""

    def __init__(self, plan: Plan, world: Any, *, address: str | None = None, device: str = "auto",
                 timeout_s: float | None = None, cpus_per_rank: int = 1):
        ray = _ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.world = plan.mesh.size
        self._started_ray = not ray.is_initialized()
        if self._started_ray:  # join `address` ("auto": the cluster `ray start` made), or start a local one
            options = {"address": address} if address else {"num_cpus": self.world * cpus_per_rank}
            ray.init(include_dashboard=False, log_to_driver=False, **options)
        self.device = self._device(ray, device)
        self.timeout_s = timeout_s if timeout_s is not None else DEFAULT_TIMEOUT_S[self.device]
        bundle = {"CPU": cpus_per_rank, **({"GPU": 1} if self.device == "cuda" else {})}
        self._group = placement_group([dict(bundle) for _ in range(self.world)], strategy="PACK")
        self._remove_group = remove_placement_group
        spec = attrs.evolve(world, rewards={})  # reward functions run on the driver, and need not pickle
        self._init_pool(spec)
        self.actors, self.nodes, self.pids = [], [], []
        try:
            start_timeout = max(self.timeout_s, START_TIMEOUT_S)
            ray.get(self._group.ready(), timeout=start_timeout)
            # Commands run in order on the default group's one thread; pings have a thread of their own.
            remote = ray.remote(num_cpus=cpus_per_rank, num_gpus=1 if self.device == "cuda" else 0,
                                concurrency_groups={"health": 1})(RankActor)
            for rank in range(self.world):
                strategy = PlacementGroupSchedulingStrategy(self._group, placement_group_bundle_index=rank)
                self.actors.append(remote.options(scheduling_strategy=strategy, name=None).remote(rank, cpus_per_rank))
            addresses = ray.get([actor.rendezvous.remote() for actor in self.actors], timeout=start_timeout)
            self.nodes, self.pids = [host for host, _, _ in addresses], [pid for _, _, pid in addresses]
            recipe = pickle.dumps((plan, spec), protocol=pickle.HIGHEST_PROTOCOL)
            for rank, actor in enumerate(self.actors):
                ref = actor.start.remote(self.world, addresses[0][:2], recipe, loaded_files(), self.device, self.timeout_s)
                self.outstanding[rank].append(("start", None, ref))
            self._wait_started()
        except BaseException:
            self.close()
            raise

    def _device(self, ray: Any, device: str) -> str:
        gpus = int(ray.cluster_resources().get("GPU", 0))
        if device == "auto":
            return "cuda" if gpus >= self.world else "cpu"
        if device == "cuda" and gpus < self.world:
            raise WorkerFailure(f"device 'cuda' needs {self.world} GPUs in the Ray cluster; it has {gpus}")
        return resolve_device("cpu") if device == "cpu" else device

    # -- the pool's primitives -------------------------------------------------------------------
    def _post(self, rank: int, command: str, args: tuple) -> Any:
        return self.actors[rank].call.remote(command, args)

    def _poll(self, ranks: list[int], timeout: float) -> list[tuple[int, str, Any]]:
        ray = _ray()
        refs = {self.outstanding[rank][0][2]: rank for rank in ranks}
        ready, rest = ray.wait(list(refs), num_returns=1, timeout=timeout)
        if ready and rest:
            ready += ray.wait(rest, num_returns=len(rest), timeout=0)[0]
        answers = []
        for ref in ready:
            rank = refs[ref]
            try:
                answers.append((rank, *ray.get(ref)))
            except ray.exceptions.RayActorError as error:
                answers.append((rank, "died", f"actor on node {self._node(rank)} died: {_first_line(error)}"))
            except ray.exceptions.RayError as error:
                answers.append((rank, "died", f"on node {self._node(rank)}: {_first_line(error)}"))
        return answers

    def _dead(self) -> dict[int, str]:
        ray = _ray()
        pings = {actor.ping.options(concurrency_group="health").remote(): rank for rank, actor in enumerate(self.actors)}
        ready, _ = ray.wait(list(pings), num_returns=len(pings), timeout=2.0)
        dead = {}
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayError as error:
                dead[pings[ref]] = f"actor on node {self._node(pings[ref])} died: {_first_line(error)}"
        return dead

    def _unresponsive(self, ranks: list[int]) -> dict[int, str]:
        # The ping runs on the actor's own health thread, so a rank busy with a command answers it;
        # an actor whose process is stopped or hung (holding the interpreter) does not.
        ray = _ray()
        pings = {self.actors[rank].ping.options(concurrency_group="health").remote(): rank for rank in ranks}
        ready, late = ray.wait(list(pings), num_returns=len(pings), timeout=PING_S) if pings else ([], [])
        return {pings[ref]: f"its actor (process {self.pids[pings[ref]]} on node {self._node(pings[ref])}) does not "
                            f"answer a ping within {PING_S:.0f} s" for ref in late}

    def _node(self, rank: int) -> str:
        return self.nodes[rank] if rank < len(self.nodes) else "?"

    def _stop(self) -> None:
        ray = _ray()
        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
        try:
            self._remove_group(self._group)
        except Exception:  # noqa: BLE001
            pass
        if self._started_ray:
            ray.shutdown()


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__

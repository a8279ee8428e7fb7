"""The transport protocol (every transport implements every command the runner and the run send),
and the local transport: values cross between the controller (CPU) and the executor's device."""

import ast
import inspect
from pathlib import Path

import pytest
import torch

import rlgraph
from rlgraph.runtime.ray_transport import RayTransport
from rlgraph.runtime.spmd import SpmdTransport
from rlgraph.runtime.transport import LocalTransport, Transport
from tests.helpers import make_executor

PACKAGE = Path(rlgraph.__file__).parent
TRANSPORTS = (LocalTransport, SpmdTransport, RayTransport)


def test_a_scatter_puts_the_value_on_the_executors_device():
    class OnMeta:  # "meta" stands in for a GPU: a second device whose tensors have shapes and no data
        device = torch.device("meta")

    transport = LocalTransport(OnMeta())
    transport.scatter("adv", torch.ones(4), ("policy",))
    assert transport.worker.store["adv"].device.type == "meta"


def test_on_the_cpu_nothing_is_copied():
    transport = LocalTransport(make_executor())
    value = torch.arange(4.0)
    transport.scatter("adv", value, ("policy",))
    assert transport.gather("adv", ("policy",)) is value and transport.fetch("adv", 0) is value


# -- the protocol: every command, every transport ---------------------------------------------------

def _calls_on_transports(paths) -> set[str]:
    """The methods called on anything named `transport` (`transport.x(...)`, `self.transport.x(...)`)."""
    called = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                receiver = node.func.value
                name = receiver.attr if isinstance(receiver, ast.Attribute) else getattr(receiver, "id", "")
                if name == "transport":
                    called.add(node.func.attr)
    return called


def test_the_protocol_lists_every_command_the_runner_and_the_run_send():
    sources = [PACKAGE / "runtime" / "plan_runner.py", *sorted((PACKAGE / "train").glob("*.py"))]
    called = _calls_on_transports(sources)
    assert "scatter" in called and "close" in called  # the scan sees the runner's and the run's calls
    # every command is declared on `Transport`: abstract, or (`hold`) kept there for every transport alike
    declared = {name for name in vars(Transport) if not name.startswith("_") and callable(getattr(Transport, name))}
    assert called <= declared, called - declared
    assert declared - Transport.__abstractmethods__ == {"hold"}
    assert {"set_learning_rate", "pull_state", "checkpoint_state", "restore_state"} <= Transport.__abstractmethods__


@pytest.mark.parametrize("transport", TRANSPORTS, ids=lambda cls: cls.__name__)
def test_each_transport_implements_every_command_with_the_protocols_signature(transport):
    assert not transport.__abstractmethods__
    for name in sorted(Transport.__abstractmethods__):
        implementation = getattr(transport, name)
        assert implementation is not getattr(Transport, name), f"{transport.__name__}.{name} is the abstract one"
        assert inspect.signature(implementation) == inspect.signature(getattr(Transport, name)), name


def test_neither_the_runtime_nor_the_run_probes_a_transport_for_a_command():
    """`getattr(transport, "x", None)` or `hasattr(transport, ...)` would hide a transport that lacks a command."""
    probes = []
    for path in [*sorted((PACKAGE / "runtime").glob("*.py")), *sorted((PACKAGE / "train").glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr") and node.args:
                if "transport" in ast.unparse(node.args[0]):
                    probes.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not probes, probes


# -- the run's commands on the local transport --------------------------------------------------------


def test_pull_state_is_a_cpu_copy_of_the_roles_weights():
    executor = make_executor()
    weights = LocalTransport(executor).pull_state("policy")
    live = executor.models["policy"].model.state_dict()
    assert weights.keys() == live.keys()
    assert all(torch.equal(weights[name], live[name]) and weights[name].data_ptr() != live[name].data_ptr()
               for name in live)


def test_pull_state_of_a_role_the_executor_lacks_names_the_roles_it_has():
    with pytest.raises(rlgraph.RLGraphError, match="no role 'critic'; it holds policy"):
        LocalTransport(make_executor()).pull_state("critic")


def test_set_learning_rate_reaches_the_roles_optimizer():
    executor = make_executor(lr=1e-3)
    LocalTransport(executor).set_learning_rate("policy", 0.5)
    assert [group["lr"] for group in executor.models["policy"].optimizer.param_groups] == [0.5]


def test_a_checkpoint_state_restores_the_weights_it_was_taken_with():
    transport = LocalTransport(make_executor(seed=0))
    state = transport.checkpoint_state()
    other = LocalTransport(make_executor(seed=1))
    other.restore_state(state, "a test")
    assert all(torch.equal(a, b) for a, b in zip(other.pull_state("policy").values(), transport.pull_state("policy").values()))


def test_save_weights_writes_the_roles_weights_and_a_lora_roles_merged(tmp_path):
    from safetensors.torch import load_file

    from rlgraph.backends.local.state import LMWorker
    from rlgraph.backends.lora import LoraSettings, apply_lora, merged_state_dict

    executor = make_executor()
    transport = LocalTransport(executor)
    written = load_file(transport.save_weights("policy", str(tmp_path / "policy.safetensors")))
    live = executor.models["policy"].model.state_dict()
    assert all(torch.equal(written[name], live[name]) for name in written) and set(live) - set(written) <= {"lm_head.weight"}
    lora = apply_lora(executor.models["policy"].model, LoraSettings(4, 8.0, 0.0, ("q_proj",)), seed=1)
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.fill_(0.01)  # adapters that change the merged weights
    executor.models["lora"] = LMWorker(lora)
    merged = load_file(transport.save_weights("lora", str(tmp_path / "merged.safetensors")))
    want = merged_state_dict(lora)
    assert not any("lora" in name for name in merged)
    assert all(torch.equal(merged[name], want[name]) for name in merged)
    with pytest.raises(rlgraph.RLGraphError, match="no role 'critic'; it holds policy, lora"):
        transport.save_weights("critic", str(tmp_path / "critic.safetensors"))


def test_an_iteration_of_one_runner_keeps_what_another_runner_holds():
    # issue 32: an evaluation between async steps began its iteration on the RL runner's transport and
    # dropped the batch in flight there (KeyError 'send_recv_generate@0' at the next train step)
    transport = LocalTransport(make_executor())
    transport.scatter("generate@0", torch.ones(2), ((0,), 1))
    transport.scatter("scratch", torch.zeros(1), ((0,), 1))
    transport.hold("rl", ("generate@0",))
    transport.begin({0: {"policy": "v1"}})  # another runner's iteration (the evaluation's)
    assert set(transport.worker.store) == {"generate@0", "policy"}
    transport.hold("rl", ())  # trained: the RL runner holds nothing more
    transport.begin({})
    assert transport.worker.store == {}


def test_a_worker_runs_only_the_commands_its_executor_declares():
    from rlgraph.runtime.worker import Worker, serve

    class Declares:
        commands = ("add",)
        device = torch.device("cpu")

        def add(self, a, b=0):
            return a + b

        def secret(self):
            return "never"

    worker = Worker(Declares(), rank=3)
    assert worker.executor_command("add", (2,), {"b": 5}) == 7
    status, (kind, message, _) = serve(worker, "executor_command", ("secret", (), {}))
    assert (status, kind) == ("error", "KeyError") and "rank 3" in message and "no command 'secret'" in message

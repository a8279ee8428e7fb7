"""The local transport: values cross between the controller (CPU) and the executor's device."""

import torch

from rlgraph.runtime.transport import LocalTransport
from tests.helpers import make_executor


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

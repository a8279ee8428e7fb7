"""`resolve_device`: which device a run's workers and models use."""

import pytest
import torch

from rlgraph.runtime.errors import WorkerFailure
from rlgraph.runtime.pool import resolve_device


def test_auto_is_cuda_only_where_torch_sees_a_gpu():
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_cuda_on_a_machine_without_a_gpu_is_refused_with_the_fix():
    with pytest.raises(WorkerFailure, match="device 'cuda' was asked for, but torch sees no CUDA GPU here; "
                                            "use --device cpu or auto"):
        resolve_device("cuda")


def test_an_unknown_device_is_refused():
    with pytest.raises(ValueError, match="auto, cpu or cuda, got 'gpu'"):
        resolve_device("gpu")

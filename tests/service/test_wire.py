"""The SDK's protobuf forward/backward request, read with every declared size checked before it is
allocated; malformed bytes are a 4xx naming the datum and field."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("tinker")

from tinker.proto import tinker_public_pb2 as pb  # noqa: E402

from rlgraph.service.datums import Limits  # noqa: E402
from rlgraph.service.errors import CallError  # noqa: E402
from rlgraph.service.wire import read_forward_backward  # noqa: E402

LIMITS = Limits(vocab_size=47, max_tokens=64, max_datums=8, max_body_bytes=4096)  # 1,024 loss values a request


def request(inputs: dict, tokens: bytes = np.arange(1, 5, dtype=np.int32).tobytes(), datums: int = 1) -> bytes:
    message = pb.ForwardBackwardRequest(model_id="m", seq_id=3, loss_fn="cross_entropy")
    for _ in range(datums):
        datum = message.data.add()
        datum.model_input.add().encoded_text.tokens = tokens
        for name, tensor in inputs.items():
            datum.loss_fn_inputs[name].CopyFrom(tensor)
    return message.SerializeToString()


def dense(values, dtype=np.int64) -> pb.Tensor:
    array = np.asarray(values, dtype=dtype)
    code = pb.DTYPE_INT64 if dtype == np.int64 else pb.DTYPE_FLOAT32
    return pb.Tensor(dense=array.tobytes(), dtype=code, shape=list(array.shape))


def sparse(shape, values=(1.0,), crow=(0, 1), col=(0,)) -> pb.Tensor:
    csr = pb.SparseCsr(values=np.asarray(values, np.float32).tobytes(), crow_indices=np.asarray(crow, np.int64).tobytes(),
                       col_indices=np.asarray(col, np.int64).tobytes())
    return pb.Tensor(sparse_csr=csr, dtype=pb.DTYPE_FLOAT32, shape=list(shape))


def refused(body: bytes, status: int, field: str, match: str) -> None:
    with pytest.raises(CallError, match=match) as error:
        read_forward_backward(body, LIMITS)
    assert (error.value.status, error.value.field) == (status, field)


def test_a_well_formed_request_reads_back_with_its_digest():
    targets = dense([2, 3, 4, 5])
    body = request({"target_tokens": targets, "weights": sparse([1, 4], values=[0.5, 2.0], crow=[0, 2], col=[1, 3])})
    read = read_forward_backward(body, LIMITS)
    assert read["data"][0].tokens == [1, 2, 3, 4] and read["seq_id"] == 3
    assert read["data"][0].loss_fn_inputs["weights"].tolist() == [0.0, 0.5, 0.0, 2.0]
    assert read["data"][0].loss_fn_inputs["target_tokens"].tolist() == [2, 3, 4, 5]
    again = read_forward_backward(body, LIMITS)
    assert again["fingerprint"] == read["fingerprint"]  # a retry: the same digest
    other = read_forward_backward(request({"target_tokens": dense([2, 3, 4, 6])}), LIMITS)
    assert other["fingerprint"] != read["fingerprint"]


@pytest.mark.parametrize("shape", [[10**9, 10**9], [65], [2**62, 4]])
def test_a_sparse_input_claiming_a_huge_shape_is_refused_before_allocating(shape):
    """Issue 34 item 1: 307 bytes claiming 10^18 values took the server to 1.6 GiB; now a 413 at once."""
    start = time.perf_counter()
    refused(request({"weights": sparse(shape)}), 413, "data[0].loss_fn_inputs.weights", "loss input has one value")
    assert time.perf_counter() - start < 1.0


def test_the_requests_sparse_inputs_together_stay_within_the_body_limits_worth():
    # 8 datums x 3 inputs of 64 values = 1,536 values claimed by a few hundred bytes; the budget is 1,024
    inputs = {name: sparse([1, 64], values=[1.0], crow=[0, 1], col=[0]) for name in ("weights", "advantages", "logprobs")}
    with pytest.raises(CallError, match="budget for loss inputs") as error:
        read_forward_backward(request(inputs, datums=8), LIMITS)
    # 5 datums take 960 values, the 6th's first input 64 more (1,024): its second input is refused
    # (which one is second is the protobuf map's order)
    assert error.value.status == 413 and error.value.field.startswith("data[5].loss_fn_inputs.")


@pytest.mark.parametrize("tensor, match", [
    (sparse([1, 4], crow=[0, 1, 1]), "row offsets"),                       # crow longer than rows + 1
    (sparse([1, 4], col=[9]), "indices do not fit"),                         # a column past the shape
    (sparse([1, 4], crow=[0, 5], values=[1.0], col=[0]), "indices do not fit"),  # offsets past the values
    (sparse([4]), "2-D shape"),
    (pb.Tensor(dense=b"\x00" * 7, dtype=pb.DTYPE_FLOAT32, shape=[2]), "do not hold"),
    (pb.Tensor(dense=b"\x00" * 8, dtype=pb.DTYPE_FLOAT32, shape=[-2, -1]), "negative"),
])
def test_malformed_tensors_are_400s_naming_the_input(tensor, match):
    refused(request({"weights": tensor}), 400, "data[0].loss_fn_inputs.weights", match)


def test_token_bytes_must_be_whole_int32_ids_within_the_context():
    """Issue 34 item 8: token bytes that are not a multiple of 4 answered 500."""
    refused(request({}, tokens=b"\x01\x00\x00\x00\x02"), 400, "data[0].model_input", "multiple of 4")
    refused(request({}, tokens=np.ones(65, np.int32).tobytes()), 413, "data[0].model_input", "context")
    refused(request({}, datums=9), 413, "data", "at most 8")

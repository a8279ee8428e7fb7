"""The Tinker SDK's wire formats on the server side: its protobuf forward/backward request and
the protobuf results it expects for `ForwardBackwardOutput` and `SampleResponse` (every other
call is JSON, read with the SDK's own pydantic types). The message definitions are the SDK's
(`tinker.proto.tinker_public_pb2`), so this module needs the `service` extra.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tinker.proto import tinker_public_pb2 as pb

from rlgraph.service.datums import Datum, Limits
from rlgraph.service.errors import CallError

_NUMPY = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


def _tensor(message: Any, field: str, limit: int, budget: int) -> np.ndarray:
    """The tensor `message` as a flat array of at most `limit` values (one datum's) and `budget`
    (what is left of the request's). Every size it declares (its shape, a sparse tensor's index
    arrays) is checked against these and against the bytes it carries before anything is
    allocated: a few bytes cannot claim gigabytes."""
    dtype = _NUMPY.get(message.dtype)
    if dtype is None:
        raise CallError(f"tensor dtype {message.dtype} is not float32, int64 or int32", field=field)
    shape = list(message.shape)
    if any(size < 0 for size in shape):
        raise CallError(f"tensor shape {shape[:8]} has a negative size", field=field)
    count = int(np.prod(shape, dtype=object)) if shape else None  # Python ints: no overflow on hostile sizes
    if count is not None and count > limit:
        raise CallError(f"tensor shape {shape[:8]} holds {count} values; a loss input has one value per input token, "
                        f"at most {limit}", field=field, status=413, fix="send one value per token of model_input")
    if count is not None and count > budget:
        raise CallError(f"tensor shape {shape[:8]} holds {count} values, past what is left ({budget}) of the request's "
                        "budget for loss inputs (the body limit's worth of float32 values)", field=field, status=413,
                        fix="split the batch over several forward_backward calls")
    if message.HasField("sparse_csr"):
        return _sparse(message.sparse_csr, dtype, shape, count, field)
    itemsize = np.dtype(dtype).itemsize
    if len(message.dense) % itemsize or (count is not None and len(message.dense) != count * itemsize):
        raise CallError(f"tensor bytes ({len(message.dense)}) do not hold {count if count is not None else 'whole'} "
                        f"{np.dtype(dtype).name} values of shape {shape}", field=field)
    if count is None and len(message.dense) // itemsize > min(limit, budget):
        raise CallError(f"tensor holds {len(message.dense) // itemsize} values; at most {min(limit, budget)}", field=field,
                        status=413)
    return np.frombuffer(message.dense, dtype=dtype).copy()


def _sparse(csr: Any, dtype: Any, shape: list[int], count: int | None, field: str) -> np.ndarray:
    """A CSR tensor as a dense flat array, after checking its index arrays against its shape."""
    if count is None or len(shape) != 2:
        raise CallError(f"a sparse tensor needs a 2-D shape, got {shape}", field=field)
    rows, cols = shape
    arrays = {}
    for name, data, kind in (("values", csr.values, dtype), ("crow_indices", csr.crow_indices, np.int64),
                             ("col_indices", csr.col_indices, np.int64)):
        if len(data) % np.dtype(kind).itemsize:
            raise CallError(f"sparse {name} bytes ({len(data)}) are not whole {np.dtype(kind).name} values", field=field)
        arrays[name] = np.frombuffer(data, dtype=kind)
    values, crow, col = arrays["values"], arrays["crow_indices"], arrays["col_indices"]
    nnz = len(values)
    if len(crow) != rows + 1 or len(col) != nnz or nnz > count:
        raise CallError(f"sparse tensor of shape {shape} needs {rows + 1} row offsets and one column index per value, "
                        f"got {len(crow)} offsets, {len(col)} indices, {nnz} values", field=field)
    if crow[0] != 0 or crow[-1] != nnz or np.any(np.diff(crow) < 0) or np.any((col < 0) | (col >= max(cols, 1))):
        raise CallError(f"sparse tensor indices do not fit its shape {shape}", field=field)
    dense = np.zeros(count, dtype=dtype)  # count <= the per-datum limit, checked by the caller
    rows_of = np.repeat(np.arange(rows), np.diff(crow))
    dense[rows_of * cols + col] = values
    return dense


def _tokens(chunk: Any, field: str, before: int, context: int) -> list[int]:
    """A chunk's int32 ids, which with the `before` tokens of the datum's earlier chunks fit `context`."""
    data = chunk.encoded_text.tokens
    if len(data) % 4:
        raise CallError(f"token bytes ({len(data)}) are not whole int32 ids (a multiple of 4 bytes)", field=field)
    if before + len(data) // 4 > context:
        raise CallError(f"holds {before + len(data) // 4} tokens; the model's context is {context}", field=field,
                        status=413, fix="send shorter sequences")
    return np.frombuffer(data, dtype=np.int32).tolist()


def read_forward_backward(body: bytes, limits: Limits) -> dict[str, Any]:
    """The proto request as plain data: model_id, seq_id, loss_fn, loss_fn_config, forward_only, data.
    Sizes are checked against `limits` before anything is allocated for them."""
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except Exception:  # protobuf's DecodeError: a body that is not the SDK's message
        raise CallError("the body is not a ForwardBackwardRequest protobuf message", field="body") from None
    if len(message.data) > limits.max_datums:
        raise CallError(f"holds {len(message.data)} datums; this server takes at most {limits.max_datums} per call",
                        field="data", status=413, fix="split the batch over several forward_backward calls")
    config: dict[str, float | str] = {key: float(value) for key, value in message.loss_fn_config.items()}
    for key, value in message.loss_fn_config_v2.items():  # v2 wins: it also carries strings
        config[key] = value.text if value.WhichOneof("value") == "text" else float(value.number)
    data = []
    budget = limits.max_body_bytes // 4  # sparse inputs may not expand past what a dense body could carry
    for i, datum in enumerate(message.data):
        tokens: list[int] = []
        for j, chunk in enumerate(datum.model_input):
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise CallError(f"chunk {j} is {chunk.WhichOneof('chunk')}; this server takes text tokens only",
                                field=f"data[{i}].model_input", fix="ModelInput.from_ints(tokens)")
            tokens += _tokens(chunk, f"data[{i}].model_input", len(tokens), limits.max_tokens)
        inputs = {}
        for name, value in datum.loss_fn_inputs.items():
            inputs[name] = torch.from_numpy(_tensor(value, f"data[{i}].loss_fn_inputs.{name}", limits.max_tokens, budget))
            budget -= inputs[name].numel()
        data.append(Datum(tokens, inputs))
    seq_id = message.seq_id or None  # proto3: 0 is "not sent" (the SDK counts from 1)
    # the same request serialises to the same bytes deterministically (maps in key order): a retry's digest
    digest = hashlib.sha256(message.SerializeToString(deterministic=True)).hexdigest()
    return {"model_id": message.model_id, "seq_id": seq_id, "loss_fn": message.loss_fn,
            "loss_fn_config": config, "forward_only": message.forward_only, "data": data, "fingerprint": digest}


def forward_backward_output(result: Mapping[str, Any]) -> bytes:
    """`{"outputs": [{name: tensor [L]}], "metrics": {...}}` as the SDK's ForwardBackwardOutput: one
    ArrayRecord, each field one BatchedTensor of the datums end to end with byte offsets."""
    message = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in result["metrics"].items():
        message.metrics[key] = float(value)
    outputs: Sequence[Mapping[str, torch.Tensor]] = result["outputs"]
    record = message.loss_fn_outputs.add(num_datums=len(outputs))
    for name in outputs[0] if outputs else ():
        arrays = [output[name].detach().cpu().numpy().astype(np.float32) for output in outputs]
        offsets = np.cumsum([0] + [array.nbytes for array in arrays]).astype(np.int64)
        record.fields[name].CopyFrom(pb.BatchedTensor(data=b"".join(a.tobytes() for a in arrays),
                                                      offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32))
    return message.SerializeToString()


def sample_response(result: Mapping[str, Any]) -> bytes:
    message = pb.SampleResponse()
    for sequence in result["sequences"]:
        message.sequences.add(stop_reason=pb.STOP_REASON_STOP if sequence.stop_reason == "stop" else pb.STOP_REASON_LENGTH,
                              tokens=np.asarray(sequence.tokens, dtype=np.int32).tobytes(),
                              logprobs=np.asarray(sequence.logprobs, dtype=np.float32).tobytes())
    if result.get("prompt_logprobs") is not None:
        values = [np.nan if value is None else value for value in result["prompt_logprobs"]]
        message.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
    return message.SerializeToString()

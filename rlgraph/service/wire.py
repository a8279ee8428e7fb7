"""The Tinker SDK's wire formats on the server side: its protobuf forward/backward request and
the protobuf results it expects for `ForwardBackwardOutput` and `SampleResponse` (every other
call is JSON, read with the SDK's own pydantic types). The message definitions are the SDK's
(`tinker.proto.tinker_public_pb2`), so this module needs the `service` extra.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tinker.proto import tinker_public_pb2 as pb

from rlgraph.service.datums import Datum
from rlgraph.service.errors import CallError

_NUMPY = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


def _tensor(message: Any, field: str) -> np.ndarray:
    dtype = _NUMPY.get(message.dtype)
    if dtype is None:
        raise CallError(f"tensor dtype {message.dtype} is not float32, int64 or int32", field=field)
    shape = list(message.shape)
    try:
        if message.HasField("sparse_csr"):
            csr = message.sparse_csr
            values = np.frombuffer(csr.values, dtype=dtype)
            crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
            col = np.frombuffer(csr.col_indices, dtype=np.int64)
            dense = np.zeros(shape, dtype=dtype).reshape(len(crow) - 1, -1)
            for row in range(len(crow) - 1):
                dense[row, col[crow[row]:crow[row + 1]]] = values[crow[row]:crow[row + 1]]
            return dense.reshape(shape)
        array = np.frombuffer(message.dense, dtype=dtype)
        return array.reshape(shape) if shape else array
    except (ValueError, IndexError) as error:
        raise CallError(f"tensor bytes do not match its shape {shape}: {error}", field=field) from None


def read_forward_backward(body: bytes) -> dict[str, Any]:
    """The proto request as plain data: model_id, seq_id, loss_fn, loss_fn_config, forward_only, data."""
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except Exception:  # protobuf's DecodeError: a body that is not the SDK's message
        raise CallError("the body is not a ForwardBackwardRequest protobuf message", field="body") from None
    config: dict[str, float | str] = {key: float(value) for key, value in message.loss_fn_config.items()}
    for key, value in message.loss_fn_config_v2.items():  # v2 wins: it also carries strings
        config[key] = value.text if value.WhichOneof("value") == "text" else float(value.number)
    data = []
    for i, datum in enumerate(message.data):
        tokens: list[int] = []
        for j, chunk in enumerate(datum.model_input):
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise CallError(f"chunk {j} is {chunk.WhichOneof('chunk')}; this server takes text tokens only",
                                field=f"data[{i}].model_input", fix="ModelInput.from_ints(tokens)")
            tokens += np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist()
        inputs = {name: torch.from_numpy(_tensor(value, f"data[{i}].loss_fn_inputs.{name}").copy()).flatten()
                  for name, value in datum.loss_fn_inputs.items()}
        data.append(Datum(tokens, inputs))
    return {"model_id": message.model_id, "seq_id": message.seq_id, "loss_fn": message.loss_fn,
            "loss_fn_config": config, "forward_only": message.forward_only, "data": data}


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

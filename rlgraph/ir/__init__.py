"""The typed dataflow IR: specs, programs, the tracer, the printer and the verifier."""

from rlgraph.errors import RLGraphError, SpecError, TraceError, VerifyError
from rlgraph.ir.ops import traceable
from rlgraph.ir.program import Program, verify
from rlgraph.ir.specs import B, N, P, T, V, H, Dim, EnvSpec, Layout, ModelSpec, RecordSpec, RewardSpec, TensorSpec, n
from rlgraph.ir.entrypoints import trace_algorithm

__all__ = [
    "RLGraphError", "SpecError", "TraceError", "VerifyError", "traceable", "Program", "verify",
    "B", "N", "P", "T", "V", "H", "n", "Dim", "EnvSpec", "Layout", "ModelSpec", "RecordSpec", "RewardSpec", "TensorSpec",
    "trace_algorithm",
]

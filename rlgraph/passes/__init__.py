"""Compiler passes, one module each; `PIPELINE` is the order they run in."""

from rlgraph.passes.pipeline import PIPELINE, compile_program
from rlgraph.plan.compiled import Compiled

__all__ = ["PIPELINE", "Compiled", "compile_program"]

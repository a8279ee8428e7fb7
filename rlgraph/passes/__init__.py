"""Compiler passes, one module each; `PIPELINE` is the order they run in."""

from rlgraph.passes.pipeline import PIPELINE, Compiled, compile_program

__all__ = ["PIPELINE", "Compiled", "compile_program"]

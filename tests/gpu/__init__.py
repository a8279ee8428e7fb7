"""Tests that need a CUDA device; each skips with a reason without one.

Run them on a GPU machine with Triton compiling (tests/conftest.py sets TRITON_INTERPRET=1 for the
CPU kernel tests, which makes every Triton kernel interpreted for the whole process):

    TRITON_INTERPRET=0 .venv/bin/python -m pytest -p no:xdist -m gpu tests/gpu
"""

import os

# Triton kernels run on CPU tensors only under the interpreter; set before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

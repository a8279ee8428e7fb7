"""vLLM generation: `VLLMEngine` (needs `pip install 'rlgraph[vllm]'`, CUDA) and the pure conversions it uses."""

from rlgraph.backends.vllm.convert import (
    check_left_padded, request_seeds, rollouts_from_outputs, sampling_kwargs, token_prompts,
)
from rlgraph.backends.vllm.engine import VLLMEngine, import_vllm

__all__ = ["VLLMEngine", "check_left_padded", "import_vllm", "request_seeds", "rollouts_from_outputs",
           "sampling_kwargs", "token_prompts"]

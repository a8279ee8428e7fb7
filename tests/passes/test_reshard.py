"""The reshard pass (`rlgraph/passes/reshard.py`): what a sync_weights step says it moves."""

import json

import rlgraph as rg
from rlgraph.algorithms import ALGORITHMS
from rlgraph.backends.local.models import TINY_VLLM_CONFIG

LORA = {"policy": {"r": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}}


def _sync_line(engine, lora):
    compiled = rg.compile(ALGORITHMS["grpo"], mesh="cpu:1", placement=rg.colocated(offload=False), engine=engine,
                          sizes={"B": 4, "P": 8, "T": 4}, n=2, models={"policy": json.loads(TINY_VLLM_CONFIG.read_text())},
                          lora=lora)
    return next(line for line in compiled.as_text().splitlines() if "] sync_weights" in line)


def test_a_lora_policy_on_vllm_syncs_its_adapters_alone_and_on_the_native_engine_its_weights():
    # r x (in + out) per target per layer, 2 layers, fp32: q 8x(64+64), k and v 8x(64+32), o 8x(64+64)
    adapters = 2 * 8 * (128 + 96 + 96 + 128) * 4  # 28,672 B
    assert _sync_line("vllm", LORA).endswith(f"{adapters / 1024:.1f} KiB in 1 bucket(s)")  # vLLM holds the frozen base
    assert _sync_line("native", LORA).endswith("494.0 KiB in 1 bucket(s)")  # the native engine gets merged weights
    assert _sync_line("vllm", None).endswith("494.0 KiB in 1 bucket(s)")  # full fine-tuning: every weight


def test_a_vision_policy_s_batch_moves_count_each_row_s_pixels():
    """A `Prompts` / `Rollouts` row of a VLM carries its prompt's images (docs/vlm.md), so the plan's
    moves of them count those bytes at the pixel budget. The tiny Qwen2-VL at 256 px: 256 // (4 * 2)^2
    = 4 image tokens, 16 patches of 3 channels x 2 frames x 4 x 4 pixels in fp32 (6,144 B), and a
    (t, h, w) grid of 3 int64 (24 B): 6,168 B a row, B = 2 prompts scattered, N = 4 samples gathered."""
    from rlgraph.backends.local.models import TINY_CONFIG
    from rlgraph.backends.local.vlm import TINY_VL_CONFIG
    from rlgraph.plan.plan import Transfer

    def moves(config):
        compiled = rg.compile(ALGORITHMS["grpo"], mesh="cpu:1", placement=rg.colocated(offload=False), pixel_budget=256,
                              sizes={"B": 2, "P": 8, "T": 4}, n=2, models={"policy": str(config)})
        return {str(step.spec): step.bytes for step in compiled.plan.steps
                if isinstance(step, Transfer) and str(step.spec).startswith(("Prompts[", "Rollouts["))}

    text, vision = moves(TINY_CONFIG), moves(TINY_VL_CONFIG)
    assert vision.keys() == text.keys() == {"Prompts[B,P]", "Rollouts[N,T]"}
    assert vision["Prompts[B,P]"] - text["Prompts[B,P]"] == 2 * 6168
    assert vision["Rollouts[N,T]"] - text["Rollouts[N,T]"] == 4 * 6168

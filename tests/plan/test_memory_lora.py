"""The memory model of LoRA training (`rg.compile(..., lora=...)`): frozen base, trainable adapters,
a reference that shares the policy's weights. Numbers against hand formulas; one exact count
against a real peft model."""

import attrs
import pytest
import torch

import rlgraph as rg
from rlgraph.algorithms import grpo
from rlgraph.errors import ConfigError
from rlgraph.plan import memory as M
from rlgraph.plan.memory import MemoryBreakdown, PlacementError, TrainMemoryConfig
from rlgraph.plan.model_size import LoraShape, ModelShape
from rlgraph.plan.presets import get_preset

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
LLAMA8B = ModelShape.from_hf_config(get_preset("llama3-8b"))
SIZES = {"B": 8, "P": 256, "T": 512}
# hidden 8, q_dim 8, kv_dim 4, MLP 16, 2 layers, 1272 parameters (tests/plan/test_memory.py).
SMALL = ModelShape(hidden=8, layers=2, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=10, tie_embeddings=True)
FP32 = TrainMemoryConfig(param_dtype=torch.float32, mixed_precision=False, checkpointing=False, micro_batch_tokens=10, seq_len=10)


def _adapters(r: int, layers: int, shapes: list[tuple[int, int]]) -> int:
    """The hand formula: sum over targeted linear layers of r * (in + out)."""
    return layers * sum(r * (fan_in + fan_out) for fan_in, fan_out in shapes)


def test_adapter_parameters_follow_the_hand_formula():
    h, kv, inter = 4096, 1024, 14336  # Llama-3-8B: 32 heads and 8 kv heads of 128
    attention = _adapters(16, 32, [(h, h), (h, kv), (h, kv), (h, h)])
    assert LLAMA8B.lora_params(LoraShape(16, ATTENTION)) == attention == 13_631_488
    every = attention + _adapters(16, 32, [(h, inter), (h, inter), (inter, h)])
    assert LLAMA8B.lora_params(LoraShape(16, ATTENTION + ("gate_proj", "up_proj", "down_proj"))) == every == 41_943_040
    assert LLAMA8B.lora_params(LoraShape(8, ("lm_head",))) == 8 * (h + 128_256)  # the head once, not per layer
    with pytest.raises(ValueError, match="LoRA target 'lm_head' is no linear module of this model"):
        attrs.evolve(LLAMA8B, value_head=True).lora_params(LoraShape(8, ("lm_head",)))


def test_adapter_parameters_equal_a_real_peft_models():
    from rlgraph.backends.local.models import build_causal_lm, tiny_config
    from rlgraph.backends.lora import LoraSettings, apply_lora

    targets = ("q_proj", "v_proj", "down_proj")
    model = apply_lora(build_causal_lm(), LoraSettings(r=4, target_modules=targets))
    counted = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert ModelShape.from_hf_config(tiny_config()).lora_params(LoraShape(4, targets)) == counted


def test_lora_train_memory_by_hand_fp32():
    lora = LoraShape(2, ("q_proj", "v_proj"))
    a = _adapters(2, 2, [(8, 8), (8, 4)])  # 112
    need = M.train_memory(SMALL, attrs.evolve(FP32, lora=lora))
    # Base 1272 + adapters held in fp32; gradients and AdamW's two fp32 moments of the adapters only;
    # activations: the full model's 13480 plus 10 tokens x 2 layers x 2 adapters x r=2 x 4 bytes.
    # No [V, H] fp32 buffer in the head's backward: it is frozen (no weight gradient) and fp32 (no copy).
    assert need == MemoryBreakdown(params=4 * (1272 + a), grads=4 * a, optimizer=2 * 4 * a,
                                   activations=13480 + 10 * 2 * 2 * 2 * 4, logits=1200, workspace=0)
    with_head = M.train_memory(SMALL, attrs.evolve(FP32, lora=LoraShape(2, ("q_proj", "lm_head"))))
    assert with_head.workspace == 4 * 10 * 8  # an adapted head: its fp32 weight gradient, [V, H]
    bf16 = M.train_memory(SMALL, attrs.evolve(FP32, lora=lora, param_dtype=torch.bfloat16))
    assert bf16.workspace == 4 * 10 * 8  # a 16-bit head: its fp32 copy


def test_lora_state_under_mixed_precision_has_an_fp32_master_of_the_adapters_only():
    lora = LoraShape(16, ATTENTION)
    a, n = 13_631_488, LLAMA8B.n_params
    cfg = TrainMemoryConfig(micro_batch_tokens=4096, fused_optimizer=True)
    need, full = M.train_memory(LLAMA8B, attrs.evolve(cfg, lora=lora)), M.train_memory(LLAMA8B, cfg)
    assert (need.params, need.grads, need.optimizer, need.master_weights) == (2 * (n + a), 2 * a, 8 * a, 4 * a)
    assert (full.params, full.grads, full.optimizer, full.master_weights) == (2 * n, 2 * n, 8 * n, 4 * n)
    state = need.params + need.grads + need.optimizer + need.master_weights
    assert state < 0.14 * (full.params + full.grads + full.optimizer + full.master_weights)  # 2 + 14a/n of 16 bytes
    host = M.train_host_memory(LLAMA8B, attrs.evolve(cfg, lora=lora, offload_params=True, offload_optimizer=True))
    assert host.total == 2 * (n + a) + 2 * a + 8 * a + 4 * a


def test_a_lora_llama3_8b_fits_one_h100_where_full_fine_tuning_does_not():
    lora = {"policy": {"r": 16, "alpha": 32.0, "dropout": 0.0, "target_modules": list(ATTENTION)}}  # model.lora's dump
    compiled = rg.compile(grpo, mesh="gpu:1", sizes=SIZES, models={"policy": "llama3-8b"}, lora=lora, n=4, kl=0.04)
    a, n = 13_631_488, LLAMA8B.n_params
    train = compiled.memory_analysis()["policy"]["train"]
    assert (train["params"], train["grads"], train["optimizer"], train["master_weights"]) == (2 * (n + a), 2 * a, 8 * a, 4 * a)
    assert compiled.memory_analysis()["ref"]["infer"]["params"] == 0  # the policy with adapters off
    assert "ref       infer" in compiled.as_text() and "optimizer+grads 182.00 MiB" in compiled.as_text()
    with pytest.raises(PlacementError, match="role policy\\+ref does not fit on rank 0"):
        rg.compile(grpo, mesh="gpu:1", sizes=SIZES, models={"policy": "llama3-8b"}, n=4, kl=0.04)


@pytest.mark.parametrize("ref_on, shared", [("policy", True), ("rollout", False)])
def test_the_reference_shares_the_policys_weights_only_on_its_ranks(ref_on, shared):
    placement = rg.split({"policy": 4, "rollout": 4, "ref": ref_on})
    compiled = rg.compile(grpo, mesh="gpu:8", placement=placement, sizes=SIZES, models={"policy": "llama3-8b"},
                          lora={"policy": {"r": 8}}, n=4, kl=0.04)
    params = compiled.memory_analysis()["ref"]["infer"]["params"]
    assert params == (0 if shared else -(-2 * LLAMA8B.n_params // 4))


def test_lora_settings_objects_are_accepted():
    from rlgraph.passes.options import lora_shapes
    from rlgraph.backends.lora import LoraSettings

    assert lora_shapes({"policy": LoraSettings(r=4, target_modules=("q_proj",))}) == {"policy": LoraShape(4, ("q_proj",))}
    assert lora_shapes({"policy": {"target_modules": "v_proj"}}) == {"policy": LoraShape(8, ("v_proj",))}
    assert lora_shapes(None) == {}


@pytest.mark.parametrize("lora, words", [
    (16, "lora=16 is not a mapping of role to LoRA settings"),
    ({"policy": 16}, "lora['policy'] = 16 is not LoRA settings"),
    ({"policy": {"rank": 8}}, "lora['policy']: unknown key 'rank'"),
    ({"policy": {"r": 0}}, "lora['policy']: r=0 is not a whole number >= 1"),
    ({"policy": {"r": 2.5}}, "r=2.5 is not a whole number"),
    ({"policy": {"target_modules": []}}, "target_modules=[] is not a non-empty list"),
    ({"policy": {"target_modules": ["qproj"]}}, "target 'qproj' is no linear module the memory model knows; did you mean 'q_proj'?"),
    ({"ref": {"r": 8}}, "lora: role 'ref' does not train in this program (roles that train: policy)"),
    ({"polcy": {"r": 8}}, "role 'polcy' does not train in this program; did you mean 'policy'?"),
])
def test_bad_lora_options_are_refused_naming_role_and_key(lora, words):
    with pytest.raises(ConfigError) as error:
        rg.compile(grpo, mesh="gpu:1", sizes=SIZES, models={"policy": "llama3-8b"}, lora=lora, n=4, kl=0.04)
    assert words in str(error.value) and "fix:" in str(error.value)

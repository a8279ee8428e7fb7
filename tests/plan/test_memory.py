"""The memory model: hand-computed small cases, monotonicity properties, the fit check, and a measured step."""

import importlib.util
from pathlib import Path

import attrs
import pytest
import torch
from hypothesis import given, settings, strategies as st

from rlgraph.plan import memory as M
from rlgraph.plan.memory import MemoryBreakdown, TrainMemoryConfig
from rlgraph.plan.mesh import Mesh
from rlgraph.plan.model_size import LoraShape, ModelShape
from rlgraph.plan.presets import get_preset

# 1272 parameters: embedding 10*8 (tied head) + 2 layers x 592 (q 64, k 32, v 32, o 64, MLP 384, norms 16) + norm 8.
SMALL = ModelShape(hidden=8, layers=2, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=10, tie_embeddings=True)
FP32 = TrainMemoryConfig(param_dtype=torch.float32, mixed_precision=False, checkpointing=False, micro_batch_tokens=10, seq_len=10)


def test_small_shape_has_the_hand_counted_parameters():
    assert SMALL.layer_params == 592 and SMALL.n_params == 1272


def test_train_memory_by_hand_fp32():
    # Per token per layer: norms 2*(4*8 + 4 + 2*4*8) = 200, attention 4*4*8 + 4*2 = 136, MLP 4*4*16 = 256.
    assert M.layer_activation_bytes(SMALL, torch.float32) == 592
    # Head: final norm 100 + its input rows 32 + rotary cos/sin 2*4*4 = 164.
    assert M.head_activation_bytes(SMALL, torch.float32) == 164
    # The head's backward is the peak: 10 tokens x (2 x 592 + 164) activations, 3 x [10, 10] fp32 logits,
    # the fp32 [10, 8] head gradient; the layers' backward holds 11840 + 10 x 4 x (3*16 + 8) = 14080 < 15000.
    assert M.train_memory(SMALL, FP32) == MemoryBreakdown(
        params=4 * 1272, grads=4 * 1272, optimizer=2 * 4 * 1272, activations=13480, logits=1200, workspace=320)
    assert M.train_memory(SMALL, FP32).total == 35352


def test_train_memory_by_hand_with_checkpointing():
    # Layer inputs 10 x 2 x 4*8 = 640 stay; backward recomputes one layer (10 x 592) beside the
    # activation gradients (10 x 224): 8800 > the head's 640 + 1640 + 1200 + 320.
    need = M.train_memory(SMALL, attrs.evolve(FP32, checkpointing=True))
    assert (need.activations, need.logits, need.workspace) == (640 + 5920, 0, 2240)


def test_train_memory_by_hand_bf16_mixed_precision_fsdp():
    cfg = TrainMemoryConfig(param_dtype=torch.bfloat16, fsdp_shards=2, checkpointing=False, micro_batch_tokens=10)
    need = M.train_memory(SMALL, cfg)
    # State / 2: bf16 params and grads, fp32 moments and master weights.
    assert (need.params, need.grads, need.optimizer, need.master_weights) == (1272, 1272, 5088, 2544)
    # bf16 layer: norms 2*(32 + 4 + 32) = 136, attention 2*4*8 + 8 = 72, MLP 4*2*16 = 128 -> 336; head 100.
    # FSDP: two unsharded units and one unit's grads, 2 x (2*592 + 592) bytes; + the fp32 head gradient 320.
    assert (need.activations, need.logits, need.workspace) == (10 * (2 * 336 + 100), 1200, 3552 + 320)


def test_the_optimizer_step_can_be_the_peak():
    need = M.train_memory(SMALL, attrs.evolve(FP32, micro_batch_tokens=1))
    assert need == MemoryBreakdown(params=5088, grads=5088, optimizer=10176, workspace=5088)  # foreach AdamW temporary
    fused = M.train_memory(SMALL, attrs.evolve(FP32, micro_batch_tokens=1, fused_optimizer=True))
    assert fused.workspace == 320 and fused.logits == 3 * 4 * 1 * 10  # now the head's backward is the peak


def test_offload_removes_state_from_the_device():
    need = M.train_memory(SMALL, attrs.evolve(FP32, offload_optimizer=True, offload_params=True))
    assert need.params == need.grads == need.optimizer == need.master_weights == 0


def test_cpu_offload_leaves_the_gathered_units_and_their_shards_on_the_device_by_hand():
    # FSDP2's CPUOffloadPolicy: bf16 compute, fp32 shards (mixed precision), 2 shards, no checkpointing.
    cfg = TrainMemoryConfig(param_dtype=torch.bfloat16, fsdp_shards=2, checkpointing=False, micro_batch_tokens=10,
                            offload_params=True, offload_optimizer=True)
    need = M.train_memory(SMALL, cfg)
    assert need.params == need.grads == need.optimizer == need.master_weights == 0
    # Two gathered units and one unit's grads (bf16), 2 x (2*592 + 592) = 3552; the shards copied in for two
    # all-gathers and one unit's gradient shards on their way out, 3 x 4 x 296 = 3552; the fp32 head gradient 320.
    assert need.workspace == 3552 + 3552 + 320
    host = M.train_host_memory(SMALL, cfg)  # the whole state of one rank, and AdamW's step temporary on the CPU
    assert host == MemoryBreakdown(params=1272, grads=1272, optimizer=5088, master_weights=2544, workspace=2544)
    assert M.train_host_memory(SMALL, attrs.evolve(cfg, fused_optimizer=True)).workspace == 0
    assert M.train_host_memory(SMALL, attrs.evolve(cfg, offload_params=False, offload_optimizer=False)).total == 0


def test_with_cpu_offload_device_and_host_together_hold_the_state_once():
    shape = ModelShape.from_hf_config(get_preset("llama3-70b"))
    resident = TrainMemoryConfig(fsdp_shards=32, micro_batch_tokens=4096, fused_optimizer=True)
    offloaded = attrs.evolve(resident, offload_params=True, offload_optimizer=True)
    state = M.train_memory(shape, resident).persistent()
    assert M.train_host_memory(shape, offloaded) == state  # 16 bytes per parameter, / 32
    assert M.train_memory(shape, offloaded).persistent().total == 0
    assert M.train_memory(shape, offloaded).total < M.train_memory(shape, resident).total - state.total + 1 * M.GiB


def test_generate_memory_by_hand():
    need = M.generate_memory(SMALL, tp=1, batch_sequences=2, max_seq_len=5, dtype=torch.float32, prompt_len=3)
    # KV: 2 rows x 5 tokens x (K,V x 2 layers x 4 x 4 bytes); prefill 6 tokens x 4*(2*8 + 3*16); sampler 3 x [2, 10] fp32.
    assert need == MemoryBreakdown(params=5088, kv_cache=640, activations=1536, logits=240, workspace=320)
    split = M.generate_memory(SMALL, tp=2, batch_sequences=2, max_seq_len=5, dtype=torch.float32, prompt_len=3)
    assert (split.params, split.kv_cache, split.activations) == (2544, 640, 768)  # 1 kv head: replicated, not split


def test_infer_memory_by_hand():
    need = M.infer_memory(SMALL, batch_tokens=20, dtype=torch.float32)
    assert need == MemoryBreakdown(params=5088, activations=20 * (256 + 32), logits=2 * 4 * 20 * 10)
    sharded = M.infer_memory(SMALL, batch_tokens=20, dtype=torch.float32, shards=2, micro_batch_tokens=5)
    assert (sharded.params, sharded.activations, sharded.workspace) == (2544, 5 * 288, 4 * (592 + 592))


def test_infer_memory_of_an_offloaded_role_by_hand():
    need = M.infer_memory(SMALL, batch_tokens=20, dtype=torch.float32, shards=2, offload_params=True)
    # No resident parameters; the current and prefetched units, 4 x (592 + 592), and their fp32 shards, 2 x 4 x 296.
    assert (need.params, need.workspace) == (0, 4736 + 2368)
    alone = M.infer_memory(SMALL, batch_tokens=20, dtype=torch.float32, offload_params=True)  # one rank: still streamed
    assert (alone.params, alone.workspace) == (0, 4736 + 2 * 4 * 592)


def test_colocated_peak_by_hand():
    train = MemoryBreakdown(params=10, grads=10, optimizer=20, activations=50, workspace=5)
    generate = MemoryBreakdown(params=10, kv_cache=30, activations=20, logits=4)
    phases = {"policy.train": train, "policy.generate": generate}
    # offload=True: the generator sleeps while the policy trains; the trainer keeps its params (10)
    # while its generator runs; the sync holds the trainer's state (40) and the engine's weights (10).
    assert M.colocated_moments(phases, offload=True) == {
        "policy.train": train, "policy.generate": generate + MemoryBreakdown(params=10),
        "policy.sync_weights": MemoryBreakdown(params=20, grads=10, optimizer=20)}
    assert M.colocated_peak(phases, offload=True) == train
    assert M.colocated_peak(phases, offload=False) == MemoryBreakdown(
        params=20, grads=10, optimizer=20, kv_cache=30, activations=50, workspace=5)
    assert M.colocated_peak({}, offload=False).total == 0


def test_offload_keeps_a_second_trainers_state_and_a_frozen_roles_weights_on_the_device():
    """PPO colocated with offload=True: only the policy takes turns with its generator; the critic's
    state stays through the policy's update, the policy's through the critic's, the reference's weights always."""
    policy = MemoryBreakdown(params=10, grads=10, optimizer=40, master_weights=20, activations=50, workspace=5)
    critic = MemoryBreakdown(params=9, grads=9, optimizer=36, master_weights=18, activations=40)
    values = MemoryBreakdown(params=9, activations=7)  # the critic's forward, on the critic's weights
    ref = MemoryBreakdown(params=10, activations=6)
    generate = MemoryBreakdown(params=30, kv_cache=30, activations=20)
    phases = {"policy.train": policy, "policy.generate": generate, "critic.train": critic, "critic.infer": values,
              "ref.infer": ref}
    moments = M.colocated_moments(phases, offload=True)
    assert moments["policy.train"] == policy + critic.persistent() + MemoryBreakdown(params=10)  # 135 + 72 + 10
    assert moments["critic.train"] == critic + policy.persistent() + MemoryBreakdown(params=10)  # 112 + 80 + 10
    assert moments["policy.generate"] == generate + MemoryBreakdown(params=10) + critic.persistent() + MemoryBreakdown(params=10)
    # The values forward runs on the critic trainer's weights: its own figure holds them, not a second copy.
    assert moments["critic.infer"] == values + attrs.evolve(critic.persistent(), params=0) + policy.persistent() + \
        MemoryBreakdown(params=10)
    assert moments["ref.infer"] == ref + policy.persistent() + critic.persistent()
    assert moments["policy.sync_weights"] == MemoryBreakdown(params=30) + policy.persistent() + critic.persistent() + \
        MemoryBreakdown(params=10)
    assert M.colocated_peak(phases, offload=True) == moments["policy.train"]  # 217: not the largest phase alone (135)


def test_breakdown_helpers_and_text():
    a = MemoryBreakdown(params=3 * M.GiB, activations=512 * M.MiB)
    assert (a + a).total == 2 * a.total and MemoryBreakdown.sum([a, a, a]).params == 9 * M.GiB
    assert a.persistent() + a.transient() == a and MemoryBreakdown.largest([a, a + a]) == a + a
    assert a.as_dict()["total"] == a.total
    assert str(a) == "3.50 GiB (params 3.00 GiB, activations 512.0 MiB)"
    assert str(MemoryBreakdown()) == "0 B (nothing)"


def test_train_config_defaults_per_device_and_validation():
    assert M.TrainMemoryConfig.for_device("cpu").param_dtype == torch.float32
    assert not M.TrainMemoryConfig.for_device("cpu").has_master_weights
    assert M.TrainMemoryConfig.for_device("h100").has_master_weights
    with pytest.raises(ValueError, match="fsdp_shards must be an int >= 1"):
        TrainMemoryConfig(fsdp_shards=0)


def test_device_capacities():
    # one table of device memory (the hardware profiles, through the mesh); a mesh's memory_gib overrides it
    assert Mesh("h100").capacity_bytes == Mesh("a100").capacity_bytes == 80 * M.GiB and Mesh("h200").capacity_bytes == 141 * M.GiB
    assert Mesh("cpu", memory_gib=5).capacity_bytes == 5 * M.GiB


# -- the fit check ------------------------------------------------------------------------------
def test_infeasible_placement_names_role_rank_need_and_have():
    shape = ModelShape.from_hf_config(get_preset("llama3-70b"))
    need = M.train_memory(shape, TrainMemoryConfig(fsdp_shards=8, micro_batch_tokens=4096))
    with pytest.raises(M.PlacementError) as error:
        M.check_fits("policy", 3, need, Mesh("h100").capacity_bytes)
    text = str(error.value)
    assert text.startswith(f"role policy does not fit on rank 3: it needs {M.format_bytes(need.total)} "
                           "but the device has 80.0 GiB (short by")
    assert f"needs: {need}" in text and "optimizer 65.71 GiB" in text
    assert "fix: shard the training state over more ranks" in text and "offload" in text
    assert "activation checkpointing" not in text  # the step's temporary, not activations, is the peak here
    assert isinstance(error.value, ValueError)


def test_a_node_whose_host_memory_is_too_small_is_refused_naming_each_role():
    state = MemoryBreakdown(params=2 * M.GiB, optimizer=10 * M.GiB, workspace=4 * M.GiB)
    held = {"policy": (state, 8), "critic": (state, 8)}
    M.check_host_fits(0, held, 8 * 24 * M.GiB + 8 * 4 * M.GiB)  # two states, one step temporary at a time: fits
    with pytest.raises(M.PlacementError) as error:
        M.check_host_fits(1, held, 8 * 24 * M.GiB)
    text = str(error.value)
    assert text.startswith("the host memory of node 1 cannot hold what its ranks offload: they need 224.00 GiB but the "
                           "node has 192.0 GiB (short by 32.00 GiB)")
    assert "policy: 16.00 GiB (params 2.00 GiB, optimizer 10.00 GiB, workspace 4.00 GiB) on each of 8 rank(s)" in text
    assert "rg.Mesh(..., host_memory_gib=...)" in text


def test_fixes_start_with_the_largest_part():
    need = MemoryBreakdown(params=1 * M.GiB, activations=90 * M.GiB)
    with pytest.raises(M.PlacementError, match=r"fix: enable activation checkpointing .*\n +shard the training state"):
        M.check_fits("policy", 0, need, 80 * M.GiB)
    M.check_fits("policy", 0, need, 91 * M.GiB)  # fits: no error


# -- properties ---------------------------------------------------------------------------------
@st.composite
def shapes(draw, min_layers=1):
    kv_heads = draw(st.integers(1, 8))
    heads = kv_heads * draw(st.integers(1, 8))
    return ModelShape(hidden=draw(st.integers(8, 8192)), layers=draw(st.integers(min_layers, 96)), heads=heads,
                      kv_heads=kv_heads, head_dim=draw(st.sampled_from([16, 64, 128])),
                      intermediate=draw(st.integers(8, 32768)), vocab=draw(st.integers(2, 256_000)),
                      tie_embeddings=draw(st.booleans()), qkv_bias=draw(st.booleans()), value_head=draw(st.booleans()))


configs = st.builds(
    TrainMemoryConfig, param_dtype=st.sampled_from([torch.float32, torch.bfloat16]), mixed_precision=st.booleans(),
    fsdp_shards=st.integers(1, 64), checkpointing=st.booleans(), micro_batch_tokens=st.integers(1, 65536),
    seq_len=st.integers(1, 8192), offload_optimizer=st.booleans(), offload_params=st.booleans(),
    fused_attention=st.booleans(), fused_optimizer=st.booleans(),
)


@settings(max_examples=200, deadline=None)
@given(shapes(), configs, st.integers(2, 64), st.integers(1, 8))
def test_more_shards_never_need_more_per_rank(shape, cfg, shards, factor):
    """From 2 shards up (one shard has no all-gather buffers at all)."""
    fewer = M.train_memory(shape, attrs.evolve(cfg, fsdp_shards=shards))
    more = M.train_memory(shape, attrs.evolve(cfg, fsdp_shards=shards * factor))
    assert more.total <= fewer.total


@settings(max_examples=200, deadline=None)
@given(shapes(min_layers=2), configs)
def test_checkpointing_never_needs_more_activation_bytes(shape, cfg):
    """With two or more layers (checkpointing a single layer keeps its input as well)."""
    plain = M.train_memory(shape, attrs.evolve(cfg, checkpointing=False))
    checkpointed = M.train_memory(shape, attrs.evolve(cfg, checkpointing=True))
    assert checkpointed.activations <= plain.activations and checkpointed.total <= plain.total


@settings(max_examples=200, deadline=None)
@given(shapes(), configs, st.integers(1, 65536))
def test_more_tokens_never_need_less(shape, cfg, extra):
    assert M.train_memory(shape, cfg).total <= M.train_memory(shape, attrs.evolve(cfg, micro_batch_tokens=cfg.micro_batch_tokens + extra)).total


@settings(max_examples=200, deadline=None)
@given(shapes(), configs, st.integers(1, 1024), st.integers(1, 8192), st.integers(1, 8), st.booleans(), st.booleans())
def test_offload_never_raises_the_colocated_peak(shape, cfg, sequences, seq_len, tp, with_ref, with_critic):
    phases = {"policy.train": M.train_memory(shape, cfg),
              "policy.generate": M.generate_memory(shape, tp=tp, batch_sequences=sequences, max_seq_len=seq_len)}
    if with_ref:
        phases["ref.infer"] = M.infer_memory(shape, batch_tokens=sequences * seq_len)
    if with_critic:
        phases["critic.train"] = M.train_memory(shape, cfg)
    offloaded = M.colocated_peak(phases, offload=True)
    resident = M.colocated_peak(phases, offload=False)
    assert max(part.total for part in phases.values()) <= offloaded.total <= resident.total
    # offload=True parks only the generating trainer's state: a second trainer's stays beside the first's step.
    if with_critic:
        assert offloaded.total >= phases["policy.train"].total + phases["critic.train"].persistent().total


@settings(max_examples=200, deadline=None)
@given(shapes(), st.integers(1, 1024), st.integers(1, 8192), st.integers(1, 8), st.integers(1, 8))
def test_more_tensor_parallelism_never_needs_more_per_rank(shape, sequences, seq_len, tp, factor):
    fewer = M.generate_memory(shape, tp=tp, batch_sequences=sequences, max_seq_len=seq_len)
    more = M.generate_memory(shape, tp=tp * factor, batch_sequences=sequences, max_seq_len=seq_len)
    assert more.total <= fewer.total


# -- measured -----------------------------------------------------------------------------------
def _memory_check():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "memory_check.py"
    spec = importlib.util.spec_from_file_location("memory_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("checkpointing", [False, True])
def test_estimate_is_within_25_percent_of_a_measured_training_step(checkpointing):
    """Two AdamW steps of the tiny demo model on 64 demonstrations, every live tensor counted."""
    check = _memory_check()
    batch, tokenizer = check.demonstrations(64)
    row = check.measure_train_step(batch, tokenizer, checkpointing=checkpointing)
    assert abs(row.error) <= 0.25, f"estimate {row.estimate} vs measured {row.measured} bytes"


def test_a_phase_is_sized_by_its_largest_primitive_and_each_by_its_own_rows():
    """ReMax generates N samples then B greedy ones on the same group: the phase's peak is the N one,
    and the greedy generation is sized (and described) at B rows."""
    import rlgraph as rg
    from rlgraph.algorithms import remax
    from rlgraph.passes.memory_plan import batch_rows

    sizes = {"B": 64, "P": 512, "T": 1024}
    compiled = rg.compile(remax, mesh="gpu:8", placement=rg.split({"policy": 4, "rollout": 4}), sizes=sizes,
                          models={"policy": "qwen2.5-7b"}, n=8, micro_batch_size=2)
    generates = [n for n in compiled.program.graph.nodes if n.name in ("generate", "generate_1")]
    concrete = compiled.options.concrete(8)
    assert [batch_rows(n, concrete) for n in generates] == [512, 64]
    only_greedy = M.generate_memory(ModelShape.from_hf_config(get_preset("qwen2.5-7b")), tp=1, batch_sequences=64 // 4, max_seq_len=1536,
                                    dtype=torch.bfloat16, prompt_len=512)
    sampled = M.generate_memory(ModelShape.from_hf_config(get_preset("qwen2.5-7b")), tp=1, batch_sequences=512 // 4, max_seq_len=1536,
                                dtype=torch.bfloat16, prompt_len=512)
    kv = compiled.plan.memory["rollout"]["generate"]["kv_cache"]
    assert kv == sampled.kv_cache and kv > only_greedy.kv_cache
    assert "64 samples (64 prompts x n=1)" in compiled.as_text()


# -- whole processes of a spmd run: the controller and each rank -----------------------------------
def test_a_cpu_rank_holds_every_phase_placed_on_it_and_the_controller_no_model():
    """On a cpu mesh the device is host memory: a rank of a colocated GRPO plan holds the policy's
    shards and AdamW state, the engine's full copy and the reference's shard at once (an offload step
    moves nothing there), plus the largest phase's transient parts."""
    import rlgraph as rg
    from rlgraph.algorithms import grpo

    plan = rg.compile(grpo, mesh="cpu:2", placement=rg.colocated(), sizes={"B": 2, "P": 16, "T": 4, "n": 2},
                      models={"policy": "qwen2.5-0.5b"}, kl=0.01).plan
    processes = M.process_memory(plan)
    assert set(processes) == {"controller", "rank 0", "rank 1"} and processes["controller"].total == 0
    phases = {f"{group}.{phase}": MemoryBreakdown(**{k: v for k, v in parts.items() if k != "total"})
              for group, by_phase in plan.memory.items() for phase, parts in by_phase.items()}
    persistent = MemoryBreakdown.sum(part.persistent() for part in phases.values())
    largest = max(part.transient().total for part in phases.values())
    assert processes["rank 0"].total == processes["rank 1"].total == persistent.total + largest
    params = ModelShape.from_hf_config(get_preset("qwen2.5-0.5b")).n_params
    # engine copy 4n, policy shard 4n/2 + grads 4n/2 + two moments 8n/2, reference shard 4n/2
    assert persistent.params + persistent.grads + persistent.optimizer == pytest.approx(4 * params + 10 * params, rel=0.01)


LORA_QV = {"r": 8, "alpha": 16.0, "dropout": 0.0, "target_modules": ("q_proj", "v_proj")}


def _lora_plan(placement):
    import rlgraph as rg
    from rlgraph.algorithms import grpo

    return rg.compile(grpo, mesh="cpu:2", placement=placement, sizes={"B": 2, "P": 16, "T": 4, "n": 2},
                      models={"policy": "qwen2.5-0.5b"}, kl=0.01, lora={"policy": LORA_QV})


def test_a_colocated_lora_rank_holds_the_base_once_and_its_engine_only_the_adapted_linears():
    """With the run's options, a LoRA policy that trains and generates on the same cpu ranks is counted
    as the FSDP2 executor holds it (`shares_base`): the fp32 base whole, once (4n), the adapters
    sharded with their gradients and AdamW moments, the engine's merged q and v weights; the units
    gathered in forward and backward are adapters, not the base's (the embedding's 0.5 GiB)."""
    import rlgraph as rg

    compiled = _lora_plan(rg.colocated(offload=False))
    shape = ModelShape.from_hf_config(get_preset("qwen2.5-0.5b"))
    n, a = shape.n_params, shape.lora_params(LoraShape(8, ("q_proj", "v_proj")))
    adapted = 24 * (896 * 896 + 896 * 128)  # q [896, 896] and v [128, 896] of each of the 24 layers
    plain, held = M.process_memory(compiled.plan), M.process_memory(compiled.plan, compiled.options)
    for rank in ("rank 0", "rank 1"):
        assert held[rank].params == 4 * n + 4 * a // 2 + 4 * adapted
        assert held[rank].grads == 4 * a // 2 and held[rank].optimizer == 2 * 4 * a // 2
        # before: the base's shard (2n) and the engine's full copy (4n); the base's gathered units and
        # the head's [V, H] fp32 buffer (a frozen fp32 head has none) left the transient part too
        assert plain[rank].params == 2 * n + 4 * a // 2 + 4 * n
        assert held[rank].workspace < 64 * 2**20 < plain[rank].workspace
    assert held["controller"].total == 0


def test_a_lora_policy_that_does_not_generate_on_its_ranks_keeps_its_shards():
    """Split placement: the engine is on another rank, so the base stays sharded (nothing shares it)."""
    import rlgraph as rg

    compiled = _lora_plan(rg.split({"policy": 1, "rollout": 1, "ref": "policy"}))
    assert M.process_memory(compiled.plan, compiled.options) == M.process_memory(compiled.plan)


@pytest.mark.parametrize("bad", ["options", {"lora": {}}, 3])
def test_process_memory_refuses_options_that_are_not_the_runs(bad):
    import rlgraph as rg

    with pytest.raises(TypeError, match="options must be the run's CompileOptions"):
        M.process_memory(_lora_plan(rg.colocated(offload=False)).plan, bad)


def test_an_accelerator_rank_holds_in_host_memory_what_the_plan_offloads():
    import rlgraph as rg
    from rlgraph.algorithms import grpo

    plan = rg.compile(grpo, mesh="h100:2", placement=rg.colocated(cpu_offload=True), sizes={"B": 2, "P": 16, "T": 4, "n": 2},
                      models={"policy": "qwen2.5-0.5b"}, kl=0.01).plan
    processes = M.process_memory(plan)
    assert processes["rank 0"].total == sum(parts["total"] for parts in plan.host_memory.values()) > 0


SMALL_QWEN2 = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "rms_norm_eps": 1e-6,
               "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
               "intermediate_size": 1024, "vocab_size": 151936, "tie_word_embeddings": True,
               "max_position_embeddings": 512}


def _small_scale_run(tmp_path, *options: str) -> dict:
    """benchmarks/scale.py on a 43M-parameter Qwen2 shape (hidden 256, 4 layers, Qwen's 151,936-token
    vocabulary): GRPO with KL, AdamW, 2 gloo ranks, 2 steps; its report (peaks against the model)."""
    import json

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "scale.py"
    spec = importlib.util.spec_from_file_location("scale", path)
    scale = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scale)
    (tmp_path / "small").mkdir()
    (tmp_path / "small" / "config.json").write_text(json.dumps(SMALL_QWEN2))
    out = tmp_path / "figures.json"
    assert scale.main(["--model", str(tmp_path / "small" / "config.json"), "--model-dir", str(tmp_path / "model"),
                       "--out", str(tmp_path), "--steps", "2", "--interval", "0.1", "--json", str(out), *options]) == 0
    report = json.loads(out.read_text())
    assert set(report["vs_memory_model"]) == {"controller", "rank 0", "rank 1"}, report["vs_memory_model"]
    return report


@pytest.mark.slow
def test_each_process_of_a_small_spmd_run_is_within_25_percent_of_the_memory_model(tmp_path):
    """Each process's sampled peak RSS against the memory model's figure for it plus a baseline measured
    first (a fresh interpreter that imported torch, transformers and rlgraph: ~0.5 GiB, the part no
    model of tensors can count). 25% is the issue's bound; the model's part is ~60% of a rank's
    estimate here, so a model off by 40% fails it."""
    report = _small_scale_run(tmp_path)
    processes = report["vs_memory_model"]
    for name, row in processes.items():
        assert abs(row["error"]) <= 0.25, (name, row, report["baseline_rss_gib"])
    assert processes["controller"]["measured_gib"] < report["fp32_policy_gib"] + report["baseline_rss_gib"]


@pytest.mark.slow
def test_each_process_of_a_small_spmd_lora_run_is_within_25_percent_and_holds_the_base_once(tmp_path):
    """The same run with LoRA r=16 on q, k, v, o (`scale.py --lora 16`): each rank builds the peft model
    on the meta device, reads its base from the model directory and runs its engine on that base,
    so a rank holds one fp32 base (0.17 GiB here), not the shard, the engine's copy and a start-up
    build besides (2.5 bases before). Each process within 25% of the model; each rank's peak above
    the baseline below 2 fp32 bases (the rank count times a full copy; one base plus the transients,
    ~0.04 GiB in the model, is 1.3 here)."""
    report = _small_scale_run(tmp_path, "--lora", "16")
    processes, baseline, base = report["vs_memory_model"], report["baseline_rss_gib"], report["fp32_policy_gib"]
    for name, row in processes.items():
        assert abs(row["error"]) <= 0.25, (name, row, baseline)
    for rank in ("rank 0", "rank 1"):
        assert processes[rank]["measured_gib"] - baseline < 2 * base, (processes[rank], baseline, base)
    assert processes["controller"]["measured_gib"] < base + baseline

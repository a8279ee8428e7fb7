"""Images through the primitives: the native engine prefills each prompt once with its pixels and mrope
positions, the training forward (padded or packed) reads the same positions and features, the per-row
image-token check holds in every forward, and a VLM GRPO step runs the same compiled as eager."""

import attrs
import pytest
import torch
from hypothesis import given, settings, strategies as st
from PIL import Image

import rlgraph.testing as rgt
from rlgraph.algorithms import grpo
from rlgraph.backends.local.state import LMWorker
from rlgraph.backends.local.executor import LocalExecutor, RewardWorker
from rlgraph.backends.local.generation import NativeGenerator
from rlgraph.backends.local.counter_sampling import SamplingParams
from rlgraph.backends.local.logprobs import sequence_logprobs
from rlgraph.backends.local.models import build_causal_lm
from rlgraph.backends.local.vlm import (
    ImageTokenError, build_image_processor, build_vision_lm, build_vl_tokenizer, vl_prompts,
)
from rlgraph.backends.local.vlm_forward import continued_positions
from rlgraph.testing.tiny import length_parity_reward

# 8x8 px -> 2x2 patches of 4 px -> 1 image token (2x2 merge); 16x8 -> 2 tokens; 16x16 -> 4 tokens
SIZES = [(8, 8), (16, 8), (16, 16)]
COLOURS = [(220, 30, 30), (30, 200, 40), (40, 60, 230)]


@pytest.fixture(scope="module")
def vl():
    tokenizer = build_vl_tokenizer()
    model = build_vision_lm(tokenizer=tokenizer, seed=0).eval()
    return tokenizer, model, build_image_processor(model.config, max_pixels=16 * 16)


def _prompts(vl, rows):
    """`rows`: (text, [(w, h, colour index), ...]) each."""
    tokenizer, _, processor = vl
    images = [[Image.new("RGB", (w, h), COLOURS[c]) for w, h, c in spec] for _, spec in rows]
    return vl_prompts(tokenizer, processor, [text for text, _ in rows], images, {"text": [t for t, _ in rows]})


MIXED = [("ab=", [(16, 16, 0)]), ("colour=", [(16, 8, 1), (8, 8, 2)]), ("no image=", [])]


def _generate(vl, prompts, n=3, steps=5, temperature=1.0):
    tokenizer, model, _ = vl
    engine = NativeGenerator(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return engine.generate(prompts, n, SamplingParams(temperature=temperature, max_new_tokens=steps), seed=3)


def test_generation_runs_the_vision_tower_once_a_prompt_and_training_recomputes_its_logprobs(vl):
    """Sampling log-probs (prefill with pixels + mrope, then decode) equal the training forward's
    (one padded forward over prompt ++ response with the same images and positions), fp32 1e-5."""
    _, model, _ = vl
    prompts = _prompts(vl, MIXED)
    seen = []
    hook = model.model.visual.register_forward_hook(lambda module, args, kwargs_out: seen.append(args[0].shape[0]))
    try:
        rollouts = _generate(vl, prompts)
    finally:
        hook.remove()
    # one tower call for the prompts' 3 images (16 + 8 + 4 patches), not one per sample
    assert seen == [int(prompts.image_grid_thw.prod(-1).sum())]
    assert len(rollouts) == 9 and torch.equal(rollouts.image_grid_thw, prompts.image_grid_thw.repeat_interleave(3, 0))
    with torch.no_grad():
        recomputed = sequence_logprobs(model, rollouts)  # [N, T]
    assert torch.allclose(recomputed, rollouts.logprobs, atol=1e-5), (recomputed - rollouts.logprobs).abs().max()


def test_the_training_forward_runs_a_prompts_tower_and_rope_index_once_for_its_samples(vl):
    """The n samples of a prompt (rows `generate` repeats) share one tower run and one `get_rope_index`
    over the prompt; the positions equal the model's `get_rope_index` over every whole row, and with a
    trainable tower the log-probs and gradients equal row-by-row forwards (shared features' gradients
    add up), fp32 1e-5."""
    tokenizer, _, processor = vl
    model = build_vision_lm(tokenizer=tokenizer, seed=0, train_vision=True).eval()
    prompts = _prompts(vl, MIXED)
    rollouts = _generate((tokenizer, model, processor), prompts, n=3)
    width = rollouts.prompt_ids.shape[1]
    ids = torch.cat([rollouts.prompt_ids, rollouts.response_ids], 1)  # [N, P+T]
    real = torch.cat([rollouts.prompt_mask, rollouts.attention_mask], 1)  # [N, P+T]
    image = (ids == model.config.image_token_id) & torch.cat([rollouts.prompt_mask, torch.zeros_like(rollouts.mask)], 1)
    grid = rollouts.image_grid_thw.reshape(-1, 3)
    whole, _ = model.model.get_rope_index(ids, mm_token_type_ids=image.int(), image_grid_thw=grid[grid.prod(-1) > 0],
                                          attention_mask=real.long())  # [3, N, P+T]
    assert torch.equal(continued_positions(model, ids, real, image, rollouts.image_grid_thw, width)[:, real],
                       whole[:, real])
    seen = []
    hook = model.model.visual.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[0]))
    try:
        model.zero_grad()
        shared = sequence_logprobs(model, rollouts)  # [N, T]
        shared.sum().backward()
    finally:
        hook.remove()
    assert seen == [int(prompts.image_grid_thw.prod(-1).sum())]  # the 3 prompts' patches, not the 9 rows'
    tower = {name: param.grad.clone() for name, param in model.model.visual.named_parameters()}
    model.zero_grad()
    alone = torch.cat([sequence_logprobs(model, rollouts.select([row])) for row in range(len(rollouts))])  # [N, T]
    alone.sum().backward()
    assert torch.allclose(shared, alone, atol=1e-5)
    for name, param in model.model.visual.named_parameters():
        assert torch.allclose(tower[name], param.grad, atol=1e-5), name
    assert max(grad.abs().max() for grad in tower.values()) > 1e-3  # the tower did get a gradient


def test_the_images_change_what_the_model_says(vl):
    _, model, _ = vl
    rollouts = _generate(vl, _prompts(vl, MIXED[:1]), n=2)
    other = attrs.evolve(rollouts, pixel_values=torch.flip(rollouts.pixel_values, [-1]))
    with torch.no_grad():
        assert not torch.allclose(sequence_logprobs(model, rollouts), sequence_logprobs(model, other), atol=1e-4)


def test_a_row_whose_image_tokens_disagree_with_its_grids_is_refused_by_row(vl):
    tokenizer, model, _ = vl
    prompts = _prompts(vl, MIXED)
    pad = model.config.image_token_id
    ids = prompts.ids.clone()
    column = int((ids[1] == pad).nonzero()[0])
    ids[1, column] = tokenizer.convert_tokens_to_ids("a")  # one image token of row 1 lost
    broken = attrs.evolve(prompts, ids=ids)
    with pytest.raises(ImageTokenError, match=r"generate: row 1 \(batch index 1\) has 2 image tokens .* give 3"):
        _generate(vl, broken)
    rollouts = _generate(vl, prompts, n=1)
    bad = attrs.evolve(rollouts, prompt_ids=ids)
    with pytest.raises(ImageTokenError, match=r"rg.logprobs / rg.update\): row 1 has 2 image tokens"):
        sequence_logprobs(model, bad)
    extra = attrs.evolve(rollouts, image_grid_thw=torch.zeros_like(rollouts.image_grid_thw))  # grids lost
    with pytest.raises(ImageTokenError, match=r"row 0 has 4 image tokens .* its 0 image\(s\) give 0"):
        sequence_logprobs(model, extra)
    text_model = build_causal_lm(seed=0)  # the text tiny Qwen2
    with pytest.raises(ImageTokenError, match="carries images but the model is Qwen2ForCausalLM, a text model"):
        sequence_logprobs(text_model, rollouts)


def test_a_sampled_image_token_in_a_response_is_read_as_text(vl):
    """The engine feeds a sampled image-pad token back as a plain token; the training forward must too
    (counting it as an image would fail the feature count, verl #3469), and tokens before it are untouched."""
    _, model, _ = vl
    rollouts = _generate(vl, _prompts(vl, MIXED[:1]), n=1, steps=4, temperature=0.0)
    response = rollouts.response_ids.clone()
    response[0, 2] = model.config.image_token_id
    forced = attrs.evolve(rollouts, response_ids=response, mask=torch.ones_like(rollouts.mask),
                          logprobs=torch.zeros(response.shape))
    with torch.no_grad():
        lp = sequence_logprobs(model, forced)
        base = sequence_logprobs(model, attrs.evolve(forced, response_ids=rollouts.response_ids))
    assert torch.isfinite(lp).all() and torch.allclose(lp[0, :2], base[0, :2], atol=1e-6)


rows_strategy = st.lists(st.tuples(st.sampled_from(["ab=", "colour of it=", "x"]),
                                   st.lists(st.tuples(st.sampled_from(SIZES), st.integers(0, 2)), max_size=2),
                                   st.integers(1, 4)), min_size=1, max_size=3)


@settings(max_examples=4, deadline=None)
@given(rows=rows_strategy)
def test_packed_equals_padded_with_images(vl, rows):
    """Rows laid end to end (positions restarting, images in row order) give the padded forward's
    log-probs and gradients; fp32 summation order only (1e-5)."""
    _, model, _ = vl
    prompts = _prompts(vl, [(text, [(w, h, c) for (w, h), c in spec]) for text, spec, _ in rows])
    rollouts = _generate(vl, prompts, n=1, steps=4)
    lengths = torch.tensor([length for _, _, length in rows])
    mask = torch.arange(rollouts.mask.shape[1])[None] < lengths[:, None].clamp(max=rollouts.mask.shape[1])
    rollouts = attrs.evolve(rollouts, mask=mask & rollouts.mask)
    results = []
    for packed in (False, True):
        model.zero_grad()
        lp = sequence_logprobs(model, rollouts, packed=packed)
        lp.sum().backward()
        grad = model.lm_head.weight.grad.clone()
        results.append((lp.detach(), grad))
    model.zero_grad()
    assert torch.allclose(results[0][0], results[1][0], atol=1e-5)
    assert torch.allclose(results[0][1], results[1][1], atol=1e-5)


def _vl_executor():
    tokenizer = build_vl_tokenizer()
    policy = build_vision_lm(tokenizer=tokenizer, seed=0)
    ref = build_vision_lm(tokenizer=tokenizer, seed=0)
    models = {"policy": LMWorker(policy, torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.1)),
              "ref": LMWorker(ref)}
    return LocalExecutor(models, {"reward": RewardWorker(length_parity_reward)}, tokenizer, max_new_tokens=4, seed=0)


def test_a_vlm_grpo_step_runs_the_same_compiled_as_eager(vl):
    """The plan runner (fused kernels' torch references) against the eager interpreter on the tiny
    Qwen2-VL: two GRPO steps with a KL to the reference, images in every forward."""
    batches = [_prompts(vl, MIXED[:2]), _prompts(vl, [("x", [(8, 8, 2)]), ("ab=", [(16, 16, 1)])])]
    metrics = rgt.assert_compiled_matches_eager(grpo, executor=_vl_executor, batches=batches, n=4, kl=0.1,
                                                max_new_tokens=4, sizes={"B": 2, "P": batches[0].ids.shape[1], "T": 4})
    assert min(step["policy/grad_norm"] for step in metrics) > 0  # every step moved the policy: a real comparison


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["colocated", "split"])
def test_a_vlm_grpo_step_on_two_fsdp_ranks_one_without_images_matches_local(vl, tmp_path, placement):
    """Colocated: rank 1's prompt has no image: it runs no vision tower (the tower is part of the root
    FSDP2 unit, gathered with the root, so no collective waits on it). Split: rank 1 generates from the
    policy synced from rank 0 (tower included) and the rollouts move to rank 0 with their pixels. Both
    ranks' steps equal one process's."""
    import rlgraph as rg
    from rlgraph.backends.local.vlm import TINY_VL_CONFIG
    from rlgraph.backends.world import RoleSpec, WorldSpec
    from rlgraph.runtime.plan_runner import PlanRunner
    from rlgraph.runtime.spmd import SpmdTransport
    from tests.helpers import assert_same_metrics, assert_same_training, state_of

    tokenizer = vl[0]
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    world = WorldSpec({"policy": RoleSpec(source=str(TINY_VL_CONFIG), optimizer="sgd", lr=0.1)},
                      {"reward": length_parity_reward}, tokenizer=str(tmp_path / "tokenizer"), max_new_tokens=4)
    prompts = _prompts(vl, [("ab=", [(16, 16, 0)]), ("no image=", [])])
    chosen = (rg.colocated(offload=False, checkpointing=False) if placement == "colocated"
              else rg.split({"policy": 1, "rollout": 1}, checkpointing=False))
    compiled = rg.compile(grpo, mesh="cpu:2", placement=chosen,
                          sizes={"B": 2, "P": prompts.ids.shape[1], "T": 4}, n=4, max_new_tokens=4)
    local_executor = world.build_local()
    before = state_of(local_executor.models["policy"])
    with SpmdTransport(compiled.plan, world, device="cpu") as transport:
        local = PlanRunner(compiled, local_executor).run(prompts)[1]
        spmd = PlanRunner(compiled, transport, controller=world.controller()).run(prompts)[1]
        assert_same_metrics(local, spmd)
        assert_same_training(local_executor.models["policy"], transport.pull_state("policy"), before, steps=1)
    assert local["policy/grad_norm"] > 0

"""Prompts: the sampling index. Rollouts.concat: padding, group renumbering, metadata. to_device. Images per row."""

import attrs
import pytest
import torch

from rlgraph.batches import Prompts, Rollouts, to_device


def prompts(rows, **index):
    return Prompts(torch.arange(rows * 2).reshape(rows, 2), torch.ones(rows, 2, dtype=torch.bool),
                   {"id": list(range(rows))}, **index)


def test_prompt_index_defaults_to_positions_and_select_keeps_it():
    batch = prompts(5)
    assert batch.index.tolist() == [0, 1, 2, 3, 4] and batch.index.dtype == torch.long
    shard = batch.select([3, 1])
    assert shard.index.tolist() == [3, 1] and shard.meta == {"id": [3, 1]}
    assert shard.select([1]).index.tolist() == [1]  # a shard of a shard still names the controller's rows


def test_prompt_index_must_be_i64_per_prompt():
    for bad in (torch.arange(4), torch.zeros(5, dtype=torch.int32), torch.arange(5)[None]):
        with pytest.raises(ValueError, match=r"index must be i64\[B\] with B=5"):
            prompts(5, index=bad)


def rollouts(groups, steps, width, fill=1.0, meta=None):
    rows = len(groups)
    return Rollouts(torch.full((rows, width), 7), torch.ones(rows, width, dtype=torch.bool),
                    torch.full((rows, steps), 5), torch.ones(rows, steps, dtype=torch.bool),
                    torch.full((rows, steps), fill), torch.tensor(groups), meta or {"id": list(range(rows))})


def test_concat_pads_responses_right_and_prompts_left():
    a, b = rollouts([0, 0], steps=2, width=3), rollouts([0, 0], steps=4, width=1, fill=2.0)
    both = Rollouts.concat([a, b], pad_id=9)
    assert both.response_ids.shape == (4, 4) and both.prompt_ids.shape == (4, 3)
    assert both.mask.sum(-1).tolist() == [2, 2, 4, 4]
    assert both.response_ids[0].tolist() == [5, 5, 9, 9] and both.logprobs[0].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert both.prompt_ids[2].tolist() == [9, 9, 7] and both.prompt_mask[2].tolist() == [False, False, True]
    assert both.meta == {"id": [0, 1, 0, 1]}


def test_concat_renumbers_groups_in_order_and_never_merges_parts():
    both = Rollouts.concat([rollouts([3, 3, 1, 1], 2, 2), rollouts([0, 0, 3, 3], 2, 2)])
    assert both.group.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


def test_concat_of_one_batch_is_that_batch_with_contiguous_ids():
    one = rollouts([2, 2, 0, 0], 3, 2)
    again = Rollouts.concat([one])
    assert again.group.tolist() == [0, 0, 1, 1]
    for field in ("prompt_ids", "prompt_mask", "response_ids", "mask", "logprobs"):
        assert torch.equal(getattr(again, field), getattr(one, field)), field


def test_concat_refuses_nothing_and_mismatched_meta():
    with pytest.raises(ValueError, match="at least one"):
        Rollouts.concat([])
    with pytest.raises(ValueError, match="meta fields differ"):
        Rollouts.concat([rollouts([0], 1, 1), rollouts([0], 1, 1, meta={"other": [1]})])


def test_pad_responses_right_pads_to_a_static_length_and_refuses_shrinking():
    from rlgraph.testing import tiny_executor, tiny_prompts
    from rlgraph.backends.protocols import ModelRef

    executor = tiny_executor(max_new_tokens=6)
    ro = executor.generate(ModelRef("policy", 0), tiny_prompts(3), n=2)
    assert ro.response_ids.shape == (6, 6)  # the executor's rollouts always have T = max_new_tokens
    padded = ro.pad_responses(9, pad_id=0)
    assert padded.response_ids.shape == (6, 9) and not padded.mask[:, 6:].any()
    assert torch.equal(padded.logprobs[:, :6], ro.logprobs) and (padded.logprobs[:, 6:] == 0).all()
    assert ro.pad_responses(6) is ro
    with pytest.raises(ValueError, match="more than 3"):
        ro.pad_responses(3)


def test_to_device_moves_every_tensor_and_leaves_the_rest():
    batch = prompts(3, index=torch.tensor([4, 5, 6]))
    moved = to_device(batch, "meta")  # a second device without a GPU: tensors with shapes and no data
    assert all(t.device.type == "meta" for t in (moved.ids, moved.mask, moved.index))
    assert moved.meta == batch.meta and moved.ids.shape == (3, 2)
    nested = to_device((torch.zeros(2), [torch.ones(1), "name"], {"n": torch.ones(3), "v": 2}), "meta")
    assert isinstance(nested, tuple) and isinstance(nested[1], list) and nested[1][1] == "name" and nested[2]["v"] == 2
    assert nested[0].is_meta and nested[1][0].is_meta and nested[2]["n"].is_meta


def test_to_device_on_the_device_already_copies_nothing():
    value = torch.arange(3)
    assert to_device(value, "cpu") is value
    batch = prompts(2)
    same = to_device(batch, torch.device("cpu"))
    assert all(getattr(same, name) is getattr(batch, name) for name in ("ids", "mask", "index"))


def test_rollouts_made_from_checked_rollouts_skip_the_value_checks(monkeypatch):
    """The value checks (finite log-probs at real tokens, group ids) cost host syncs; rows selected,
    responses padded, parts concatenated or moved to a device keep values that were checked when
    they were made, so only a batch built from new tensors is checked."""
    import rlgraph.batches as batches

    calls = []
    check = batches._check_rollout_values
    monkeypatch.setattr(batches, "_check_rollout_values", lambda ro: (calls.append(len(ro)), check(ro)))
    ro = rollouts([0, 0, 1, 1], steps=3, width=2)
    assert calls == [4]  # a new batch is checked
    derived = [ro.select([0, 2]), ro.pad_responses(5), Rollouts.concat([ro, ro]), to_device(ro, "cpu")]
    assert calls == [4] and [len(r) for r in derived] == [2, 4, 8, 4]
    bad = ro.logprobs.clone()
    bad[1, 0] = float("nan")
    with pytest.raises(ValueError, match="sample 1, token 0"):
        Rollouts(ro.prompt_ids, ro.prompt_mask, ro.response_ids, torch.ones_like(ro.mask), bad, ro.group)


def _images(rows, width, count, patches):
    """Per-row images: `patches[r]` patches of row r in one image of grid (1, 1, patches[r]), padded to `width`."""
    pixels = torch.zeros(rows, width, 3)
    grid = torch.zeros(rows, count, 3, dtype=torch.long)
    for row, used in enumerate(patches):
        pixels[row, :used] = row + 1.0
        if used:
            grid[row, 0] = torch.tensor([1, 1, used])
    return pixels, grid


def test_images_travel_with_their_rows_through_select_concat_and_demonstrations():
    pixels, grid = _images(3, 4, 1, [4, 2, 0])
    batch = Prompts(torch.ones(3, 2, dtype=torch.long), torch.ones(3, 2, dtype=torch.bool), {"id": [0, 1, 2]},
                    pixel_values=pixels, image_grid_thw=grid)
    shard = batch.select([2, 0])
    assert shard.pixel_values[:, 0, 0].tolist() == [0.0, 1.0] and shard.image_grid_thw[:, 0, 2].tolist() == [0, 4]
    demos = Rollouts.from_demonstrations(batch, torch.ones(3, 2, dtype=torch.long), torch.ones(3, 2, dtype=torch.bool))
    wide_pixels, wide_grid = _images(1, 6, 2, [6])
    wide = attrs.evolve(rollouts([0], 2, 2), pixel_values=wide_pixels, image_grid_thw=wide_grid)
    both = Rollouts.concat([demos.select([1]), wide, rollouts([0], 2, 2)])
    # padded to the widest K (6) and most images (2); a part without images gets zero grids
    assert both.pixel_values.shape == (3, 6, 3) and both.image_grid_thw.shape == (3, 2, 3)
    assert both.image_grid_thw[:, 0, 2].tolist() == [2, 6, 0] and both.pixel_values[0, :, 0].tolist() == [2, 2, 0, 0, 0, 0]
    moved = to_device(both.select([1]), "cpu")
    assert torch.equal(moved.pixel_values, wide_pixels)


@pytest.mark.parametrize("bad, message", [
    ({"pixel_values": torch.zeros(2, 4, 3)}, "come together; got only pixel_values"),
    ({"pixel_values": torch.zeros(2, 4), "image_grid_thw": torch.zeros(2, 1, 3, dtype=torch.long)}, r"float \[R, K, D\]"),
    ({"pixel_values": torch.zeros(2, 4, 3), "image_grid_thw": torch.zeros(2, 1, 3)}, r"i64\[R, I, 3\]"),
    ({"pixel_values": torch.zeros(2, 4, 3), "image_grid_thw": torch.tensor([[[1, 1, 2]], [[1, 2, 3]]])},
     r"row 1's image grids \[\[1, 2, 3\]\] need 6 patches but pixel_values holds 4"),
])
def test_bad_images_are_refused_naming_the_field_and_row(bad, message):
    with pytest.raises(ValueError, match=message):
        Prompts(torch.ones(2, 2, dtype=torch.long), torch.ones(2, 2, dtype=torch.bool), **bad)

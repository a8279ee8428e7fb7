"""The strategies draw what they promise: well-formed batches, partitions, permutations, placements."""

import math

import torch
from hypothesis import given, strategies as st

import rlgraph.testing as rgt
from rlgraph.passes.place import resolve_groups
from rlgraph.passes.options import CompileOptions
from rlgraph.passes.partition import partition
from rlgraph.algorithms import grpo
from rlgraph.testing import RolloutBatch


@given(rgt.rollout_batches(log_ratio=5.0))
def test_rollout_batches_are_contiguous_equal_groups_with_right_padded_masks(batch):
    sizes = [len(rows) for rows in batch.groups]
    assert len(set(sizes)) == 1 and batch.n == sizes[0]
    assert torch.equal(batch.group, torch.arange(len(sizes)).repeat_interleave(sizes[0]))
    lengths = batch.mask.sum(-1)
    assert torch.equal(batch.mask, torch.arange(batch.T) < lengths[:, None])  # right padding, rows may be empty
    assert (batch.logprobs <= 0).all() and (batch.old_logprobs <= 0).all() and (batch.ref_logprobs <= 0).all()
    assert ((batch.old_logprobs - batch.logprobs).abs() <= 5.0).all()
    assert torch.isfinite(batch.rewards).all()


@given(rgt.rollout_batches(equal_groups=False, holes=True, groups=(2, 3)))
def test_ragged_groups_and_holes_when_asked(batch):
    assert batch.group.unique().numel() >= 2
    assert torch.equal(batch.group, torch.sort(batch.group).values)  # still contiguous


@given(rgt.rollout_batches(fields=("advantages",)))
def test_fields_not_asked_for_are_zeros(batch):
    assert (batch.logprobs == 0).all() and (batch.rewards == 0).all()


@given(st.data())
def test_micro_batch_splits_partition_the_rows(data):
    rows = data.draw(st.integers(0, 20))
    split = data.draw(rgt.micro_batch_splits(rows))
    assert sorted(row for piece in split for row in piece) == list(range(rows)) and all(split)


@given(st.data())
def test_group_permutations_keep_groups_contiguous(data):
    batch = data.draw(rgt.rollout_batches())
    rows, labels = data.draw(rgt.group_permutations(batch))
    permuted = batch.select(rows).relabel(labels)
    assert sorted(rows) == list(range(batch.N))
    blocks = [permuted.group[i:i + batch.n] for i in range(0, batch.N, batch.n)]
    assert all((block == block[0]).all() for block in blocks)
    assert torch.equal(permuted.rewards, batch.rewards[rows])


@given(st.data())
def test_padding_keeps_every_unmasked_value(data):
    batch = data.draw(rgt.rollout_batches())
    extra, fill = data.draw(rgt.padding_of(batch))
    padded = batch.padded(extra, fill)
    assert padded.T == batch.T + extra and not padded.mask[:, batch.T:].any()
    for name in rgt.TOKEN_FIELDS:
        assert torch.equal(getattr(padded, name)[:, :batch.T][batch.mask], getattr(batch, name)[batch.mask])


@given(rgt.rollout_batches())
def test_to_source_rebuilds_the_batch_exactly(batch):
    namespace = {"torch": torch, "RolloutBatch": RolloutBatch}
    exec(batch.to_source("again"), namespace)
    again = namespace["again"]
    for name in rgt.FIELDS:
        assert torch.equal(getattr(again, name), getattr(batch, name)), name


def test_to_source_writes_non_finite_values_as_python():
    batch = RolloutBatch.of(group=[0], mask=[[True]], rewards=[math.inf], logprobs=[[math.nan]])
    namespace = {"torch": torch, "RolloutBatch": RolloutBatch}
    exec(batch.to_source("again"), namespace)
    assert namespace["again"].rewards.item() == math.inf and math.isnan(namespace["again"].logprobs.item())


@given(rgt.sizes(), rgt.tensor_specs(), st.data())
def test_sizes_are_consistent_and_tensors_match_their_spec(sizes, spec, data):
    assert sizes["N"] == sizes["B"] * sizes["n"]
    tensor = data.draw(rgt.tensors_of(spec, sizes))
    assert tensor.dtype == spec.dtype and tensor.numel() == spec.numel(sizes)


@given(st.data())
def test_placements_are_valid_on_their_mesh(data):
    mesh = data.draw(rgt.meshes())
    placement = data.draw(rgt.placements(mesh, ("policy", "ref")))
    options = CompileOptions(mesh, placement, {"B": 4, "n": 2, "P": 8, "T": 8})
    program = partition(grpo.trace(n=2, kl=0.01), options)
    groups = resolve_groups(program, options)  # raises PlacementConfigError on an invalid draw
    assert all(0 <= rank < mesh.size for group in groups for rank in group.ranks)


def test_profiles_are_registered_and_chosen_by_the_environment(monkeypatch):
    from hypothesis import settings

    current = settings._current_profile
    try:
        monkeypatch.setenv("HYPOTHESIS_PROFILE", "thorough")
        assert rgt.load_profile() == "thorough" and settings.default.max_examples == 500
        assert rgt.load_profile("fast") == "fast" and settings.default.max_examples == 25
    finally:
        settings.load_profile(current)

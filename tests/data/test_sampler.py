import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlgraph.data.arithmetic import Problem, PromptSampler
from rlgraph.data.sampler import Sampler
from rlgraph.errors import ConfigError


def test_epoch_order_is_pinned():
    # The epoch-order formula (torch seed = seed * 1_000_003 + epoch) is part of the resume contract:
    # a run checkpointed before an upgrade must see the same batches after it.
    sampler = Sampler(list(range(10)), 3, seed=0)
    assert [sampler.next_batch() for _ in range(4)] == [[4, 1, 7], [5, 3, 9], [0, 8, 6], [5, 6, 1]]
    assert sampler.epoch == 1 and sampler.batches_per_epoch == 3
    assert Sampler(list(range(10)), 3, seed=7).next_batch() == [3, 1, 8]


def test_each_epoch_covers_items_once_and_skips_the_tail():
    sampler = Sampler([f"row{i}" for i in range(50)], 8, seed=3)
    first = [x for _ in range(6) for x in sampler.next_batch()]  # 48 of 50: the tail of 2 is skipped
    second = [x for _ in range(6) for x in next(sampler)]
    assert len(set(first)) == 48 and len(set(second)) == 48 and first != second
    assert sampler.epoch == 1 and sampler.position == 48


def test_unshuffled_walks_in_order():
    sampler = Sampler("abcde", 2, shuffle=False)
    assert [sampler.next_batch() for _ in range(3)] == [["a", "b"], ["c", "d"], ["a", "b"]]


def test_same_seed_same_batches_other_seed_other_batches():
    def batches(seed):
        sampler = Sampler(list(range(40)), 5, seed=seed)
        return [sampler.next_batch() for _ in range(20)]
    assert batches(1) == batches(1) and batches(1) != batches(2)


@settings(max_examples=25, deadline=None)
@given(count=st.integers(1, 30), data=st.data(), seed=st.integers(0, 10_000), shuffle=st.booleans())
def test_resume_mid_epoch_sees_the_same_batches(count, data, seed, shuffle):
    batch_size = data.draw(st.integers(1, count))
    steps = data.draw(st.integers(0, 3 * count))
    sampler = Sampler(list(range(count)), batch_size, seed=seed, shuffle=shuffle)
    for _ in range(steps):
        sampler.next_batch()
    state = sampler.state_dict()
    expected = [sampler.next_batch() for _ in range(count + 3)]
    resumed = Sampler(list(range(count)), batch_size, seed=seed + 1, shuffle=shuffle)  # seed comes from the state
    resumed.load_state_dict(dict(state))
    assert [resumed.next_batch() for _ in range(count + 3)] == expected


def test_prompt_sampler_is_a_sampler_and_reads_old_states():
    problems = [Problem(a, 1) for a in range(12)]
    demo = PromptSampler(problems, 4, seed=5)
    assert isinstance(demo, Sampler) and demo.problems == tuple(problems)
    generic = Sampler(problems, 4, seed=5)
    assert [demo.next_batch() for _ in range(7)] == [generic.next_batch() for _ in range(7)]
    old_state = {"seed": 5, "epoch": 2, "position": 4, "batch_size": 4, "num_problems": 12}  # saved before Sampler
    resumed = PromptSampler(problems, 4)
    resumed.load_state_dict(old_state)
    assert (resumed.epoch, resumed.position) == (2, 4)
    assert [resumed.next_batch() for _ in range(4)] == [generic.next_batch() for _ in range(4)]


@pytest.mark.parametrize(("items", "batch_size", "seed", "message"), [
    ([], 1, 0, "got no items"),
    ([1, 2, 3], 0, 0, r"batch_size must be an integer in \[1, 3\].*got 0"),
    ([1, 2, 3], 4, 0, r"batch_size must be an integer in \[1, 3\].*got 4"),
    ([1, 2, 3], True, 0, "batch_size.*got True"),
    ([1, 2, 3], 2, "7", "seed must be an integer, got '7'"),
])
def test_bad_arguments_are_refused(items, batch_size, seed, message):
    with pytest.raises(ConfigError, match=message):
        Sampler(items, batch_size, seed=seed)


def test_prompt_sampler_errors_speak_of_problems():
    with pytest.raises(ValueError, match=r"batch_size must be an integer in \[1, 2\] \(the number of problems\)"):
        PromptSampler([Problem(1, 1), Problem(2, 2)], 3)


@pytest.mark.parametrize(("change", "message"), [
    ({"num_items": 11}, r"saved with \{'batch_size': 4, 'num_items': 11, 'shuffle': True\}, this sampler has "
                        r"\{'batch_size': 4, 'num_items': 12, 'shuffle': True\}"),
    ({"batch_size": 3}, r"saved with \{'batch_size': 3, .*this sampler has \{'batch_size': 4"),
    ({"shuffle": 0}, r"'shuffle': False\}, this sampler has .*'shuffle': True\}"),
    ({"position": 13}, "position=13 is out of range for 12 items"),
    ({"epoch": -1}, "epoch=-1, position=0 is out of range"),
])
def test_a_state_for_other_data_is_refused(change, message):
    sampler = Sampler(list(range(12)), 4)
    state = {**sampler.state_dict(), **change}
    with pytest.raises(ConfigError, match=message):
        sampler.load_state_dict(state)
    assert sampler.state_dict() == Sampler(list(range(12)), 4).state_dict()  # untouched by the refused load


def test_a_state_missing_keys_is_refused():
    with pytest.raises(ConfigError, match=r"the state lacks \['epoch', 'position'\]"):
        Sampler(list(range(12)), 4).load_state_dict({"seed": 0, "batch_size": 4})

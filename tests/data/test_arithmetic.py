import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlgraph.backends.local.models import load_tokenizer
from rlgraph.data.arithmetic import Problem, PromptSampler, make_splits, to_demonstrations, to_prompts


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def splits():
    return make_splits(seed=0)


def test_problem_text():
    assert (Problem(12, 9).prompt, Problem(12, 9).answer) == ("12+9=", "21")


def test_splits_partition_all_pairs(splits):
    assert (len(splits.train), len(splits.dev), len(splits.test)) == (9600, 200, 200)
    train, dev, test = set(splits.train), set(splits.dev), set(splits.test)
    assert not (train & dev or train & test or dev & test)
    assert train | dev | test == {Problem(a, b) for a in range(100) for b in range(100)}


def test_splits_are_deterministic_per_seed(splits):
    assert make_splits(seed=0) == splits
    assert make_splits(seed=1).test != splits.test


def test_configurable_range_and_errors():
    small = make_splits(seed=0, low=1, high=9, test_size=10, dev_size=5)
    assert (len(small.train), len(small.dev), len(small.test)) == (66, 5, 10)
    assert all(1 <= p.a <= 9 and 1 <= p.b <= 9 for p in small.train)
    with pytest.raises(ValueError, match="must leave some"):
        make_splits(low=0, high=9, test_size=60, dev_size=40)
    with pytest.raises(ValueError, match="low <= high"):
        make_splits(low=5, high=4)


def test_prompts_are_left_padded_with_meta(tokenizer):
    problems = [Problem(1, 2), Problem(34, 56)]
    prompts = to_prompts(problems, tokenizer)
    assert prompts.ids.shape == (2, 7) and prompts.mask[:, -1].all()
    assert prompts.mask[0].tolist() == [False, False, True, True, True, True, True]
    assert prompts.ids[0, :2].tolist() == [tokenizer.pad_token_id] * 2 and prompts.ids[0, 2] == tokenizer.bos_token_id
    assert tokenizer.batch_decode(prompts.ids, skip_special_tokens=True) == ["1+2=", "34+56="]
    assert prompts.meta == {"answer": ["3", "90"], "text": ["1+2=", "34+56="]}


def test_demonstrations_are_answer_then_eos(tokenizer):
    problems = [Problem(1, 2), Problem(50, 60)]
    demo = to_demonstrations(problems, tokenizer)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    three, one, zero = (tokenizer.convert_tokens_to_ids(c) for c in "310")
    assert demo.response_ids.tolist() == [[three, eos, pad, pad], [one, one, zero, eos]]
    assert demo.mask.tolist() == [[True, True, False, False], [True] * 4]
    assert demo.group.tolist() == [0, 1] and (demo.logprobs == 0).all()
    assert torch.equal(demo.prompt_ids, to_prompts(problems, tokenizer).ids)
    assert demo.meta["answer"] == ["3", "110"]


def test_sampler_epochs_cover_every_problem_once(splits):
    problems = splits.dev[:50]
    sampler = PromptSampler(problems, 8, seed=3)
    first = [p for _ in range(6) for p in sampler.next_batch()]  # 48 of 50: the tail of 2 is skipped
    assert len(set(first)) == 48 and sampler.epoch == 0
    second = [p for _ in range(6) for p in next(sampler)]
    assert sampler.epoch == 1 and len(set(second)) == 48 and second != first


@settings(max_examples=15)
@given(steps=st.integers(0, 40), seed=st.integers(0, 100))
def test_sampler_resume_sees_the_same_batches(splits, steps, seed):
    problems = splits.dev[:30]
    sampler = PromptSampler(problems, 7, seed=seed)
    for _ in range(steps):
        sampler.next_batch()
    state = sampler.state_dict()
    expected = [sampler.next_batch() for _ in range(10)]
    resumed = PromptSampler(problems, 7, seed=12345)
    resumed.load_state_dict(state)
    assert [resumed.next_batch() for _ in range(10)] == expected


def test_sampler_errors(splits):
    with pytest.raises(ValueError, match="batch_size"):
        PromptSampler(splits.dev, 0)
    state = PromptSampler(splits.dev, 4).state_dict()
    with pytest.raises(ValueError, match="same problems and batch size"):
        PromptSampler(splits.dev, 5).load_state_dict(state)

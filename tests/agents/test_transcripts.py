"""Episodes as transcripts for samples.jsonl (rlgraph/agents/transcripts.py): turns cut by the masks."""

import torch
from hypothesis import given, settings, strategies as st

from rlgraph.agents.transcripts import transcripts
from rlgraph.batches import Rollouts
from rlgraph.ir.primitives import EPISODE_FIELDS


class Letters:
    """A tokenizer whose id i is the letter chr(97 + i): a decoded run shows exactly which ids it holds."""

    def decode(self, ids):
        return "".join(chr(97 + i) for i in ids)


def episode(kinds: list[str]) -> Rollouts:
    """One row whose response tokens are of `kinds` ("p": the policy's, "o": an observation's, ".": padding)."""
    T = len(kinds)
    mask = torch.tensor([[kind == "p" for kind in kinds]])
    context = torch.tensor([[kind != "." for kind in kinds]])
    return Rollouts(torch.tensor([[1, 2]]), torch.ones(1, 2, dtype=torch.bool), torch.arange(T)[None] % 26, mask,
                    torch.zeros(1, T), torch.zeros(1, dtype=torch.long), {"text": ["q?"], "answer": ["7"]}, context)


def test_a_two_turn_episode_reads_policy_observation_policy_with_each_turns_reward():
    ro = episode(list("ppoop..."))
    turn_rewards = torch.tensor([[0.0, 0.25, 0, 0, 1.0, 0, 0, 0]])
    episodes = torch.tensor([[1.25, 2, 1, 0, 0, 2, 0.1, 0, 0]])
    (row,) = transcripts(ro, episodes, turn_rewards, Letters(), limit=4)
    assert row["prompt"] == "q?" and row["answer"] == "7" and row["reward"] == 1.25
    assert row["turns"] == [{"role": "policy", "text": "ab", "reward": 0.25}, {"role": "env", "text": "cd"},
                            {"role": "policy", "text": "e", "reward": 1.0}]
    assert set(row["episode"]) == set(EPISODE_FIELDS) - {"reward"} and row["episode"]["turns"] == 2.0


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from("po."), min_size=1, max_size=12))
def test_every_real_token_is_in_exactly_one_turn_of_its_kind_in_order(kinds):
    ro = episode(kinds)
    (row,) = transcripts(ro, torch.zeros(1, len(EPISODE_FIELDS)), torch.zeros(1, len(kinds)), Letters(), limit=1)
    shown = "".join(turn["text"] for turn in row["turns"])
    assert shown == "".join(chr(97 + i % 26) for i, kind in enumerate(kinds) if kind != ".")
    roles = [turn["role"] for turn in row["turns"]]
    assert all(a != b for a, b in zip(roles, roles[1:]))  # padding between two runs of one kind does not split them

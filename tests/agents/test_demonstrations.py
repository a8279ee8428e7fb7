"""Multi-turn SFT traces (`rlgraph/agents/demonstrations.py`): observations are context, not targets."""

import pytest
import torch

from rlgraph.agents.demonstrations import trace_demonstrations
from rlgraph.agents.env import ObservationFormat
from rlgraph.data.prompts import PromptRow
from rlgraph.errors import ConfigError
from tests.helpers import TOKENIZER


def row(trace, source="t.jsonl:1"):
    return PromptRow("12*3=", "36", {"trace": trace}, source)


def encode(text):
    return TOKENIZER.encode(text, add_special_tokens=False)


def test_a_trace_becomes_policy_targets_around_observation_context():
    batch = trace_demonstrations([row(["calc(12*3)", "36", "36"]), row(["36"])], TOKENIZER, "trace",
                                 ObservationFormat("(", ")"))
    first = encode("calc(12*3)") + encode("(36)") + encode("36") + [TOKENIZER.eos_token_id]
    assert batch.response_ids[0].tolist() == first
    policy = [True] * len(encode("calc(12*3)")) + [False] * len(encode("(36)")) + [True] * 3
    assert batch.mask[0].tolist() == policy and batch.context_mask[0].all()
    assert batch.response_ids[1, :3].tolist() == encode("36") + [TOKENIZER.eos_token_id]
    assert batch.mask[1].tolist() == [True] * 3 + [False] * (len(first) - 3) and batch.context_mask[1].sum() == 3
    assert torch.equal(batch.logprobs, torch.zeros_like(batch.logprobs))


@pytest.mark.parametrize("trace", [[], ["a", "b"], "a", ["a", 3, "c"]])
def test_a_bad_trace_is_named_with_its_row(trace):
    with pytest.raises(ConfigError, match="t.jsonl:1 field 'trace': a trace is a list of turn texts"):
        trace_demonstrations([row(trace)], TOKENIZER, "trace", None)


def test_a_missing_trace_field_says_to_add_it():
    with pytest.raises(ConfigError, match="no trace field 'steps'.*\n  fix: add 'steps' to data.extra_fields"):
        trace_demonstrations([row(["a"])], TOKENIZER, "steps", None)

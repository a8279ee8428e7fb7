import pytest
import torch

from rlgraph.algorithms import vapo
from rlgraph.errors import TraceError
from rlgraph.runtime.eager import Interpreter
from tests.algorithms._steps import two_steps
from tests.helpers import make_executor, params_of, parity_reward, prompts


def executor_with_critic():
    """AdamW without weight decay: a zero gradient leaves the weights exactly as they were."""
    executor = make_executor(reward=parity_reward, max_new_tokens=4, critic=True)
    for role in ("policy", "critic"):
        worker = executor.models[role]
        worker.optimizer = torch.optim.AdamW(worker.model.parameters(), lr=1e-3, weight_decay=0.0)
    return executor


def test_vapo_trains_the_policy_and_the_critic_with_its_five_pieces():
    executor = executor_with_critic()
    text, metrics = two_steps(vapo, executor=executor, n=2, alpha=0.5, max_new_tokens=4)
    for op in ("values critic", "length_adaptive_lambda[alpha=0.5]", "decoupled_gae[gamma=1.0 lam_critic=1.0]",
               "masked_whiten", "ppo_clip[clip_low=0.2 clip_high=0.28 agg=token_mean]", "positive_nll",
               "positive_token_weight", "value_loss[clip=0.5]", "vapo_iteration:f32[]"):
        assert op in text, op
    assert "kl_k" not in text and "logprobs ref" not in text  # no KL term, no reference pass
    assert executor.current("critic").version == 2 and metrics["critic/grad_norm"] > 0
    assert metrics["policy_on"] == 1.0 and 0.0 <= metrics["lam_policy"] <= 1.0
    assert {"policy/positive_nll", "policy/clip_frac", "positive_fraction", "value"} <= metrics.keys()


def test_value_pretraining_trains_only_the_critic_for_the_first_iterations():
    executor = executor_with_critic()
    program, interpreter = vapo.trace(n=2, value_warmup=2, max_new_tokens=4), Interpreter(executor)
    policy_before, critics, gates = params_of(executor, "policy"), [params_of(executor, "critic")], []
    for step in range(3):
        _, metrics = interpreter.run(program, prompts(2, offset=2 * step))
        gates.append(metrics["policy_on"])
        critics.append(params_of(executor, "critic"))
        frozen = all(torch.equal(a, b) for a, b in zip(policy_before, params_of(executor, "policy")))
        assert frozen == (step < 2), step  # the warm-started policy samples while its critic pre-trains
        assert metrics["critic/grad_norm"] > 0
    assert gates == [0.0, 0.0, 1.0] and interpreter.carried["vapo_iteration"].item() == 3.0
    assert all(any(not torch.equal(a, b) for a, b in zip(old, new)) for old, new in zip(critics, critics[1:]))


@pytest.mark.parametrize("name, value", [("alpha", 0.0), ("alpha", -1.0), ("lm_coef", -0.1), ("value_warmup", 1.5),
                                         ("value_warmup", -1), ("lam_critic", 1.5), ("positive_reward", "yes")])
def test_bad_hyper_parameters_are_refused_naming_them(name, value):
    with pytest.raises(TraceError, match=f"vapo: {name}="):
        vapo.trace(**{name: value})

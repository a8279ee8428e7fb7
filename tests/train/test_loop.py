"""The Trainer feeds refill loops from its own sampler, so resume stays exact."""

import torch

from rlgraph.algorithms import dapo
from rlgraph.data import arithmetic
from rlgraph.runtime.eager import Interpreter
from rlgraph.train.loop import Trainer
from tests.helpers import SPLITS, TOKENIZER, make_executor, params_of
from tests.runtime.test_plan_runner import half_dead_reward


def _trainer(run_dir):
    executor = make_executor(reward=half_dead_reward)
    sampler = arithmetic.PromptSampler(SPLITS.train, batch_size=3, seed=1)
    program = dapo.trace(n=3, max_new_tokens=3, overlong_buffer=1, max_rounds=3)
    return Trainer(program, Interpreter(executor), lambda: arithmetic.to_prompts(sampler.next_batch(), TOKENIZER),
                   sampler, run_dir=run_dir, checkpoint_every=2), executor


def test_refill_rounds_draw_from_the_trainer_sampler_and_resume_exactly(tmp_path):
    straight, straight_exec = _trainer(tmp_path / "a")
    history = list(straight.run(steps=3))
    rounds = sum(metrics["filter/rounds"] for metrics in history)
    assert rounds > 3  # some step refilled
    assert straight.sampler.position == 3 * rounds  # one batch of 3 prompts per round, all from the sampler

    first, _ = _trainer(tmp_path / "b")
    list(first.run(steps=2))  # checkpoint at step 2
    resumed, resumed_exec = _trainer(tmp_path / "b")
    assert resumed.resume() and resumed.step == 2
    last = list(resumed.run(steps=1))[-1]
    assert last == {**history[-1], "time/step_s": last["time/step_s"]}
    for a, b in zip(params_of(straight_exec), params_of(resumed_exec)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

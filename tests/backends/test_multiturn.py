"""Multi-turn generation (`rlgraph/backends/local/multiturn.py`): KV-cache continuation, token in /
token out, counter-based sampling across turns, and the bad inputs of an environment."""

import time

import pytest
import torch

import rlgraph as rg
from rlgraph.agents.env import EnvError
from rlgraph.backends.local.counter_sampling import SamplingParams
from rlgraph.backends.local.logprobs import sequence_logprobs
from rlgraph.backends.local.multiturn import TurnDecoder, TurnLimits, decode_turn, left_pad
from rlgraph.backends.protocols import EnvRef
from rlgraph.testing import tiny_executor, tiny_prompts
from tests.helpers import RTOL, TOKENIZER

EOS, PAD = 2, 0


class Countdown(rg.Env):
    """Three turns; answers with a fixed text of digits (ids 4..13 of the char tokenizer)."""

    def reset(self, row):
        self.turn = 0

    def step(self, text):
        self.turn += 1
        return rg.Step("12" * self.turn, reward=float(self.turn), done=self.turn >= 3, info={"tool_calls": 1})


def run(executor, env, prompts, **options):
    executor.envs["env"] = env
    settings = dict(n=2, max_turns=3, max_tokens_per_turn=4, max_total_tokens=30) | options
    return executor.rollout(executor.current("policy"), EnvRef("env"), prompts, **settings)


def test_trained_ids_are_the_sampled_ids_and_recomputed_logprobs_match():
    """Token in, token out: the response is the sampled ids and the observation ids (tokenized
    once), and a training forward over it gives the sampling log-probs: the context the sampler
    saw (observations included, attended to) is the context the trainer sees."""
    executor = tiny_executor()
    ro, episodes, turn_rewards = run(executor, Countdown, tiny_prompts(3))
    observation = [TOKENIZER.encode("\n" + "12" * k + "\n", add_special_tokens=False) for k in (1, 2)]
    for row in range(len(ro)):
        ids, policy = ro.response_ids[row][ro.context_mask[row]].tolist(), ro.mask[row][ro.context_mask[row]].tolist()
        # split the context into runs: policy turn, observation, policy turn, observation, policy turn
        runs, current = [], [ids[0]]
        for index in range(1, len(ids)):
            if policy[index] == policy[index - 1]:
                current.append(ids[index])
            else:
                runs.append(current)
                current = [ids[index]]
        runs.append(current)
        assert runs[1] == observation[0] and runs[3] == observation[1], runs  # the adapter's ids, byte for byte
    model = executor.models["policy"].model.eval()
    with torch.no_grad():
        recomputed = sequence_logprobs(model, ro)  # [N, T]
    # the cache and the full forward sum the same terms in other orders: RTOL (tests/helpers.py) of values ~|lp|
    torch.testing.assert_close(recomputed, ro.logprobs, rtol=RTOL, atol=RTOL * 8)
    assert episodes[:, rg.EPISODE_FIELDS.index("reward")].tolist() == [6.0] * len(ro)  # 1 + 2 + 3
    assert episodes[:, rg.EPISODE_FIELDS.index("turns")].tolist() == [3.0] * len(ro)
    assert episodes[:, rg.EPISODE_FIELDS.index("tool_calls")].tolist() == [3.0] * len(ro)
    assert turn_rewards.sum(1).tolist() == [6.0] * len(ro)
    assert not (ro.mask & ~ro.context_mask).any() and (ro.logprobs[~ro.mask] == 0).all()


def test_a_second_turn_from_the_cache_prefills_only_the_new_tokens():
    """Counted at the model's input: turn 2 feeds the last sampled token and the observation, not the
    conversation; its tokens and log-probs equal those of a decoder that re-prefills everything."""
    model = tiny_executor().models["policy"].model.eval()
    fed = []
    hook = model.register_forward_pre_hook(lambda module, args, kwargs: fed.append(tuple(kwargs["input_ids"].shape)),
                                           with_kwargs=True)
    prompts = tiny_prompts(2)
    limits = TurnLimits(max_turns=2, per_turn=5, total=40, step_timeout=None)
    params = SamplingParams(temperature=1.0, max_new_tokens=5)
    keys = torch.tensor([11, 12])
    never = lambda row, ids: False  # noqa: E731 - no stop strings
    observation = [TOKENIZER.encode("7+8", add_special_tokens=False)] * 2
    try:
        with torch.no_grad():
            cached = TurnDecoder(model)
            cached.feed(prompts.ids, prompts.mask)
            first = decode_turn(cached, keys, [5, 5], 0, limits, params, EOS, never)
            fed.clear()
            cached.feed(*left_pad([p + o for p, o in zip(first.pending, observation)], PAD, "cpu"))
            assert fed == [(2, max(len(p) + len(o) for p, o in zip(first.pending, observation)))]  # only the new tokens
            second = decode_turn(cached, keys, [5, 5], 1, limits, params, EOS, never)

            fresh = TurnDecoder(model)
            contexts = [prompts.ids[r][prompts.mask[r]].tolist() + first.tokens[r] + observation[r] for r in range(2)]
            fresh.feed(*left_pad(contexts, PAD, "cpu"))  # the whole conversation at once
            again = decode_turn(fresh, keys, [5, 5], 1, limits, params, EOS, never)
    finally:
        hook.remove()
    assert second.tokens == again.tokens
    for a, b in zip(second.logprobs, again.logprobs):  # other summation orders: RTOL of |lp| (tests/helpers.py)
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=RTOL, atol=RTOL * 8)
    real_prompt = int(prompts.mask.sum())
    assert cached.fed_tokens < fresh.fed_tokens + real_prompt  # the cached path never fed the prompt twice


def test_rows_sample_the_same_whole_or_in_shards_and_finished_rows_leave():
    """Counter-based sampling across turns: a prompt's episodes do not depend on the rest of the batch,
    although rows end at different turns (so the batch shrinks differently in the two runs)."""
    class StopsEarly(Countdown):
        def step(self, text):
            step = super().step(text)
            return rg.Step(step.observation, step.reward, done=step.done or "1" in text)

    prompts = tiny_prompts(4)
    whole, whole_ep, _ = run(tiny_executor(), StopsEarly, prompts)
    half, half_ep, _ = run(tiny_executor(), StopsEarly, prompts.select([2, 3]))
    assert torch.equal(whole.response_ids[4:], half.response_ids) and torch.equal(whole.mask[4:], half.mask)
    torch.testing.assert_close(whole.logprobs[4:], half.logprobs, rtol=RTOL, atol=RTOL * 8)  # BLAS by row count
    assert torch.equal(whole_ep[4:, :6], half_ep[:, :6])  # not env_seconds


def test_an_observation_past_the_budget_is_cut_and_counted():
    class Verbose(Countdown):
        def step(self, text):
            return rg.Step("9" * 100, 0.0, False)

    ro, episodes, _ = run(tiny_executor(), Verbose, tiny_prompts(2), max_total_tokens=20)
    assert ro.context_mask.sum(1).tolist() == [19] * 4  # one policy token of room was kept, then nothing fits
    assert episodes[:, rg.EPISODE_FIELDS.index("budget_cut")].tolist() == [1.0] * 4


@pytest.mark.parametrize("answer, message", [
    (lambda text: 1 / 0, "Broken.step (row 0, turn 0) raised ZeroDivisionError"),
    (lambda text: "not a step", "returned str; an environment's step returns rg.Step"),
    (lambda text: rg.Step([99999]), "Broken.step (row 0, turn 0): Broken.step returned an observation of type list"),
])
def test_an_env_that_raises_or_returns_the_wrong_type_is_named(answer, message):
    class Broken(Countdown):
        def step(self, text):
            return answer(text)

    with pytest.raises(EnvError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        run(tiny_executor(), Broken, tiny_prompts(1))


def test_a_hanging_env_is_stopped_at_its_timeout():
    class Hangs(Countdown):
        def step(self, text):
            time.sleep(5)
            return rg.Step("", 0.0, True)

    started = time.perf_counter()
    with pytest.raises(EnvError, match=r"did not return within the step timeout of 0\.2 s\n  fix: .*step_timeout"):
        run(tiny_executor(), Hangs, tiny_prompts(1), step_timeout=0.2)
    assert time.perf_counter() - started < 4  # not the 5 s of the step


def test_an_unknown_env_role_and_a_bad_recipe_are_named():
    executor = tiny_executor()
    executor.envs.clear()  # the tiny executor's OnesEnv
    with pytest.raises(EnvError, match="no environment role 'env' here; the executor has none"):
        executor.rollout(executor.current("policy"), EnvRef("env"), tiny_prompts(1))
    with pytest.raises(EnvError, match="recipe must be callable"):
        run(executor, "Countdown", tiny_prompts(1))
    with pytest.raises(EnvError, match="int is not an environment"):
        run(executor, lambda: 3, tiny_prompts(1))


def test_a_token_env_answers_with_ids_that_go_into_the_response_as_given():
    class Ids:
        def initial_observation(self, row):
            return [5, 6]  # "12", before the first turn

        def step(self, action_tokens):
            return rg.Step([7, 8, 9], 1.0, len(action_tokens) < 0)  # never done: max_turns ends it

    ro, episodes, _ = run(tiny_executor(), Ids, tiny_prompts(1), n=1, max_turns=2, max_tokens_per_turn=3)
    context = ro.response_ids[0][ro.context_mask[0]].tolist()
    observation = (~ro.mask[0][ro.context_mask[0]]).tolist()
    assert context[:2] == [5, 6] and observation[:2] == [True, True]
    turn = observation.index(True, 2)  # the second observation starts after the first turn
    assert context[turn:turn + 3] == [7, 8, 9]
    assert episodes[0, rg.EPISODE_FIELDS.index("budget_cut")] == 1.0  # max_turns, not the env, ended it


def test_a_tool_call_s_closing_tag_ends_the_turn():
    from rlgraph.agents import ToolEnv, TextEnvAdapter, calculator
    from rlgraph.backends.local.multiturn import stop_checker

    decode = lambda ids: "".join(chr(i) for i in ids)  # noqa: E731 - a stand-in tokenizer: one char per id
    envs = [TextEnvAdapter(ToolEnv([calculator()], format="plain"), TOKENIZER), Countdown()]
    ends_turn = stop_checker(envs, decode)
    said = [ord(c) for c in "<tool>calculator(1)</tool"]
    assert not ends_turn(0, said) and ends_turn(0, said + [ord(">")])
    assert not ends_turn(1, said + [ord(">")])  # an env without stop strings: EOS or the cap end its turns


class ShowsColour(rg.Env):
    """Answers the policy's first turn with a 16x16 image (4 image tokens of the tiny Qwen2-VL) and a text."""

    def reset(self, row):
        self.turn = 0

    def step(self, text):
        from PIL import Image

        self.turn += 1
        return rg.Step("look", reward=float(len(text) % 2), done=self.turn >= 2, image=Image.new("RGB", (16, 16), (0, 90, 200)))


def test_an_environment_that_answers_with_an_image_is_seen_by_the_policy_and_the_trainer_alike():
    """A VLM rollout whose prompt and whose env observation carry images: each row holds both images
    (prompt's first), the observation's image tokens sit in its context, and the training forward
    (one pass, mrope over prompt, turns and image) gives the sampling log-probs (fp32, 1e-5)."""
    from PIL import Image

    from rlgraph.backends.local.state import LMWorker
    from rlgraph.backends.local.executor import LocalExecutor, RewardWorker
    from rlgraph.backends.local.vlm import build_image_processor, build_vision_lm, build_vl_tokenizer, vl_prompts

    tokenizer = build_vl_tokenizer()
    model = build_vision_lm(tokenizer=tokenizer, seed=0)
    executor = LocalExecutor({"policy": LMWorker(model)}, {"reward": RewardWorker(lambda c, **_: [0.0] * len(c))},
                             tokenizer, seed=0)
    processor = build_image_processor(model.config, max_pixels=16 * 16)
    prompts = vl_prompts(tokenizer, processor, ["what now=", "go="], [[Image.new("RGB", (8, 8), (200, 0, 0))], []])
    ro, _, _ = run(executor, ShowsColour, prompts, max_turns=2, max_tokens_per_turn=3, max_total_tokens=24)
    pad = model.config.image_token_id
    observed = ro.context_mask & ~ro.mask  # [N, T]
    assert ((ro.response_ids == pad) & observed).sum(1).tolist() == [4] * 4  # each row saw the env's image
    assert ro.image_grid_thw[:2, :, 1:].tolist() == [[[2, 2], [4, 4]]] * 2  # the prompt's 8x8, then the env's 16x16
    assert ro.image_grid_thw[2:, :1, 1:].tolist() == [[[4, 4]]] * 2  # the imageless prompt: only the env's
    with torch.no_grad():
        recomputed = sequence_logprobs(model.eval(), ro)  # [N, T]
    assert torch.allclose(recomputed, ro.logprobs, atol=1e-5), (recomputed - ro.logprobs).abs().max()

"""The environment protocols and adapters (`rlgraph/agents/env.py`)."""

import types

import pytest

import rlgraph as rg
from rlgraph.agents import EnvError, ObservationFormat, OpenEnvAdapter, TextEnvAdapter, as_token_env
from tests.helpers import TOKENIZER


class Say(rg.Env):
    def reset(self, row):
        return row.get("first")

    def step(self, action_text):
        self.heard = action_text
        return rg.Step("ok", 1, False)


def test_a_text_env_is_tokenized_once_with_its_markers():
    adapter = TextEnvAdapter(Say(), TOKENIZER, ObservationFormat("(", ")"))
    assert adapter.initial_observation({}) == []
    assert adapter.initial_observation({"first": "hi"}) == TOKENIZER.encode("(hi)", add_special_tokens=False)
    step = adapter.step(TOKENIZER.encode("abc", add_special_tokens=False) + [TOKENIZER.eos_token_id])
    assert adapter.env.heard == "abc" and step.observation == TOKENIZER.encode("(ok)", add_special_tokens=False)
    assert step.reward == 1.0 and isinstance(step.reward, float)


def test_markers_come_from_a_chat_template_that_has_them():
    template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    tokenizer = types.SimpleNamespace(chat_template=template, apply_chat_template=lambda messages, **kw: _render(
        template, messages, **kw))
    assert ObservationFormat.from_chat_template(tokenizer) == ObservationFormat("<|end|><|tool|>", "<|end|><|assistant|>")
    assert ObservationFormat.from_chat_template(types.SimpleNamespace(chat_template=None)) == ObservationFormat()


def _render(template, messages, tokenize=False, add_generation_prompt=False):
    import jinja2

    return jinja2.Template(template).render(messages=messages, add_generation_prompt=add_generation_prompt)


def test_an_openenv_style_env_is_adapted():
    class Echo:
        def reset(self):
            return types.SimpleNamespace(observation="start", reward=None, done=False)

        def step(self, action):
            return types.SimpleNamespace(observation={"said": action["message"]}, reward=0.5, done=True)

    env = OpenEnvAdapter(Echo(), make_action=lambda text: {"message": text}, render=lambda o: o["said"] if isinstance(o, dict) else o)
    assert env.reset({}) == "start"
    assert env.step("hello") == rg.Step("hello", 0.5, True)
    broken = OpenEnvAdapter(types.SimpleNamespace(step=lambda action: "done"), make_action=str)
    with pytest.raises(EnvError, match="without observation, reward, done"):
        broken.step("x")


@pytest.mark.parametrize("reward", ["1", None, [1.0]])
def test_a_step_reward_must_be_a_number(reward):
    with pytest.raises(TypeError, match="Step.reward must be a number"):
        rg.Step("", reward)


def test_something_that_is_no_env_is_named():
    with pytest.raises(EnvError, match="object is not an environment"):
        as_token_env(object(), TOKENIZER)
    with pytest.raises(EnvError, match="reset returned int"):
        TextEnvAdapter(types.SimpleNamespace(reset=lambda row: 3, step=None), TOKENIZER).initial_observation({})

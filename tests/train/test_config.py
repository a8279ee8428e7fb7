"""The `rlgraph train` config: schema, overrides, and errors that name the key, file and line."""

from __future__ import annotations

import os

import pytest

from rlgraph.errors import ConfigError
from rlgraph.train.config import TrainConfig, load_config

MINIMAL = """\
name: t
data:
  train: prompts.jsonl
rewards:
  - name: math
train: {steps: 3}
"""


def write(tmp_path, text, name="config.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_minimal_config_takes_the_documented_defaults(tmp_path):
    config = load_config(write(tmp_path, MINIMAL))
    assert config.algorithm.name == "grpo" and config.rollout.n == 8 and config.optimizer.lr == 1e-5
    assert config.rewards[0].name == "math" and config.rewards[0].weight == 1.0
    assert str(config.directory) == "runs/t"
    assert config.accuracy_reward == "math"


def test_resolved_config_round_trips_through_yaml(tmp_path):
    config = load_config(write(tmp_path, MINIMAL), ["optimizer.lr=3e-4", "model.lora={r: 4}"])
    again = load_config(None, base=__import__("yaml").safe_load(config.to_yaml()))
    assert again == config and again.model.lora.r == 4


def test_overrides_reach_nested_keys_and_list_items(tmp_path):
    config = load_config(write(tmp_path, MINIMAL), ["train.steps=10", "rewards.0.weight=0.5",
                                                      "algorithm.hparams.kl=0.04", "data.extra_fields=[tests, id]"])
    assert config.train.steps == 10 and config.rewards[0].weight == 0.5
    assert config.algorithm.hparams == {"kl": 0.04} and config.data.extra_fields == ["tests", "id"]


@pytest.mark.parametrize("text, expected", [
    ("data:\n  train: x\n  prompt_feild: q\nrewards: [{name: math}]\ntrain: {steps: 1}\n",
     "unknown key 'data.prompt_feild' (CONFIG:3); did you mean 'data.prompt_field'?"),
    ("data: {train: x}\nrewards:\n  - name: math\n    wieght: 2\ntrain: {steps: 1}\n",
     "unknown key 'rewards.0.wieght' (CONFIG:4); did you mean 'rewards.0.weight'?"),
    ("data: {train: x}\nrewards: [{name: math}]\ntrain: {steps: 1}\nrollout:\n  n: 0\n",
     "rollout.n: Input should be greater than or equal to 1 (got 0) (CONFIG:5)"),
    ("data: {train: x}\nrewards: [{name: math}]\ntrian: {steps: 1}\n",
     "unknown key 'trian' (CONFIG:3); did you mean 'train'?"),
    ("data: {train: x}\nrewards: []\ntrain: {steps: 1}\n", "rewards: algorithm 'grpo' scores its samples, but no reward is listed"),
    ("data: {train: x}\nrewards: [{name: math}]\n", "set train.steps or train.seconds"),
    ("rewards: [{name: math}]\ntrain: {steps: 1}\n", "missing key 'data'"),
    ("data: {train: x}\nrewards: [{name: math}, {name: math}]\ntrain: {steps: 1}\n", "reward 'math' is listed twice"),
])
def test_mistakes_are_named_with_their_line(tmp_path, text, expected):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert expected.replace("CONFIG", str(path)) in str(error.value)


def test_a_misspelt_override_is_attributed_to_the_flag(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'optimizer.lrr' \(-o\); did you mean 'optimizer.lr'"):
        load_config(write(tmp_path, MINIMAL), ["optimizer.lrr=1e-4"])


@pytest.mark.parametrize("override, expected", [
    ("train.steps", "must be written key=value"),
    ("=3", "must be written key=value"),
    ("rewards.5.weight=1", "'5' is not an index of a list of 1"),
    ("name.sub=1", "'name' holds 't', not a section"),
])
def test_bad_overrides(tmp_path, override, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(write(tmp_path, MINIMAL), [override])


def test_python_config_file(tmp_path):
    path = write(tmp_path, "config = {'data': {'train': 'x.jsonl'}, 'rewards': [{'name': 'math'}], 'train': {'steps': 2}}\n",
                 "config.py")
    assert load_config(path).train.steps == 2
    typed = write(tmp_path, "from rlgraph.train.config import TrainConfig\n"
                  "config = TrainConfig(data={'train': 'y'}, rewards=[{'name': 'math'}], train={'steps': 4})\n", "typed.py")
    assert load_config(typed).data.train == "y"


@pytest.mark.parametrize("name, text, expected", [
    ("missing.yaml", None, "does not exist"),
    ("config.toml", "a = 1", "unknown kind '.toml'"),
    ("list.yaml", "- 1\n- 2\n", "holds a list, not a mapping"),
    ("broken.yaml", "data: [unclosed\n", "is not valid YAML"),
    ("noconfig.py", "x = 1\n", "defines no `config`"),
])
def test_bad_config_files(tmp_path, name, text, expected):
    if text is not None:
        write(tmp_path, text, name)
    with pytest.raises(ConfigError, match=expected):
        load_config(tmp_path / name)


def test_config_is_frozen():
    config = TrainConfig(data={"train": "x"}, rewards=[{"name": "math"}], train={"steps": 1})
    with pytest.raises(Exception):
        config.train.steps = 5


def test_an_exponent_without_a_dot_is_a_float_as_for_minus_p(tmp_path):
    config = load_config(write(tmp_path, MINIMAL), ["algorithm.hparams.kl=1e-3", "algorithm.hparams.tag='1e-3'",
                                                    "algorithm.hparams.flag=yes"])
    assert config.algorithm.hparams == {"kl": 0.001, "tag": "1e-3", "flag": "yes"}  # yes is a word, not YAML 1.1's True


def test_rollout_takes_top_p_and_stop_strings(tmp_path):
    config = load_config(write(tmp_path, MINIMAL), ["rollout.top_p=0.9", 'rollout.stop=["\\n\\n", "###"]'])  # YAML escapes in "..."
    assert config.rollout.top_p == 0.9 and config.rollout.stop == ["\n\n", "###"]
    assert load_config(write(tmp_path, MINIMAL), ["rollout.stop=END"]).rollout.stop == ["END"]  # one string
    assert load_config(write(tmp_path, MINIMAL)).rollout.stop == []  # default: none


@pytest.mark.parametrize("override, expected", [
    ("rollout.top_p=0", r"rollout.top_p: Input should be greater than 0 \(got 0\) \(-o\)"),
    ("rollout.top_p=1.5", r"rollout.top_p: Input should be less than or equal to 1 \(got 1.5\) \(-o\)"),
    ("rollout.top_p=x", r"rollout.top_p: Input should be a valid number"),
    ("rollout.stop=''", r"rollout.stop: a stop string is empty"),
    ("rollout.stop=[a, '']", r"rollout.stop: a stop string is empty"),
    ("rollout.stop=[1]", r"rollout.stop.0: Input should be a valid string"),
    ("rollout.top_p=[0.5", r"-o rollout.top_p=\[0.5: '\[0.5' is not a value"),
])
def test_bad_rollout_values_name_the_key(tmp_path, override, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(write(tmp_path, MINIMAL), [override])


def test_generation_compile_defaults_to_auto(tmp_path):
    assert load_config(write(tmp_path, MINIMAL)).generation.compile == "auto"
    assert load_config(write(tmp_path, MINIMAL), ["generation.compile=off"]).generation.compile == "off"


@pytest.mark.parametrize("override, expected", [
    ("generation.compile=yes", r"generation.compile: Input should be 'auto', 'on' or 'off' \(got 'yes'\) \(-o\)"),
    ("generation.compile=true", r"generation.compile: Input should be 'auto', 'on' or 'off' \(got True\)"),
    ("generation.compile=1", r"generation.compile: Input should be 'auto', 'on' or 'off' \(got 1\)"),
    ("generation.compil=on", r"unknown key 'generation.compil' \(-o\); did you mean 'generation.compile'"),
])
def test_bad_generation_compile_values_name_the_key(tmp_path, override, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(write(tmp_path, MINIMAL), [override])


def test_a_reward_call_has_a_time_limit_by_default_and_null_lifts_it(tmp_path):
    """A hung reward must not hang the run silently (issue 25): one term's call on one batch fails,
    by `reward_on_error`, after 600 s unless the config says otherwise."""
    assert TrainConfig.model_fields["reward_timeout_s"].default == 600.0
    path = tmp_path / "run.yaml"
    path.write_text("data: {train: t.jsonl}\nrewards: [{name: math}]\ntrain: {steps: 1}\nreward_timeout_s: null\n")
    assert load_config(path).reward_timeout_s is None
    for bad in ("0", "-1", "soon"):
        path.write_text(f"data: {{train: t.jsonl}}\nrewards: [{{name: math}}]\ntrain: {{steps: 1}}\nreward_timeout_s: {bad}\n")
        with pytest.raises(ConfigError, match="reward_timeout_s"):
            load_config(path)


@pytest.mark.parametrize("override, expected", [
    ("reward_workers=-1", r"reward_workers: Input should be greater than or equal to 0 \(got -1\)"),
    ("reward_workers=two", r"reward_workers: Input should be a valid integer"),
    ("reward_workers=1.5", r"reward_workers: Input should be a valid integer"),
    ("reward_memory_mb=100", r"reward_memory_mb: Input should be greater than or equal to 1024 \(got 100\)"),
    ("reward_memory_mb=lots", r"reward_memory_mb: Input should be a valid integer"),
    ("reward_isolation=chroot", r"reward_isolation: Input should be 'auto', 'pidns' or 'process'"),
])
def test_bad_reward_pool_values_name_the_key(tmp_path, override, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(write(tmp_path, MINIMAL), [override])


def test_reward_workers_default_to_a_pool_and_zero_scores_in_the_controller(tmp_path, monkeypatch):
    from rlgraph.train.user_code import build_rewards

    monkeypatch.delenv("RLGRAPH_REWARD_WORKERS", raising=False)  # the suite's conftest sets 0
    config = load_config(write(tmp_path, MINIMAL))
    assert config.reward_workers is None and config.reward_memory_mb == 4096 and config.reward_isolation == "auto"
    pooled = build_rewards(config)  # nothing starts before the first call
    assert pooled.pool is not None and pooled.pool.size == min(4, len(os.sched_getaffinity(0))) and pooled.pool.pids() == []
    assert build_rewards(load_config(write(tmp_path, MINIMAL), ["reward_workers=0"])).pool is None


@pytest.mark.parametrize("value", ["yes", "1", "[true]"])
def test_overwrite_takes_only_true_or_false(tmp_path, value):
    """Issue 34, item 11: `overwrite` lets a fresh run write over the user's files, so a stray value
    ("yes", 1, a list) is refused rather than read as true."""
    with pytest.raises(ConfigError, match="overwrite"):
        load_config(write(tmp_path, MINIMAL), [f"overwrite={value}"])
    assert load_config(write(tmp_path, MINIMAL), ["overwrite=true"]).overwrite is True

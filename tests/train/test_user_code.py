"""The user's code in a run (`rlgraph.train.user_code`, `run.rollout_hparams`): an algorithm named
`file.py:fn` gets the rollout section's values for the keyword arguments it takes, and only those."""

from __future__ import annotations

import sys
import textwrap

import pytest

from rlgraph.errors import ConfigError
from rlgraph.train.setup import prepare
from rlgraph.train.user_code import import_modules, load_algorithm, load_object
from tests.train.test_run import make_config

ALGORITHMS = '''
    import rlgraph as rg


    @rg.algorithm
    def only_n(state: rg.State, prompts: rg.Prompts, *, n=2):     # fixes its own sampling
        ro = rg.generate(state.policy, prompts, n=n, temperature=0.5)
        return state, {"reward": rg.score(state.reward, ro).mean()}


    @rg.algorithm
    def takes_all(state: rg.State, prompts: rg.Prompts, *, n=1, temperature=1.0, top_p=1.0, max_new_tokens=None, stop=()):
        ro = rg.generate(state.policy, prompts, n=n, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                         stop=stop)
        return state, {"reward": rg.score(state.reward, ro).mean()}
'''


@pytest.fixture
def algos(tmp_path, monkeypatch):
    path = tmp_path / "run_algos.py"
    path.write_text(textwrap.dedent(ALGORITHMS))
    monkeypatch.delitem(sys.modules, "run_algos", raising=False)
    yield path
    sys.modules.pop("run_algos", None)


def test_an_algorithm_gets_only_the_rollout_keys_it_takes(tmp_path, algos):
    config, _ = make_config(tmp_path, "only_n", algorithm={"name": f"{algos}:only_n", "hparams": {}})
    plan = prepare(config).rl.as_text()
    assert "plan only_n" in plan and "16 samples (4 prompts x n=4), <= 4 new tokens, temperature 0.5;" in plan
    config, _ = make_config(tmp_path, "all", algorithm={"name": f"{algos}:takes_all", "hparams": {}},
                            rollout={"temperature": 0.7, "top_p": 0.9, "stop": ["\n", "##"]})
    plan = prepare(config).rl.as_text()
    assert "16 samples (4 prompts x n=4), <= 4 new tokens, temperature 0.7, top_p 0.9, stop after '\\n' or '##';" in plan


@pytest.mark.parametrize("rollout, key", [({"temperature": 0.7}, "temperature"), ({"top_p": 0.5}, "top_p"),
                                          ({"stop": ["\n"]}, "stop")])
def test_a_rollout_key_the_algorithm_would_ignore_is_refused_naming_it(tmp_path, algos, rollout, key):
    config, _ = make_config(tmp_path, "ignored", algorithm={"name": f"{algos}:only_n", "hparams": {}}, rollout=rollout)
    with pytest.raises(ConfigError, match=f"rollout.{key}=.*, but the algorithm '.*only_n' takes no '{key}' keyword"
                                          f"(.|\n)*fix: add `{key}=...` to its keyword arguments"):
        prepare(config)


def test_the_builtin_algorithms_and_the_evaluation_take_top_p_and_stop(tmp_path):
    config, _ = make_config(tmp_path, "grpo", rollout={"top_p": 0.9, "stop": ["="]})
    setup = prepare(config)
    assert "top_p 0.9, stop after '='" in setup.rl.as_text()
    assert "stop after '='" in setup.eval.as_text()  # held-out answers end as the rollouts do
    config, _ = make_config(tmp_path, "fixed", algorithm={"name": "grpo", "hparams": {"top_p": 0.5}})
    with pytest.raises(ConfigError, match="algorithm.hparams sets top_p(.|\n)*fix: set them in the rollout section"):
        prepare(config)


@pytest.mark.parametrize("name, message", [
    ("grpoo", "algorithm.name 'grpoo' is not an algorithm; did you mean 'grpo'?"),
    ("nowhere.py:f", "algorithm.name 'nowhere.py:f': cannot import nowhere.py: no file 'nowhere.py'"),
    ("{algos}:missing", "has no 'missing'"),
    ("{algos}:", "is not 'module:name' or 'file.py:name'"),
])
def test_a_bad_algorithm_name_is_a_config_error_naming_the_key(algos, name, message):
    with pytest.raises(ConfigError, match="fix: ") as error:
        load_algorithm(name.replace("{algos}", str(algos)), "algorithm.name")
    assert message in str(error.value)


def test_imports_and_objects_name_where_they_came_from(tmp_path, monkeypatch, algos):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="imports no_such_mod: No module named 'no_such_mod'"):
        import_modules(["no_such_mod"], "imports")
    assert load_object("run_algos:only_n", "rewards[0]").name == "only_n"  # found from the working directory


@pytest.mark.slow
def test_stop_strings_end_responses_alike_on_spmd_workers(tmp_path):
    """The FSDP executor cuts at stop strings as the local one does: the same rows on 2 ranks."""
    from tests.train.test_run import assert_rows_close, train_local_and_spmd

    local, spmd = train_local_and_spmd(tmp_path, ["train.steps=2", "warm_start.steps=0", "checkpoint.every=2",
                                                  "rollout.stop=['1']", "rollout.max_new_tokens=6"])
    assert_rows_close(spmd, local)
    assert all(row["response_length/mean"] < 6 for row in local)  # some responses ended early


def test_a_file_imports_its_siblings_as_python_file_py_would(tmp_path, monkeypatch):
    """`rlgraph trace project/algo.py:fn` from another directory: algo.py's `import helpers` resolves
    beside it, at import time and when its function runs."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "sibling_helpers_mod.py").write_text("SCALE = 3\n")
    (project / "sibling_algo_mod.py").write_text(textwrap.dedent('''
        import sibling_helpers_mod


        def scaled(x):
            import sibling_helpers_mod as again  # a lazy import, when the function runs
            return x * sibling_helpers_mod.SCALE * again.SCALE
    '''))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        assert load_object("project/sibling_algo_mod.py:scaled", "trace")(2) == 18
    finally:
        for name in ("sibling_helpers_mod", "sibling_algo_mod"):
            sys.modules.pop(name, None)


@pytest.mark.parametrize("names, expected", [
    (["rewards/mine.py:exact", "math"], ["exact", "math"]),                        # the function's name: not its path
    (["a/x.py:score", "b/y.py:score"], ["x:score", "y:score"]),                    # a clash: the file stems tell them apart
    (["a/x.py:score", "b/x.py:score"], ["a/x.py:score", "b/x.py:score"]),          # stems clash too: as written
    (["my.py:math", "math"], ["my:math", "math"]),                                 # a built-in's name stays the built-in's
    (["my.py:errors"], ["my:errors"]),                                             # reward/errors is the pipeline's count
    (["my_rewards:exact"], ["exact"]),                                             # a module:fn entry
])
def test_reward_metrics_are_named_by_the_function_and_disambiguated_only_on_a_clash(names, expected):
    from rlgraph.train.user_code import reward_metric_names

    assert reward_metric_names(names) == expected


def test_the_accuracy_reward_and_the_run_metrics_use_the_functions_name(tmp_path):
    from rlgraph.train.user_code import accuracy_metric, build_rewards

    (tmp_path / "metric_rewards.py").write_text("def exact(completions, answer, **_):\n"
                                                "    return [float(c.strip() == a) for c, a in zip(completions, answer)]\n")
    config, _ = make_config(tmp_path, "named", [f"rewards=[{{name: '{tmp_path}/metric_rewards.py:exact'}}, {{name: math}}]"])
    assert accuracy_metric(config) == "exact"
    pipeline = build_rewards(config)
    try:
        pipeline(["7", "8"], answer=["7", "7"])
        assert {"reward/exact", "reward/math"} <= set(pipeline.pop_metrics())
    finally:
        sys.modules.pop("metric_rewards", None)

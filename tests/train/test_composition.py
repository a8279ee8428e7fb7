"""Everything composes (issue 32): one property draws a whole `rlgraph train` configuration.

algorithm x runtime x placement x staleness x LoRA x packing x evaluation, each run with a
checkpoint every step and resumed from the middle. A drawn combination either runs to the end,
resumes exactly (the same metrics, evaluations and weights as the uninterrupted run) and, on spmd
or Ray with a colocated placement, equals the local run; or it is refused before step 1 with the
reason `REFUSALS` gives (the table of docs/composition.md).

Cost: `make test` runs the explicit `EXAMPLES` only (one spmd run with its resume, one local run with
its resume, two refusals); `make test-thorough` (HYPOTHESIS_PROFILE=thorough) adds `THOROUGH_EXAMPLES`
(Ray included) and 40 fresh draws.
"""

from __future__ import annotations

import os
import shutil
import textwrap
from pathlib import Path

import pytest
from hypothesis import Phase, example, given, settings, strategies as st

from rlgraph.errors import ConfigError
from rlgraph.train.run import load_run_config, train
from tests.helpers import assert_rows_close
from tests.train.test_run import assert_same_run, make_config, metrics_of, train_rows

THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"

# What is refused, in the order the run checks it, and the reason it gives (docs/composition.md).
REFUSALS = (
    (lambda c: c["algorithm"] == "sft", r"algorithm.name 'sft' trains on given rollouts"),
    (lambda c: c["runtime"] == "local" and c["placement"] == "split",
     r"on runtime.runtime=local: the local runtime runs every role in this one process"),
)

ENV = textwrap.dedent('''
    import rlgraph as rg

    class Echo:                                    # given by path from another directory: loads in every process
        def reset(self, row):
            self.answer = row["answer"]
        def step(self, text):
            return rg.Step("=" + self.answer, float(text.strip() == self.answer), done=len(text) > 3)
''')

COMBINATIONS = st.fixed_dictionaries({
    "algorithm": st.sampled_from(["grpo", "ppo", "agent_grpo", "dapo", "sft"]),
    "runtime": st.sampled_from(["local", "spmd", "ray"]),
    "placement": st.sampled_from(["colocated", "split"]),
    "staleness": st.sampled_from([0, 1]),
    "lora": st.booleans(),
    "packing": st.booleans(),
    "eval": st.sampled_from(["every step", "at the end"]),
})


def config_of(combination: dict, tmp_path: Path, name: str, runtime: str | None = None):
    """The combination as a 3-step `rlgraph train` config: a checkpoint every step, no warm start."""
    c, runtime = combination, runtime or combination["runtime"]
    split = "split:policy=1,rollout=1,ref=policy" + (",critic=policy" if c["algorithm"] == "ppo" else "")
    overrides = [f"rollout.staleness={c['staleness']}", f"eval.every={1 if c['eval'] == 'every step' else 0}",
                 "checkpoint.keep_last=3", "train.steps=3",
                 f"runtime.placement={split if c['placement'] == 'split' else 'colocated:offload=False'}"]
    if runtime != "local":
        overrides += [f"runtime.runtime={runtime}", "runtime.nproc=2"]
    if c["lora"]:
        overrides.append("model.lora={r: 4}")
    if c["packing"]:
        overrides.append("train.micro_batch_tokens=64")
    sections = {"algorithm": {"name": c["algorithm"], "hparams": {}}, "warm_start": {"steps": 0}}
    if c["algorithm"] == "agent_grpo":
        env = tmp_path / "elsewhere" / "echo_env.py"
        env.parent.mkdir(exist_ok=True)
        env.write_text(ENV)
        sections.update(env={"path": f"{env}:Echo", "workers": 1 if runtime == "local" else None},
                        rollout={"max_new_tokens": 8, "max_turns": 2, "max_tokens_per_turn": 4})
    return make_config(tmp_path, name, overrides, **sections)[0]


def check_combination(combination: dict, tmp_path: Path) -> None:
    refused = next((reason for applies, reason in REFUSALS if applies(combination)), None)
    config = config_of(combination, tmp_path, "run")
    if refused is not None:
        with pytest.raises(ConfigError, match=refused):
            train(config)
        rows = metrics_of(tmp_path / "run") if (tmp_path / "run" / "metrics.jsonl").is_file() else []
        assert not [row for row in rows if row.get("step", 0) >= 1]  # before step 1
        return
    assert train(config).steps == 3
    rows = train_rows(tmp_path / "run")
    assert len(rows) == 3 and all(row["policy/grad_norm"] >= 0 for row in rows)
    if combination["staleness"]:
        assert [row["rollout/staleness"] for row in rows] == [0.0, 1.0, 1.0]
    evaluated = [row["step"] for row in metrics_of(tmp_path / "run") if "eval/accuracy" in row]
    assert evaluated == ([0, 1, 2, 3] if combination["eval"] == "every step" else [0, 3])
    # resumed from the middle (with staleness, a batch in flight): the uninterrupted run exactly
    copy = Path(shutil.copytree(tmp_path / "run", tmp_path / "resumed"))
    assert train(load_run_config(copy), resume=True, checkpoint="1").steps == 3
    assert_same_run(tmp_path / "run", copy)
    if combination["runtime"] != "local" and combination["placement"] == "colocated":  # N ranks compute what one does
        train(config_of(combination, tmp_path, "local", runtime="local"))
        assert_rows_close(rows, train_rows(tmp_path / "local"), keys=("reward", "policy/loss", "policy/grad_norm"))


def run_case(**combination) -> dict:
    return {"algorithm": "grpo", "runtime": "local", "placement": "colocated", "staleness": 0, "lora": False,
            "packing": False, "eval": "at the end", **combination}


# `make test`: the run (async + evaluation between steps on split spmd, resumed with a batch in
# flight), here multi-turn, its env file loaded on the ranks from another directory; a multi-turn run
# with LoRA and packing whose env file loads in an env worker; two refusals.
EXAMPLES = [run_case(algorithm="agent_grpo", runtime="spmd", placement="split", staleness=1, packing=True,
                     eval="every step"),
            run_case(algorithm="agent_grpo", lora=True, packing=True, eval="every step"),
            run_case(algorithm="sft"),
            run_case(placement="split")]
# `make test-thorough` adds these to its fresh draws.
THOROUGH_EXAMPLES = [run_case(runtime="spmd", placement="split", staleness=1, packing=True, eval="every step"),
                     run_case(algorithm="dapo", staleness=1, lora=True, packing=True, eval="every step"),
                     run_case(algorithm="ppo", runtime="ray", lora=True),
                     run_case(runtime="ray", placement="split", staleness=1, eval="every step"),
                     run_case(algorithm="agent_grpo", runtime="spmd", placement="split")]


def with_examples(test):
    for combination in reversed(EXAMPLES + (THOROUGH_EXAMPLES if THOROUGH else [])):
        test = example(combination=combination)(test)
    return test


@pytest.mark.slow
@settings(max_examples=40 if THOROUGH else 1, phases=(Phase.explicit, Phase.generate) if THOROUGH else (Phase.explicit,))
@with_examples
@given(combination=COMBINATIONS)
def test_every_combination_runs_and_resumes_exactly_or_is_refused_before_step_1(combination, tmp_path_factory):
    if combination["runtime"] == "ray":
        pytest.importorskip("ray")
    check_combination(combination, tmp_path_factory.mktemp("combination"))

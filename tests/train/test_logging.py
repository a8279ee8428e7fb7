"""rlgraph.train.logging: metrics.jsonl (round trip, resume, torn lines), TensorBoard, W&B / MLflow, fan-out;
samples.jsonl, reward terms that fail on every sample, the warm start's accuracy (end to end)."""

from __future__ import annotations

import json
import math
import sys
import types

import numpy as np
import pytest
import torch

from rlgraph.errors import ConfigError
from rlgraph.rewards.combine import RewardPipeline, RewardTerm
from rlgraph.train import logging as run_logging
from rlgraph.train.logging import (SAMPLES_FILE, JsonlSink, MetricLogger, MetricsError, MlflowSink, SampleLog,
                                   TensorBoardSink, WandbSink, check_metrics, make_sinks, read_metrics, read_samples,
                                   report_reward_failures)


def strict_loads(line: str):
    """json.loads that refuses NaN / Infinity tokens, i.e. JSON as the standard defines it."""
    def refuse(token):
        raise ValueError(f"not JSON: {token}")
    return json.loads(line, parse_constant=refuse)


def write_steps(path, steps, resume_step=None):
    sink = JsonlSink(path, resume_step)
    for step in steps:
        sink.log(step, {"reward": step / 10, "kl": 0.001 * step})
    sink.close()


# -- metrics.jsonl ------------------------------------------------------------------------------------
def test_jsonl_round_trip_writes_non_finite_as_null(tmp_path):
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    sink.log(1, {"reward": 0.25, "kl": math.nan, "up": math.inf, "down": -math.inf, "count": 3,
                 "tensor": torch.tensor(0.5), "numpy": np.float32(1.5)})
    sink.log(2, {"reward": 1 / 3})
    sink.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    first = strict_loads(lines[0])  # valid JSON: no NaN / Infinity tokens
    assert first["kl"] is None and first["up"] is None and first["down"] is None
    assert first["step"] == 1 and first["count"] == 3 and first["tensor"] == 0.5 and first["numpy"] == 1.5
    assert abs(first["time"] - __import__("time").time()) < 60
    rows = read_metrics(tmp_path)
    assert [row["step"] for row in rows] == [1, 2]
    assert rows[1]["reward"] == 1 / 3  # exact: repr round trip
    assert math.isnan(rows[0]["kl"]) and math.isnan(rows[0]["up"])


def test_jsonl_flushes_every_line(tmp_path):
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    sink.log(1, {"reward": 1.0})
    assert strict_loads((tmp_path / "metrics.jsonl").read_text())["reward"] == 1.0  # before close
    sink.close()


def test_fresh_run_starts_a_new_file(tmp_path):
    write_steps(tmp_path / "metrics.jsonl", [1, 2, 3])
    write_steps(tmp_path / "metrics.jsonl", [1])
    assert [row["step"] for row in read_metrics(tmp_path)] == [1]


def test_resume_keeps_exactly_the_lines_up_to_the_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)
    for step in (0, 1, 2, 3, 3, 4, 5):  # 0 and the second 3: evaluations
        sink.log(step, {"reward": float(step)})
    sink.close()
    before = path.read_text().splitlines()
    write_steps(path, [4], resume_step=3)
    after = path.read_text().splitlines()
    assert after[:5] == before[:5]  # byte for byte, the evaluation at step 3 included
    assert [strict_loads(line)["step"] for line in after] == [0, 1, 2, 3, 3, 4]
    assert strict_loads(after[-1])["reward"] == 0.4


def test_resume_rewrite_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    write_steps(path, [1, 2, 3])
    before = path.read_bytes()

    def crash(*args):
        raise OSError("disk full")
    monkeypatch.setattr(run_logging.os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        JsonlSink(path, resume_step=1)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temp file left behind


def test_torn_last_line_is_skipped_on_read_and_dropped_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_steps(path, [1, 2])
    with open(path, "a") as handle:
        handle.write('{"step": 3, "rew')  # killed mid-write
    assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2]
    write_steps(path, [3], resume_step=5)
    assert [strict_loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]


def test_resume_of_a_missing_file_starts_empty(tmp_path):
    write_steps(tmp_path / "metrics.jsonl", [4], resume_step=3)
    assert [row["step"] for row in read_metrics(tmp_path)] == [4]


def test_garbage_before_the_last_line_is_refused_with_its_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "reward": 0.5}\nnot json\n{"step": 3, "reward": 0.1}\n')
    with pytest.raises(MetricsError,
                       match=r"metrics.jsonl:2: not JSON \(Expecting value at column 1\): 'not json'\n"
                             r"  fix: repair or delete that line"):
        read_metrics(tmp_path)
    with pytest.raises(MetricsError, match=r"metrics.jsonl:2:"):
        JsonlSink(path, resume_step=3)


@pytest.mark.parametrize("text, message", [
    ('{"step": 1, "reward": "high"}\n{"step": 2}\n', r":1: metric 'reward' is not a number: 'high'"),
    ('[1, 2]\n{"step": 2}\n', r":1: expected a JSON object, got list"),
    ('{"reward": 1.0}\n{"step": 2}\n', r":1: 'step' must be a non-negative int, got None"),
])
def test_read_refuses_bad_rows(tmp_path, text, message):
    (tmp_path / "metrics.jsonl").write_text(text)
    with pytest.raises(MetricsError, match=message):
        read_metrics(tmp_path)


def test_read_refuses_missing_and_unreadable_files(tmp_path):
    with pytest.raises(MetricsError, match="run directory .*nope does not exist"):
        read_metrics(tmp_path / "nope")
    with pytest.raises(MetricsError, match="no metrics.jsonl in"):
        read_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("garbage, all of it")
    with pytest.raises(MetricsError, match="no readable line"):
        read_metrics(tmp_path)
    with pytest.raises(MetricsError, match="is a file"):
        read_metrics(tmp_path / "metrics.jsonl")
    (tmp_path / "metrics.jsonl").write_text("")
    assert read_metrics(tmp_path) == []  # a run that has not logged yet


@pytest.mark.parametrize("step, metrics, message", [
    (1, {"reward": "0.5"}, r"metric 'reward' of step 1 is not a number: '0.5' \(str\)"),
    (1, {"reward": [0.5]}, r"metric 'reward' of step 1 is not a number"),
    (1, {"reward": torch.ones(2)}, r"metric 'reward' of step 1 is not a number"),
    (1, {"reward": None}, r"metric 'reward' of step 1 is not a number"),
    (1, {"step": 1.0}, r"metric name 'step' of step 1 is not allowed"),
    (1, {3: 1.0}, r"metric name 3 of step 1 is not allowed"),
    (1, [("reward", 1.0)], r"metrics of step 1 must be a mapping"),
    (-1, {}, r"step must be a non-negative int, got -1"),
    (True, {}, r"step must be a non-negative int, got True"),
    (1.5, {}, r"step must be a non-negative int, got 1.5"),
])
def test_bad_metrics_are_refused_naming_step_and_key(step, metrics, message):
    with pytest.raises(MetricsError, match=message):
        check_metrics(step, metrics)


def test_steps_must_not_go_down(tmp_path):
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    sink.log(2, {"reward": 1.0})
    sink.log(2, {"eval/accuracy": 0.5})  # an evaluation repeats its step
    with pytest.raises(MetricsError, match="step 1 logged after step 2"):
        sink.log(1, {"reward": 1.0})
    sink.close()
    resumed = JsonlSink(tmp_path / "metrics.jsonl", resume_step=5)
    with pytest.raises(MetricsError, match="step 0 logged after step 2"):
        resumed.log(0, {})
    resumed.close()


@pytest.mark.parametrize("resume_step", [-1, "3", 2.0])
def test_bad_resume_step_is_refused(tmp_path, resume_step):
    with pytest.raises(MetricsError, match="resume_step must be a non-negative int"):
        JsonlSink(tmp_path / "metrics.jsonl", resume_step)


def test_jsonl_path_that_is_a_directory_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="is a directory"):
        JsonlSink(tmp_path)


# -- TensorBoard ---------------------------------------------------------------------------------------
def scalars(log_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


def test_tensorboard_sink_writes_readable_scalars_and_purges_on_resume(tmp_path):
    sink = TensorBoardSink(tmp_path / "tb")
    for step in range(1, 5):
        sink.log(step, {"reward": step / 4, "time/step_s": 2.0 * step})
    sink.close()
    assert scalars(tmp_path / "tb", "reward") == [(1, 0.25), (2, 0.5), (3, 0.75), (4, 1.0)]
    assert scalars(tmp_path / "tb", "time/step_s") == [(1, 2.0), (2, 4.0), (3, 6.0), (4, 8.0)]
    resumed = TensorBoardSink(tmp_path / "tb", resume_step=2)
    resumed.log(3, {"reward": -1.0})
    resumed.close()
    assert scalars(tmp_path / "tb", "reward") == [(1, 0.25), (2, 0.5), (3, -1.0)]  # the killed run's 3, 4 hidden


# -- W&B and MLflow ------------------------------------------------------------------------------------
@pytest.mark.parametrize("section, make", [("wandb", lambda: WandbSink({"project": "p"})),
                                           ("mlflow", lambda: MlflowSink({"experiment": "e"}))])
def test_missing_package_says_which_extra_to_install(monkeypatch, section, make):
    monkeypatch.setitem(sys.modules, section, None)  # import raises ImportError
    with pytest.raises(ConfigError, match=rf"logging.{section} is set but the {section} package is not installed"
                                          rf"(.|\n)*pip install 'rlgraph\[{section}\]'"):
        make()


def fake_module(name, calls):
    module = types.ModuleType(name)

    def record(function, result=None):
        def call(*args, **kwargs):
            calls.append((function, args, kwargs))
            return result
        return call
    run = types.SimpleNamespace(log=record("run.log"), finish=record("run.finish"))
    for function in ("set_tracking_uri", "set_experiment", "log_metrics", "end_run"):
        setattr(module, function, record(function))
    module.init = record("init", run)
    module.start_run = record("start_run", run)
    return module


def test_wandb_sink_passes_options_steps_and_closes(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setitem(sys.modules, "wandb", fake_module("wandb", calls))
    sink = WandbSink({"project": "p", "name": "run-1", "mode": "offline"}, tmp_path)
    sink.log(3, {"reward": torch.tensor(0.5)})
    sink.close()
    assert calls == [("init", (), {"dir": str(tmp_path), "project": "p", "name": "run-1", "mode": "offline"}),
                     ("run.log", ({"reward": 0.5},), {"step": 3, "commit": True}), ("run.finish", (), {})]


def test_mlflow_sink_sets_uri_experiment_and_drops_non_finite(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "mlflow", fake_module("mlflow", calls))
    sink = MlflowSink({"tracking_uri": "file:/tmp/mlruns", "experiment": "math", "run_name": "r"})
    sink.log(2, {"reward": 1.0, "kl": math.nan})
    sink.close()
    assert calls == [("set_tracking_uri", ("file:/tmp/mlruns",), {}), ("set_experiment", ("math",), {}),
                     ("start_run", (), {"run_name": "r", "tags": None}),
                     ("log_metrics", ({"reward": 1.0},), {"step": 2}), ("end_run", (), {})]


@pytest.mark.parametrize("options, message", [
    ({"projct": "p"}, r"logging.wandb has an unknown option 'projct'(.|\n)*did you mean 'project'"),
    (True, r"logging.wandb must be a mapping of options, got True"),
    ("my-project", r"logging.wandb must be a mapping of options, got 'my-project'"),
])
def test_bad_wandb_options_are_refused(options, message):
    with pytest.raises(ConfigError, match=message):
        WandbSink(options)


# -- make_sinks and MetricLogger ---------------------------------------------------------------------
def test_make_sinks_builds_the_configured_sinks(tmp_path):
    sinks = make_sinks(tmp_path / "run", tensorboard=True, wandb=None, mlflow=None, resume_step=None)
    assert [type(sink) for sink in sinks] == [JsonlSink, TensorBoardSink]
    with MetricLogger(sinks) as logger:
        logger.log(1, {"reward": 0.5})
    assert read_metrics(tmp_path / "run")[0]["reward"] == 0.5
    assert scalars(tmp_path / "run" / "tensorboard", "reward") == [(1, 0.5)]
    only = make_sinks(tmp_path / "other", tensorboard=False, wandb=None, mlflow=None, resume_step=None)
    assert [type(sink) for sink in only] == [JsonlSink]
    MetricLogger(only).close()


@pytest.mark.parametrize("kwargs, error, message", [
    ({"tensorboard": "yes"}, ConfigError, r"logging.tensorboard must be true or false, got 'yes'"),
    ({"wandb": ["project"]}, ConfigError, r"logging.wandb must be a mapping"),
    ({"mlflow": {"uri": "x"}}, ConfigError, r"logging.mlflow has an unknown option 'uri'"),
    ({"resume_step": -2}, MetricsError, r"resume_step must be a non-negative int, got -2"),
])
def test_make_sinks_refuses_bad_options(tmp_path, kwargs, error, message):
    options = {"tensorboard": False, "wandb": None, "mlflow": None, "resume_step": None, **kwargs}
    with pytest.raises(error, match=message):
        make_sinks(tmp_path, **options)


def test_make_sinks_refuses_a_file_as_run_dir(tmp_path):
    (tmp_path / "run").write_text("")
    with pytest.raises(ConfigError, match="run directory .*run is a file"):
        make_sinks(tmp_path / "run", tensorboard=False, wandb=None, mlflow=None, resume_step=None)


def test_refused_resume_leaves_metrics_untouched(tmp_path, monkeypatch):
    write_steps(tmp_path / "metrics.jsonl", [1, 2, 3])
    before = (tmp_path / "metrics.jsonl").read_bytes()
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError, match="rlgraph\\[wandb\\]"):
        make_sinks(tmp_path, tensorboard=False, wandb={"project": "p"}, mlflow=None, resume_step=1)
    assert (tmp_path / "metrics.jsonl").read_bytes() == before


class ListSink:
    def __init__(self, fail_close=False):
        self.rows, self.closed, self.fail_close = [], False, fail_close

    def log(self, step, metrics):
        self.rows.append((step, dict(metrics)))

    def close(self):
        self.closed = True
        if self.fail_close:
            raise RuntimeError("close failed")


def test_logger_fans_out_checked_floats_and_closes_every_sink():
    first, second = ListSink(fail_close=True), ListSink()
    logger = MetricLogger([first, second])
    logger.log(1, {"reward": torch.tensor(2.0), "n": 3})
    assert first.rows == second.rows == [(1, {"reward": 2.0, "n": 3.0})]
    assert type(first.rows[0][1]["reward"]) is float
    with pytest.raises(MetricsError, match="metric 'kl' of step 2 is not a number"):
        logger.log(2, {"kl": "x"})
    with pytest.raises(RuntimeError, match="close failed"):
        logger.close()
    assert first.closed and second.closed  # the second is closed although the first failed
    with pytest.raises(MetricsError, match="logged after the MetricLogger was closed"):
        logger.log(3, {})


# -- the real packages (installed by `make`; skipped where an install left the extras out) ---------
def test_wandb_offline_run_receives_the_metrics(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="pip install 'rlgraph[wandb]'")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    sink = WandbSink({"project": "rlgraph-test", "mode": "offline", "name": "t"}, tmp_path)
    for step in (1, 2, 3):
        sink.log(step, {"reward": step / 10, "kl": math.nan if step == 2 else 0.01})
    assert sink.run.summary["reward"] == pytest.approx(0.3) and sink.run.summary["kl"] == pytest.approx(0.01)
    sink.close()
    records = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))  # what `wandb sync` uploads later
    assert len(records) == 1 and records[0].stat().st_size > 0


def test_mlflow_run_receives_the_metrics_without_non_finite_values(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow", reason="pip install 'rlgraph[mlflow]'")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    sink = MlflowSink({"tracking_uri": uri, "experiment": "e", "run_name": "r"})
    for step in (1, 2, 3):
        sink.log(step, {"reward": step / 10, "kl": math.nan if step == 2 else 0.01})
    sink.close()
    client = mlflow.tracking.MlflowClient(uri)
    run = client.search_runs([client.get_experiment_by_name("e").experiment_id])[0]
    assert run.info.run_name == "r"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "reward")] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "kl")] == [1, 3]


def test_mlflow_store_that_refuses_is_a_config_error(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="pip install 'rlgraph[mlflow]'")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "false")
    with pytest.raises(ConfigError, match=r"logging.mlflow: MLflow could not start a run at tracking_uri file:"):
        MlflowSink({"tracking_uri": (tmp_path / "mlruns").as_uri(), "experiment": "e"})


# -- samples.jsonl and reward failures ---------------------------------------------------------------


def _pipeline(samples, fn=None, on_error="fail"):
    exact = lambda completions, answer, **_: [float(c == a) for c, a in zip(completions, answer)]  # noqa: E731
    return RewardPipeline([RewardTerm("math", fn or exact, 1.0), RewardTerm("len", lambda c, **_: [len(x) / 10 for x in c], 0.5)],
                          on_error=on_error, samples=samples)


def test_the_pipeline_keeps_samples_spread_over_prompts_with_their_rewards():
    pipeline = _pipeline(2)
    completions, answers = ["5", "4", "7", "7"], ["5", "5", "7", "7"]
    texts = ["2+3=", "2+3=", "3+4=", "3+4="]
    pipeline(completions, answer=answers, text=texts)
    pipeline(["1"] * 4, answer=answers, text=texts)  # the first call's rows fill the 2 places
    samples = pipeline.pop_samples()
    # rows 0 and 2 (evenly spread: 0 * 4 // 2, 1 * 4 // 2): both prompts; reward = 1.0 * exact + 0.5 * len/10
    assert samples == [
        {"prompt": "2+3=", "completion": "5", "reward": 1.05, "rewards": {"math": 1.0, "len": 0.1}, "answer": "5"},
        {"prompt": "3+4=", "completion": "7", "reward": 1.05, "rewards": {"math": 1.0, "len": 0.1}, "answer": "7"},
    ]
    assert pipeline.pop_samples() == []
    assert _pipeline(0)(completions, answer=answers, text=texts) and _pipeline(0).pop_samples() == []


@pytest.mark.parametrize("samples", [-1, 2.5, "4", True])
def test_a_bad_samples_count_is_refused(samples):
    with pytest.raises(ConfigError, match="logging.samples"):
        _pipeline(samples)


def test_a_term_that_fails_on_every_sample_is_flagged_with_its_first_error():
    def broken(completions, **_):
        raise KeyError("answer_key")

    pipeline = _pipeline(0, fn=broken, on_error="zero")
    assert pipeline(["1", "2"], answer=["1", "2"], text=["a", "b"]) == [0.05, 0.05]  # only the len term scores
    metrics = pipeline.pop_metrics()
    assert metrics["reward/math/all_failed"] == 1.0 and metrics["reward/math/errors"] == 2.0
    assert "reward/len/all_failed" not in metrics
    assert list(pipeline.last_failures) == ["math"] and "KeyError: 'answer_key'" in pipeline.last_failures["math"]
    # a term that failed on some samples only is counted, not flagged
    partial = _pipeline(0, fn=lambda c, **_: [1.0, float("nan")], on_error="zero")
    partial(["1", "2"], answer=["1", "2"])
    assert "reward/math/all_failed" not in partial.pop_metrics() and partial.last_failures == {}


def test_report_reward_failures_names_the_term_and_error():
    from rich.console import Console

    console = Console(record=True, width=400)
    report_reward_failures(7, "train", {"math": "reward 'math' raised KeyError: [answer] (at r.py:3 in f)"}, console)
    text = console.export_text()
    assert "warning: train step 7: every call of reward term 'math' failed" in text
    assert "KeyError: [answer]" in text  # brackets kept, not read as rich markup
    report_reward_failures(7, "train", {}, console)
    assert console.export_text() == ""  # nothing to say when nothing failed everywhere


def _write_samples(path, steps, resume_step=None):
    log = SampleLog(path, resume_step)
    for step in steps:
        log.log(step, "train", [{"prompt": "1+1=", "completion": str(step), "reward": 0.0, "answer": 2}])
        log.log(step, "eval", [{"prompt": "1+2=", "completion": str(step), "reward": 1.0, "answer": 3}])
    log.close()


def test_samples_jsonl_round_trip_and_resume_cut_back(tmp_path):
    _write_samples(tmp_path / SAMPLES_FILE, [0, 1, 2, 3])
    before = (tmp_path / SAMPLES_FILE).read_text().splitlines()
    assert read_samples(tmp_path)[1] == {"step": 0, "kind": "eval", "prompt": "1+2=", "completion": "0", "reward": 1.0,
                                         "answer": 3}
    with open(tmp_path / SAMPLES_FILE, "a") as handle:
        handle.write('{"step": 4, "kind": "tr')  # a kill mid-line
    _write_samples(tmp_path / SAMPLES_FILE, [2, 3], resume_step=1)  # resumed from the checkpoint of step 1
    after = (tmp_path / SAMPLES_FILE).read_text().splitlines()
    assert after[:4] == before[:4] and [(r["step"], r["kind"]) for r in read_samples(tmp_path)] == [
        (0, "train"), (0, "eval"), (1, "train"), (1, "eval"), (2, "train"), (2, "eval"), (3, "train"), (3, "eval")]
    _write_samples(tmp_path / SAMPLES_FILE, [0])  # a fresh run starts a new file
    assert len(read_samples(tmp_path)) == 2


@pytest.mark.parametrize("step, kind, message", [(-1, "train", "non-negative"), ("3", "train", "non-negative"),
                                                 (1, "test", "sample kind 'test'")])
def test_bad_sample_rows_are_refused(tmp_path, step, kind, message):
    log = SampleLog(tmp_path / SAMPLES_FILE)
    with pytest.raises(MetricsError, match=message):
        log.log(step, kind, [{"completion": "x"}])
    log.close()


# -- a run's samples, warm start and failing rewards, end to end (rlgraph train on the tiny model) -----
def always_raises(completions, **_):
    raise ValueError("the grader is down")


def _train(tmp_path, name, **sections):
    from rich.console import Console

    from rlgraph.train.run import train
    from tests.train.test_run import make_config

    config, _ = make_config(tmp_path, name, **{"train": {"steps": 2, "seed": 0}, "eval": {"every": 1},
                                               "logging": {"tensorboard": False, "progress": False, "plots": False,
                                                           "samples": 3}, **sections})
    console = Console(record=True, width=400)
    train(config, console=console)
    return tmp_path / name, console.export_text()


def test_a_run_logs_samples_and_the_warm_start_accuracy(tmp_path):
    from rlgraph.rewards import build_reward

    run_dir, text = _train(tmp_path, "run")
    rows = read_samples(run_dir)
    # 3 per evaluation (steps 0, 1, 2: eval.every=1) and per training step (1, 2)
    assert [(row["step"], row["kind"]) for row in rows] == [(0, "eval")] * 3 + [(1, "train")] * 3 + [(1, "eval")] * 3 + \
        [(2, "train")] * 3 + [(2, "eval")] * 3
    math_reward = build_reward("math")
    for row in rows:  # each logged reward is the one reward term's score of that completion against that answer
        assert row["reward"] == row["rewards"]["math"] == math_reward([row["completion"]], answer=[row["answer"]])[0]
        assert row["prompt"].endswith("=") and isinstance(row["completion"], str)
    first = read_metrics(run_dir)[0]
    assert first["step"] == 0 and first["warm_start/steps"] == 3.0 and first["warm_start/accuracy"] == first["eval/accuracy"]
    assert f"warm start: held-out accuracy {first['eval/accuracy']:.1%}" in text


def test_a_reward_that_fails_on_every_sample_is_flagged_and_warned(tmp_path):
    run_dir, text = _train(tmp_path, "broken", rewards=[{"name": f"{__file__}:always_raises"}], reward_on_error="zero",
                           warm_start={"steps": 0}, train={"steps": 1, "seed": 0}, eval={"every": 0},
                           data={"eval_fraction": 0.0})
    term = "always_raises"  # the metric is named by the function, not by its file's path
    row = read_metrics(run_dir)[-1]
    assert row["step"] == 1 and row[f"reward/{term}/all_failed"] == 1.0 and row["reward"] == 0.0
    assert f"train step 1: every call of reward term {term!r} failed" in text and "the grader is down" in text
    assert all(sample["reward"] == 0.0 for sample in read_samples(run_dir))

"""rlgraph.train.plot: PNGs from a synthetic metrics.jsonl, skipped groups, smoothing, refusals."""

from __future__ import annotations

import math

import pytest
from matplotlib.image import imread

from rlgraph.errors import ConfigError
from rlgraph.train.logging import JsonlSink, MetricsError, read_metrics
from rlgraph.train.plot import GROUPS, plot_run, series, smooth


def write_run(run_dir, steps=30, keys=None):
    sink = JsonlSink(run_dir / "metrics.jsonl")
    for step in range(1, steps + 1):
        metrics = {"reward": step / steps, "reward/std": 0.1, "accuracy": 0.5 * step / steps, "policy/kl": 0.001 * step,
                   "response_length/mean": 10.0 + step, "tokens_per_s": 100.0 * step, "samples_per_s": 8.0,
                   "time/step_s": 1.0, "time/generate_s": 0.6, "time/train_s": 0.3, "lr": 1e-6}
        if step == 7:
            metrics["policy/kl"] = math.nan  # written as null: a gap, not a crash
        sink.log(step, {k: v for k, v in metrics.items() if keys is None or k in keys})
        if step % 10 == 0 and (keys is None or "eval/accuracy" in keys):
            sink.log(step, {"eval/accuracy": 0.6, "eval/reward": 0.6, "eval/response_length": 12.0})
    sink.close()


def test_plot_run_writes_every_group_and_the_overview(tmp_path):
    write_run(tmp_path)
    paths = plot_run(tmp_path)
    names = [path.name for path in paths]
    assert names == ["reward.png", "accuracy.png", "kl.png", "length.png", "throughput.png", "time.png", "overview.png"]
    assert paths.skipped == {}
    for path in paths:
        assert path.parent == tmp_path / "plots"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        image = imread(path)
        assert image.std() > 0.01  # something is drawn, not a blank canvas
    assert imread(paths[0]).shape[:2] == (450, 700)
    assert imread(paths[-1]).shape[:2] == (800, 1500)


def test_absent_groups_are_skipped_and_named(tmp_path, capsys):
    write_run(tmp_path, steps=5, keys={"reward", "policy/kl"})
    out = tmp_path / "elsewhere" / "png"
    paths = plot_run(tmp_path, out)
    assert [path.name for path in paths] == ["reward.png", "kl.png", "overview.png"]
    assert all(path.parent == out and path.stat().st_size > 0 for path in paths)
    assert sorted(paths.skipped) == ["accuracy", "length", "throughput", "time"]
    assert paths.skipped["accuracy"] == "no accuracy / eval/accuracy in metrics.jsonl"
    assert "plot: skipped accuracy.png (no accuracy / eval/accuracy in metrics.jsonl)" in capsys.readouterr().err


def test_a_group_of_only_nulls_is_skipped(tmp_path):
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    for step in (1, 2):
        sink.log(step, {"reward": 1.0, "kl": math.inf})
    sink.close()
    assert "kl" in plot_run(tmp_path).skipped


def test_series_keeps_eval_rows_apart():
    rows = [{"step": 1, "reward": 0.1}, {"step": 2, "reward": 0.2}, {"step": 2, "eval/accuracy": 0.9}]
    assert series(rows, "reward") == ([1, 2], [0.1, 0.2])
    assert series(rows, "eval/accuracy") == ([2], [0.9])


def test_smooth_numbers():
    assert smooth([1.0, 0.0], 0.9) == pytest.approx([1.0, 0.09 / 0.19])
    assert smooth([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]  # a short run is not smoothed
    out = smooth([1.0, math.nan, 0.0], 0.5)
    assert out[0] == 1.0 and math.isnan(out[1]) and out[2] == pytest.approx(0.25 / 0.75)
    long = smooth([float(i % 2) for i in range(400)])  # weight 0.95: the zig-zag flattens near 0.5
    assert max(long[200:]) - min(long[200:]) < 0.06


def test_groups_are_six_for_the_2x3_overview():
    assert len(GROUPS) == 6 and len({group.name for group in GROUPS}) == 6


def test_refusals(tmp_path):
    with pytest.raises(MetricsError, match="run directory .*missing does not exist"):
        plot_run(tmp_path / "missing")
    write_run(tmp_path, steps=3)
    (tmp_path / "out.png").write_text("")
    with pytest.raises(ConfigError, match="plot output .*out.png is a file, not a directory"):
        plot_run(tmp_path, tmp_path / "out.png")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward": "good"}\n{"step": 2, "reward": 0.5}\n')
    with pytest.raises(MetricsError, match=r"metrics.jsonl:1: metric 'reward' is not a number: 'good'"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    with pytest.raises(MetricsError, match=r"nothing to plot in .*1 rows, keys \['loss'\]"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(MetricsError, match=r"nothing to plot in .*0 rows, keys none"):
        plot_run(tmp_path)


def test_the_warm_starts_seconds_do_not_scale_the_step_time_axis(tmp_path):
    from matplotlib.figure import Figure

    from rlgraph.train.plot import _draw_time, _found

    sink = JsonlSink(tmp_path / "metrics.jsonl")
    sink.log(0, {"time/warm_start_s": 120.0, "time/compile_s": 0.0})  # the first row: the warm start, once
    for step in range(1, 6):
        sink.log(step, {"time/step_s": 0.5, "time/generate_s": 0.3, "time/compile_s": 0.0})
    sink.close()
    ax = Figure().add_subplot()
    _draw_time(ax, _found(read_metrics(tmp_path), next(group for group in GROUPS if group.name == "time")))
    assert ax.get_ylim()[1] < 1.0  # the 0.5 s steps fill the axis, not the 120 s warm start
    assert "warm start 120.0 s (not per step: not drawn)" in [text.get_text() for text in ax.texts]

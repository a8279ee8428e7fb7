"""rlgraph.train.progress: the smoothed numbers, the bar on a terminal, plain lines elsewhere."""

from __future__ import annotations

import io
import math

import pytest
import torch
from rich.console import Console

from rlgraph.errors import ConfigError
from rlgraph.train.progress import Ema, RunProgress


def console(terminal: bool, width: int = 200) -> Console:
    return Console(file=io.StringIO(), force_terminal=terminal, width=width, color_system=None)


def step_metrics(step: int) -> dict[str, float]:
    return {"reward": float(step % 2), "policy/kl": 0.01, "accuracy": 0.5, "time/step_s": 2.0}


def test_ema_is_bias_corrected_and_skips_non_finite():
    ema = Ema(0.9)
    assert ema.add(1.0) == 1.0
    assert ema.add(0.0) == pytest.approx(0.09 / 0.19)
    assert ema.add(math.nan) == pytest.approx(0.09 / 0.19)  # skipped, not poisoning the rest
    assert ema.count == 2
    plain = Ema(0.0)
    assert [plain.add(v) for v in (3.0, 5.0)] == [3.0, 5.0]
    assert math.isnan(Ema(0.5).value)


@pytest.mark.parametrize("weight", [-0.1, 1.0, "0.9"])
def test_bad_smoothing_weight_is_refused(weight):
    with pytest.raises(ConfigError, match=r"smoothing weight must be a number in \[0, 1\)"):
        Ema(weight)


def test_plain_lines_every_n_steps_when_not_a_terminal():
    out = console(terminal=False)
    with RunProgress(total_steps=5, console=out, every=2) as progress:
        for step in range(1, 6):
            progress.update(step, {**step_metrics(step), **({"eval/accuracy": 0.75} if step == 4 else {})})
    lines = out.file.getvalue().splitlines()
    assert [line.split("  ")[0] for line in lines] == ["step 1/5", "step 2/5", "step 4/5", "step 5/5"]
    assert lines[0] == "step 1/5  reward 1.000  kl 0.0100  acc 50.0%  2.00 s/step  [0s]"
    assert "eval acc 75.0%" in lines[2] and "eval acc 75.0%" in lines[3]
    reward = Ema(0.9)
    for step in range(1, 6):
        reward.add(float(step % 2))
    assert progress.averages["reward"].value == pytest.approx(reward.value)
    assert f"reward {reward.value:.3f}" in lines[3]


def test_last_step_is_printed_even_off_the_grid():
    out = console(terminal=False, width=20)  # a narrow log: lines are not wrapped
    with RunProgress(seconds=60, console=out, every=10, start_step=20) as progress:
        for step in (21, 22, 23):
            progress.update(step, {"reward": torch.tensor(0.5)})
    lines = out.file.getvalue().splitlines()
    assert [line.split("  ")[0] for line in lines] == ["step 21", "step 23"]
    assert lines[0].startswith("step 21  0/60 s  reward 0.500  ") and lines[0].endswith(" s/step")


def test_bar_on_a_terminal():
    out = console(terminal=True)
    with RunProgress(total_steps=3, console=out) as progress:
        for step in (1, 2, 3):
            progress.update(step, step_metrics(step))
    text = out.file.getvalue()
    assert "step 3/3" in text and "reward" in text and "s/step" in text
    assert "[0s]" not in text  # no plain lines


def test_disabled_prints_nothing():
    out = console(terminal=False)
    with RunProgress(total_steps=2, console=out, enabled=False) as progress:
        progress.update(1, step_metrics(1))
        progress.update(2, step_metrics(2))
    assert out.file.getvalue() == ""
    assert progress.averages["policy/kl"].value == pytest.approx(0.01)


def test_missing_step_seconds_fall_back_to_wall_time():
    progress = RunProgress(total_steps=2, console=console(False), enabled=False)
    with progress:
        progress.update(1, {"reward": "not a number"})  # ignored, not shown
    assert progress.averages["reward"].count == 0
    assert progress.step_seconds.count == 1 and progress.step_seconds.value >= 0


@pytest.mark.parametrize("kwargs, message", [
    ({"total_steps": 0}, r"total_steps must be a positive int, got 0"),
    ({"total_steps": 2.5}, r"total_steps must be a positive int, got 2.5"),
    ({"total_steps": True}, r"total_steps must be a positive int, got True"),
    ({"seconds": 0}, r"seconds must be a positive float, got 0"),
    ({"seconds": math.nan}, r"seconds must be a positive float, got nan"),
    ({"seconds": "60"}, r"seconds must be a positive float, got '60'"),
    ({"every": 0}, r"every must be a positive int, got 0"),
    ({"start_step": -1}, r"start_step must be an int >= 0, got -1"),
])
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        RunProgress(**kwargs)


def test_update_refuses_a_non_mapping():
    with pytest.raises(ConfigError, match=r"RunProgress.update\(step=1\) needs a mapping of metrics, got list"):
        RunProgress(total_steps=1, enabled=False).update(1, [0.5])


def test_decode_compile_seconds_are_shown_apart_and_not_averaged_into_the_step_time():
    """A step that compiled the decode step (time/compile_s, inside time/step_s) counts in s/step
    without its compile; the compile seconds so far are shown beside it."""
    out = console(terminal=False)
    with RunProgress(total_steps=2, console=out, every=1, smoothing=0.0) as progress:
        progress.update(1, {**step_metrics(1), "time/step_s": 16.5, "time/compile_s": 14.5})
        progress.update(2, {**step_metrics(2), "time/compile_s": 0.0})
    lines = out.file.getvalue().splitlines()
    assert "2.00 s/step  compile 14.5 s" in lines[0] and "2.00 s/step  compile 14.5 s" in lines[1]
    assert progress.compile_seconds == 14.5


def test_a_warm_start_phase_is_labelled_on_its_bar_and_its_plain_lines():
    out = console(terminal=False)
    with RunProgress(total_steps=20, console=out, every=10, label="SFT") as progress:
        for step in range(1, 11):
            progress.update(step, {"time/step_s": 0.5, **({"eval/accuracy": 0.25} if step == 10 else {})})
    lines = out.file.getvalue().splitlines()
    assert lines == ["SFT  step 1/20  0.50 s/step  [0s]", "SFT  step 10/20  eval acc 25.0%  0.50 s/step  [0s]"]
    terminal = console(terminal=True)
    with RunProgress(total_steps=2, console=terminal, label="SFT") as progress:
        progress.update(1, {"time/step_s": 0.5})
    assert "SFT" in terminal.file.getvalue() and "RL" not in terminal.file.getvalue()


@pytest.mark.parametrize("label", ["", "  ", 3, "[bold]SFT"])
def test_a_bad_phase_label_is_refused(label):
    with pytest.raises(ConfigError, match=r"label must be a short non-empty phase name"):
        RunProgress(total_steps=1, label=label)


def test_a_resumed_run_smooths_on_from_its_history_and_dates_an_old_evaluation():
    rows = [{"step": step, **step_metrics(step), **({"eval/accuracy": 0.75} if step == 2 else {})} for step in range(1, 6)]
    whole = console(terminal=False)
    with RunProgress(total_steps=5, console=whole, every=1) as uninterrupted:
        for row in rows:
            uninterrupted.update(row["step"], row)
    resumed_out = console(terminal=False)
    # resumed from the checkpoint of step 3: metrics.jsonl holds steps 1-3 (and a row past it is ignored)
    with RunProgress(total_steps=5, console=resumed_out, every=1, start_step=3, history=rows[:3] + rows[4:]) as resumed:
        for row in rows[3:]:
            resumed.update(row["step"], row)
    for key, average in uninterrupted.averages.items():
        assert resumed.averages[key].value == pytest.approx(average.value) and resumed.averages[key].count == 5
    last = resumed_out.file.getvalue().splitlines()[-1]
    assert last.split("[")[0] == whole.file.getvalue().splitlines()[-1].split("[")[0]
    assert "eval acc 75.0% @ step 2" in last  # measured 3 steps ago: dated, not shown as the current policy's
    assert "eval acc 75.0%  " in whole.file.getvalue().splitlines()[1]  # at its own step: no date

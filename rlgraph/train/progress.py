"""The live view of a training run: a rich progress bar on a terminal, plain lines elsewhere.

    with RunProgress(total_steps=200, console=console) as progress:
        for metrics in trainer.run(steps=200):
            progress.update(trainer.step, metrics)

On a terminal the bar shows `step k/N` (or elapsed/budget for a run bounded by `seconds`) and the
smoothed reward, KL and accuracy, the latest evaluation accuracy and seconds per step. Where the
console is not a terminal (CI logs, `nohup`, a pipe) a bar would print control codes, so one plain
line is printed every `every` steps instead. `enabled=False` prints nothing.

A resumed run passes its earlier metrics rows (`history`, from metrics.jsonl): the smoothed values
go on from them, as in the uninterrupted run, instead of restarting from the first new step. An
evaluation older than the current step is shown with its step (`eval acc 47.5% @ step 20`), so
it is not read as the current policy's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from rlgraph.errors import ConfigError
from rlgraph.plan.timing import COMPILE_SECONDS, STEP_SECONDS

# (metrics key, label, format): what the bar shows, in order; the first three are smoothed
_SMOOTHED = (("reward", "reward", "{:.3f}"), ("policy/kl", "kl", "{:.4f}"), ("accuracy", "acc", "{:.1%}"))
_LATEST = (("eval/accuracy", "eval acc", "{:.1%}"),)


class Ema:
    """Exponential moving average with TensorBoard's bias correction: the first value is itself,
    and NaN/inf values are skipped (a NaN reward would otherwise hide every later one).

    >>> ema = Ema(0.9)
    >>> ema.add(1.0), round(ema.add(0.0), 4)   # 0.09 / (1 - 0.9**2)
    (1.0, 0.4737)
    """

    def __init__(self, weight: float):
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0.0 <= weight < 1.0:
            raise ConfigError(f"smoothing weight must be a number in [0, 1), got {weight!r}",
                              fix="use e.g. 0.9 (0 means no smoothing)")
        self.weight, self.total, self.count = float(weight), 0.0, 0
        self.value = math.nan

    def add(self, value: float) -> float:
        if math.isfinite(value):
            self.total = self.weight * self.total + (1.0 - self.weight) * value
            self.count += 1
            self.value = self.total / (1.0 - self.weight ** self.count)
        return self.value


def _check_positive(value: Any, name: str, kind: type, fix: str) -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float) if kind is float else int)
    if not ok or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} must be a positive {kind.__name__}, got {value!r}", fix=fix)


class RunProgress:
    """Progress of `rlgraph train`: steps done out of `total_steps` and/or time out of `seconds`.
    `label` names the phase: the RL loop's bar is "RL"; another phase's (the warm start's "SFT")
    also starts each plain line, so a log tells the phases apart."""

    def __init__(self, total_steps: int | None = None, seconds: float | None = None, *, console: Console | None = None,
                 enabled: bool = True, start_step: int = 0, every: int = 10, smoothing: float = 0.9,
                 label: str = "RL", history: Sequence[Mapping[str, Any]] = ()):
        if total_steps is not None:
            _check_positive(total_steps, "total_steps", int, "give train.steps as an int >= 1 (or leave it unset)")
        if seconds is not None:
            _check_positive(seconds, "seconds", float, "give train.seconds as a number > 0 (or leave it unset)")
        _check_positive(every, "every", int, "print a line every 1 or more steps")
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise ConfigError(f"start_step must be an int >= 0, got {start_step!r}", fix="pass trainer.step")
        if not isinstance(label, str) or not label.strip() or "[" in label:
            raise ConfigError(f"label must be a short non-empty phase name without '[', got {label!r}",
                              fix='e.g. label="SFT" (the RL loop\'s is "RL")')
        self.total_steps, self.seconds, self.every, self.start_step = total_steps, seconds, every, start_step
        self.label = label
        self.console = console or Console()
        self.enabled = bool(enabled)
        self.live = self.enabled and self.console.is_terminal
        self.averages = {key: Ema(smoothing) for key, _, _ in _SMOOTHED}
        self.step_seconds = Ema(smoothing)
        self.compile_seconds = 0.0  # decode compiles so far (generation.compile), outside the s/step average
        self.latest: dict[str, tuple[float, int]] = {}  # key -> (value, the step it was measured at)
        self.step = start_step
        for row in history:  # the steps before a resume, in order: smoothing continues from them
            if _number(row.get("step")) is not None and row["step"] <= start_step:
                self._take(int(row["step"]), row)
        self._progress: Progress | None = None
        self._start = self._last = time.perf_counter()

    # -- what is shown ----------------------------------------------------------------------------
    def update(self, step: int, metrics: Mapping[str, float]) -> None:
        """Take one step's metrics: smooth them, then redraw the bar or print a plain line."""
        if not isinstance(metrics, Mapping):
            raise ConfigError(f"RunProgress.update(step={step!r}) needs a mapping of metrics, got {type(metrics).__name__}",
                              fix="pass the dict the trainer yielded")
        now = time.perf_counter()
        self._take(int(step), metrics)
        seconds = _number(metrics.get(STEP_SECONDS))
        compiling = _number(metrics.get(COMPILE_SECONDS)) or 0.0  # inside the step's time: shown apart, not averaged
        self.compile_seconds += compiling
        self.step_seconds.add((seconds if seconds is not None else now - self._last) - compiling)
        self._last, self.step = now, int(step)
        if self._progress is not None:
            self._progress.update(self._task, completed=self._completed(now), where=self._where(now), info=self.describe())
        elif self.enabled and not self.live and self._due():
            self.console.print(self.plain_line(now), markup=False, highlight=False, soft_wrap=True)  # one log line

    def _take(self, step: int, metrics: Mapping[str, Any]) -> None:
        for key, average in self.averages.items():
            if _number(metrics.get(key)) is not None:
                average.add(_number(metrics[key]))
        for key, _, _ in _LATEST:
            if _number(metrics.get(key)) is not None:
                self.latest[key] = (_number(metrics[key]), step)

    def describe(self) -> str:
        """The metrics part of the line: `reward 0.412  kl 0.0031  acc 45.0%  eval acc 47.5%  1.23 s/step`,
        then `compile 14.3 s` once the decode step has compiled (those seconds are not in s/step)."""
        parts = [f"{label} {fmt.format(self.averages[key].value)}" for key, label, fmt in _SMOOTHED
                 if self.averages[key].count]
        for key, label, fmt in _LATEST:
            if key in self.latest:
                value, at = self.latest[key]
                parts.append(f"{label} {fmt.format(value)}" + (f" @ step {at}" if at != self.step else ""))
        if self.step_seconds.count:
            parts.append(f"{self.step_seconds.value:.2f} s/step")
        if self.compile_seconds:
            parts.append(f"compile {self.compile_seconds:.1f} s")
        return "  ".join(parts)

    def plain_line(self, now: float | None = None) -> str:
        """`step 10/100  reward 0.412  ...  1.23 s/step  [12s]`: the line printed where there is no terminal."""
        now = now if now is not None else time.perf_counter()
        elapsed = "" if self.seconds else f"[{now - self._start:.0f}s]"  # _where shows it against the budget
        phase = "" if self.label == "RL" else self.label  # the RL loop's lines stay as they were
        return "  ".join(part for part in (phase, self._where(now), self.describe(), elapsed) if part)

    def _where(self, now: float) -> str:
        where = f"step {self.step}" + (f"/{self.total_steps}" if self.total_steps else "")
        return where + (f"  {now - self._start:.0f}/{self.seconds:.0f} s" if self.seconds else "")

    def _due(self) -> bool:
        done = self.step - self.start_step
        return done == 1 or self.step % self.every == 0 or self.step == self.total_steps

    def _completed(self, now: float) -> float:
        if self.total_steps is not None:
            return float(self.step)
        return min(now - self._start, self.seconds) if self.seconds is not None else float(self.step)

    # -- lifetime ---------------------------------------------------------------------------------
    def __enter__(self) -> RunProgress:
        self._start = self._last = time.perf_counter()
        if self.live:
            self._progress = Progress(TextColumn(f"[bold]{self.label}"), BarColumn(), TextColumn("{task.fields[where]}"),
                                      TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                                      console=self.console, transient=False)
            total = self.total_steps if self.total_steps is not None else self.seconds
            self._task = self._progress.add_task(self.label, total=total, completed=self._completed(self._start),
                                                 where=self._where(self._start), info="")
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        elif self.enabled and not self.live and self.step > self.start_step and not self._due():
            self.console.print(self.plain_line(), markup=False, highlight=False, soft_wrap=True)  # the last step is always shown


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None

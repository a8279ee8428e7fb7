"""Where a run's metrics go: `metrics.jsonl` (always), TensorBoard, Weights & Biases, MLflow.

The trainer yields one `dict[str, float]` per step; a `MetricLogger` checks it once and hands it to
every sink. `metrics.jsonl` is the run's own record, the one `rlgraph plot` and resumption read:

    {"step": 12, "time": 1767000000.5, "reward": 0.41, "kl": 0.003, ...}

one object per line, flushed as it is written, so a killed run loses at most the line being
written. Non-finite values are written as `null` (JSON has no NaN) and read back as NaN. On resume
from the checkpoint of step k the file is first cut back to the lines of steps <= k, so the steps
the killed run logged after its last checkpoint are not there twice.

    sinks = make_sinks(run_dir, tensorboard=True, wandb=None, mlflow=None, resume_step=None)
    with MetricLogger(sinks) as logger:
        for metrics in trainer.run(steps=100):
            logger.log(trainer.step, metrics)
    rows = read_metrics(run_dir)   # [{"step": 1, "time": ..., "reward": ...}, ...]
"""

from __future__ import annotations

import difflib
import importlib
import json
import math
import numbers
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from rlgraph.errors import ConfigError, RLGraphError

METRICS_FILE = "metrics.jsonl"
_RESERVED = ("step", "time")  # the keys every metrics.jsonl row has besides the metrics


class MetricsError(RLGraphError, ValueError):
    """A metric value or a metrics file that cannot be logged or read; names the step or file:line."""

    def __init__(self, message: str, fix: str | None = None):
        self.summary, self.fix = message, fix
        super().__init__(message + (f"\n  fix: {fix}" if fix else ""))


class MetricSink(Protocol):
    """Something that records one step's scalar metrics. Sinks get metrics already checked."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


# -- checking ---------------------------------------------------------------------------------------
def check_step(step: Any, where: str = "step") -> int:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise MetricsError(f"{where} must be a non-negative int, got {step!r} ({type(step).__name__})",
                           fix="pass the trainer's step counter (trainer.step), an int >= 0")
    return int(step)


def check_metrics(step: int, metrics: Any) -> dict[str, float]:
    """`metrics` as plain floats; a 0-d tensor or numpy scalar is a number too.

    A non-number is refused here, naming the step and key, instead of turning into a broken line
    in metrics.jsonl or an exception deep inside a TensorBoard or W&B writer.
    """
    step = check_step(step)
    if not isinstance(metrics, Mapping):
        raise MetricsError(f"metrics of step {step} must be a mapping of name -> number, got {type(metrics).__name__}",
                           fix="log a dict such as {'reward': 0.5}")
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or not key or key in _RESERVED:
            raise MetricsError(f"metric name {key!r} of step {step} is not allowed",
                               fix=f"use a non-empty string other than {' and '.join(map(repr, _RESERVED))}")
        number = _as_float(value)
        if number is None:
            raise MetricsError(f"metric {key!r} of step {step} is not a number: {value!r} ({type(value).__name__})",
                               fix="log scalars only (a float, an int or a one-element tensor; .item() it)")
        out[key] = number
    return out


def _as_float(value: Any) -> float | None:
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    if hasattr(value, "numel") and hasattr(value, "item") and value.numel() == 1:  # a torch tensor
        item = value.item()
        return float(item) if isinstance(item, numbers.Real) and not isinstance(item, bool) else None
    return None


# -- metrics.jsonl --------------------------------------------------------------------------------
class JsonlSink:
    """`metrics.jsonl`: one JSON object per logged step, flushed every line.

    A fresh run (`resume_step=None`) starts a new file. A resumed one keeps the lines of steps
    <= `resume_step` (rewritten atomically: a temp file then `os.replace`, so a crash mid-rewrite
    leaves the old file whole) and drops a torn last line, then appends. Steps must not go down:
    an evaluation may share its step with the training step before it.
    """

    def __init__(self, path: str | Path, resume_step: int | None = None):
        self.path = Path(path)
        if self.path.is_dir():
            raise ConfigError(f"metrics file {self.path} is a directory",
                              fix=f"pass a file path such as {self.path / METRICS_FILE}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.last_step = -1
        if resume_step is not None:
            resume_step = check_step(resume_step, "resume_step")
            kept = _truncate(self.path, resume_step) if self.path.exists() else []
            self.last_step = max((row["step"] for row in kept), default=-1)
        self._file = open(self.path, "a" if resume_step is not None else "w", encoding="utf-8")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        metrics = check_metrics(step, metrics)
        if step < self.last_step:
            raise MetricsError(f"step {step} logged after step {self.last_step} in {self.path}",
                               fix="log steps in order (an evaluation may repeat the step it follows)")
        row = {"step": int(step), "time": time.time(), **{k: v if math.isfinite(v) else None for k, v in metrics.items()}}
        self._file.write(json.dumps(row, allow_nan=False) + "\n")  # one write: a kill tears at most this line
        self._file.flush()
        self.last_step = int(step)

    def close(self) -> None:
        self._file.close()


def _truncate(path: Path, resume_step: int, parse_row: Callable[[str], dict] | None = None) -> list[dict]:
    """Rewrite `path` keeping the lines of steps <= `resume_step`; returns the rows kept."""
    text = path.read_text(encoding="utf-8")
    kept = [(line, row) for line, row in _parse(text, path, parse_row) if row["step"] <= resume_step]
    handle = tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name + ".", suffix=".tmp",
                                         delete=False, encoding="utf-8")
    try:
        with handle:
            handle.write("".join(line + "\n" for line, _ in kept))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(handle.name, path)
    except BaseException:
        Path(handle.name).unlink(missing_ok=True)
        raise
    return [row for _, row in kept]


def _parse(text: str, path: Path, parse_row: Callable[[str], dict] | None = None) -> list[tuple[str, dict]]:
    """(line, row) for each line of a metrics.jsonl (or samples.jsonl, with its `parse_row`); an
    unreadable last line is a torn write and is dropped, an unreadable line before it is refused
    with its line number."""
    numbered = [(number, line) for number, line in enumerate(text.split("\n"), 1) if line.strip()]
    out = []
    for position, (number, line) in enumerate(numbered):
        try:
            row = (parse_row or _parse_row)(line)
        except ValueError as error:
            if position == len(numbered) - 1:
                break  # the run was killed while writing this line
            raise MetricsError(f"{path}:{number}: {error}",
                               fix="repair or delete that line; metrics.jsonl holds one JSON object per line") from None
        out.append((line, row))
    return out


def _parse_object(line: str) -> dict:
    """A JSON object with a non-negative int `step`: what every line of our .jsonl files is."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"not JSON ({error.msg} at column {error.colno}): {line[:60]!r}") from None
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    step = row.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"'step' must be a non-negative int, got {step!r}")
    return row


def _parse_row(line: str) -> dict:
    row = _parse_object(line)
    for key, value in row.items():
        if key != "step" and value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"metric {key!r} is not a number: {value!r}")
    return {key: math.nan if value is None else value for key, value in row.items()}


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of `run_dir/metrics.jsonl`, in file order; `null` values come back as NaN.

    A torn last line (the run was killed mid-write) is skipped; a file with no readable line is
    refused, as is a missing one.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        what = "is a file" if run_dir.exists() else "does not exist"
        raise MetricsError(f"run directory {run_dir} {what}",
                           fix="pass the directory `rlgraph train` wrote (it holds metrics.jsonl)")
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise MetricsError(f"no {METRICS_FILE} in {run_dir}",
                           fix="pass the run directory of an `rlgraph train` run that has logged at least one step")
    text = path.read_text(encoding="utf-8")
    rows = [row for _, row in _parse(text, path)]
    if not rows and text.strip():
        raise MetricsError(f"{path}: no readable line (its only line is not a JSON object with a 'step')",
                           fix="delete the file and rerun, or point at another run directory")
    return rows


# -- samples.jsonl and reward failures --------------------------------------------------------------
SAMPLES_FILE = "samples.jsonl"
SAMPLE_KINDS = ("train", "eval")


class SampleLog:
    """`samples.jsonl`: a few completions per training step and per evaluation, to read what the
    policy writes (as TRL's and verl's completion tables), one JSON object per line:

        {"step": 3, "kind": "train", "prompt": "2+3=", "completion": "5", "reward": 1.0,
         "rewards": {"math": 1.0}, "answer": "5"}

    Resumed like metrics.jsonl: the lines of steps after `resume_step` are cut atomically first.
    """

    def __init__(self, path: str | Path, resume_step: int | None = None):
        self.path = Path(path)
        if self.path.is_dir():
            raise ConfigError(f"samples file {self.path} is a directory", fix=f"pass a file path such as {SAMPLES_FILE}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():
            _truncate(self.path, check_step(resume_step, "resume_step"), _parse_object)
        self._file = open(self.path, "a" if resume_step is not None else "w", encoding="utf-8")

    def log(self, step: int, kind: str, samples: Sequence[Mapping[str, Any]]) -> None:
        step = check_step(step)
        if kind not in SAMPLE_KINDS:
            raise MetricsError(f"sample kind {kind!r} is not one of {SAMPLE_KINDS}", fix="log 'train' or 'eval' samples")
        # default=str: an answer may be any object the data set holds; one write per line, as metrics.jsonl
        text = "".join(json.dumps({"step": step, "kind": kind, **sample}, default=str) + "\n" for sample in samples)
        self._file.write(text)
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_samples(run_dir: str | Path) -> list[dict]:
    """The rows of `run_dir/samples.jsonl` (a torn last line is skipped); [] when there is none."""
    path = Path(run_dir) / SAMPLES_FILE
    return [row for _, row in _parse(path.read_text(encoding="utf-8"), path, _parse_object)] if path.is_file() else []


def report_reward_failures(step: int, kind: str, failures: Mapping[str, str], console: Any) -> None:
    """Say loudly that a reward term failed on every sample (`reward_on_error: zero` scored them all
    0), naming the term and its first error: the step's reward of 0 measures nothing."""
    from rich.markup import escape  # the error may hold brackets rich would read as markup

    for term, error in failures.items():
        text = (f"{kind} step {step}: every call of reward term {term!r} failed, so its rewards are all 0 "
                f"(reward_on_error: zero); first error: {error}")
        console.print(f"[bold red]warning:[/] {escape(text)}", highlight=False)


# -- TensorBoard ---------------------------------------------------------------------------------
class TensorBoardSink:
    """Scalars in `log_dir` for `tensorboard --logdir`. On resume, the steps after `resume_step`
    that a killed run wrote are hidden by TensorBoard's own purge (SummaryWriter's purge_step)."""

    def __init__(self, log_dir: str | Path, resume_step: int | None = None):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:  # torch imports tensorboard lazily here
            raise ConfigError(f"logging.tensorboard is on but TensorBoard cannot be imported ({error})",
                              fix="pip install tensorboard, or set logging.tensorboard: false") from None
        purge = None if resume_step is None else check_step(resume_step, "resume_step") + 1
        self.writer = SummaryWriter(str(log_dir), purge_step=purge)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in check_metrics(step, metrics).items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()  # a step takes seconds; lose none of them to a kill

    def close(self) -> None:
        self.writer.close()


# -- Weights & Biases and MLflow (optional extras) ---------------------------------------------------
_WANDB_OPTIONS = ("project", "name", "entity", "group", "tags", "notes", "mode", "config")
_MLFLOW_OPTIONS = ("tracking_uri", "experiment", "run_name", "tags")


def _import_extra(module: str, section: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"logging.{section} is set but the {module} package is not installed",
                          fix=f"pip install 'rlgraph[{module}]', or remove logging.{section} from the config") from None


def _check_options(options: Any, allowed: tuple[str, ...], section: str) -> dict[str, Any]:
    if not isinstance(options, Mapping):
        raise ConfigError(f"logging.{section} must be a mapping of options, got {options!r}",
                          fix=f"write e.g. logging.{section}: {{{allowed[0]}: ...}} (options: {', '.join(allowed)})")
    for key in options:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"logging.{section} has an unknown option {key!r}",
                              fix=f"{hint}known options: {', '.join(allowed)}")
    return dict(options)


class WandbSink:
    """A Weights & Biases run (`pip install 'rlgraph[wandb]'`). Options: project, name (the run's
    name), entity, group, tags, notes, mode ("offline" needs no network), config."""

    def __init__(self, options: Mapping[str, Any], run_dir: str | Path | None = None):
        options = _check_options(options, _WANDB_OPTIONS, "wandb")
        self.wandb = _import_extra("wandb", "wandb")
        try:
            self.run = self.wandb.init(dir=str(run_dir) if run_dir is not None else None, **options)
        except Exception as exc:  # no login, no network, a bad entity: say so before any step runs
            raise ConfigError(f"logging.wandb: W&B could not start a run: {type(exc).__name__}: {exc}",
                              fix="run `wandb login`, or set logging.wandb.mode: offline (sync later with `wandb sync`)") from None

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(check_metrics(step, metrics), step=step, commit=True)  # shown now, not when the next step comes

    def close(self) -> None:
        self.run.finish()


class MlflowSink:
    """An MLflow run (`pip install 'rlgraph[mlflow]'`). Options: tracking_uri, experiment, run_name,
    tags. Non-finite values are left out: MLflow stores NaN but its charts and comparisons break on it."""

    def __init__(self, options: Mapping[str, Any]):
        options = _check_options(options, _MLFLOW_OPTIONS, "mlflow")
        self.mlflow = _import_extra("mlflow", "mlflow")
        try:
            if options.get("tracking_uri"):
                self.mlflow.set_tracking_uri(options["tracking_uri"])
            if options.get("experiment"):
                self.mlflow.set_experiment(options["experiment"])
            self.run = self.mlflow.start_run(run_name=options.get("run_name"), tags=options.get("tags"))
        except Exception as exc:  # an unreachable server, a refused store: say so before any step runs
            uri = options.get("tracking_uri") or "the default (./mlruns or MLFLOW_TRACKING_URI)"
            raise ConfigError(f"logging.mlflow: MLflow could not start a run at tracking_uri {uri}: "
                              f"{type(exc).__name__}: {str(exc)[:400]}",
                              fix="check the server is up, or use a database store such as sqlite:///mlflow.db; "
                                  "MLflow 3 refuses a plain directory unless MLFLOW_ALLOW_FILE_STORE=true") from None

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        finite = {k: v for k, v in check_metrics(step, metrics).items() if math.isfinite(v)}
        self.mlflow.log_metrics(finite, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def make_sinks(run_dir: str | Path, *, tensorboard: bool, wandb: Mapping | None, mlflow: Mapping | None,
               resume_step: int | None) -> list[MetricSink]:
    """The sinks of a run in `run_dir`: metrics.jsonl always, plus those the config turns on.

    Everything that can be refused (a bad option, a missing package) is checked before any file is
    touched, so a refused resume leaves metrics.jsonl as it was.
    """
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run directory {run_dir} is a file", fix="choose another run_dir (or name) for the run")
    if not isinstance(tensorboard, bool):
        raise ConfigError(f"logging.tensorboard must be true or false, got {tensorboard!r}",
                          fix="write logging.tensorboard: true or false")
    if resume_step is not None:
        check_step(resume_step, "resume_step")
    wanted = []
    if wandb is not None:
        _check_options(wandb, _WANDB_OPTIONS, "wandb")
        _import_extra("wandb", "wandb")
        wanted.append(lambda: WandbSink(wandb, run_dir))
    if mlflow is not None:
        _check_options(mlflow, _MLFLOW_OPTIONS, "mlflow")
        _import_extra("mlflow", "mlflow")
        wanted.append(lambda: MlflowSink(mlflow))
    if tensorboard:
        wanted.insert(0, lambda: TensorBoardSink(run_dir / "tensorboard", resume_step))
    sinks: list[MetricSink] = [JsonlSink(run_dir / METRICS_FILE, resume_step)]
    try:
        for make in wanted:
            sinks.append(make())
    except BaseException:
        _close_all(sinks)
        raise
    return sinks


def _close_all(sinks: list[MetricSink]) -> None:
    """Close every sink even if one fails; re-raise the first failure."""
    first: BaseException | None = None
    for sink in sinks:
        try:
            sink.close()
        except BaseException as error:  # noqa: BLE001 - every sink gets its close
            first = first or error
    if first is not None:
        raise first


class MetricLogger:
    """Fans one step's metrics out to every sink, checked once; a context manager that closes them."""

    def __init__(self, sinks: list[MetricSink]):
        self.sinks = list(sinks)
        self.closed = False

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if self.closed:
            raise MetricsError(f"step {step} logged after the MetricLogger was closed",
                               fix="log inside the `with MetricLogger(...)` block")
        clean = check_metrics(step, metrics)
        for sink in self.sinks:
            sink.log(step, clean)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            _close_all(self.sinks)

    def __enter__(self) -> MetricLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

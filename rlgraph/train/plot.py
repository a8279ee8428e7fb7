"""PNG curves of a run from its `metrics.jsonl`: `rlgraph plot RUN_DIR`.

    plot_run("runs/math_grpo")   # -> [runs/math_grpo/plots/reward.png, ..., overview.png]

One figure per metric group (reward, accuracy, KL, response length, throughput, step time) and an
`overview.png` with all six for a README. A group whose metrics the run did not log (no KL term,
no evaluation set) is skipped and named in `PlotResult.skipped`. Drawing uses matplotlib's Agg
canvas directly, not pyplot: no display is needed and the caller's pyplot backend is left alone.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path

import attrs
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from rlgraph.errors import ConfigError
from rlgraph.train.logging import MetricsError, read_metrics
from rlgraph.train.progress import Ema

Series = tuple[list[int], list[float]]  # steps, values (NaN where the run logged null)


class PlotResult(list):
    """The PNG paths written (a list of Path), plus `skipped`: group -> why it was not drawn."""

    def __init__(self, paths: list[Path], skipped: dict[str, str]):
        super().__init__(paths)
        self.skipped = skipped


@attrs.frozen
class Group:
    """One figure: its file stem, title, y label, the keys that make it worth drawing, and how."""

    name: str
    title: str
    ylabel: str
    keys: tuple[str, ...]  # drawn when any of them is in the run (a prefix ends with "/")
    draw: Callable[[Axes, dict[str, Series]], None]


def series(rows: list[dict], key: str) -> Series:
    """The (steps, values) of `key` over the rows that have it: eval rows and train rows alike."""
    pairs = [(row["step"], float(row[key])) for row in rows if key in row]
    return [step for step, _ in pairs], [value for _, value in pairs]


def smooth(values: list[float], weight: float | None = None) -> list[float]:
    """Bias-corrected EMA of `values`; by default the weight grows with the run (about 1/20 of its
    length, at most 0.95) so a 10-step run is barely smoothed and a 2,000-step one is readable."""
    if weight is None:
        weight = min(0.95, max(0.0, 1.0 - 20.0 / max(len(values), 1)))
    average = Ema(weight)
    return [average.add(value) if math.isfinite(value) else math.nan for value in values]


# -- the groups ------------------------------------------------------------------------------------
def _raw_and_smooth(ax: Axes, data: Series, label: str, color: str) -> None:
    steps, values = data
    ax.plot(steps, values, color=color, alpha=0.3, linewidth=1)
    ax.plot(steps, smooth(values), color=color, linewidth=2, label=label)


def _draw_reward(ax: Axes, found: dict[str, Series]) -> None:
    if "reward" in found:
        steps, values = found["reward"]
        if "reward/std" in found and found["reward/std"][0] == steps:
            std = found["reward/std"][1]
            ax.fill_between(steps, [m - s for m, s in zip(values, std)], [m + s for m, s in zip(values, std)],
                            color="C0", alpha=0.15, linewidth=0, label="± std over samples")
        _raw_and_smooth(ax, found["reward"], "reward (mean, smoothed)", "C0")
    if "eval/reward" in found:
        ax.plot(*found["eval/reward"], "o-", color="C3", label="eval reward")


def _draw_accuracy(ax: Axes, found: dict[str, Series]) -> None:
    if "accuracy" in found:
        _raw_and_smooth(ax, found["accuracy"], "train accuracy (smoothed)", "C2")
    if "eval/accuracy" in found:
        ax.plot(*found["eval/accuracy"], "o-", color="C3", label="eval accuracy")


def _draw_length(ax: Axes, found: dict[str, Series]) -> None:
    if "response_length/mean" in found:
        _raw_and_smooth(ax, found["response_length/mean"], "train (mean, smoothed)", "C0")
    if "eval/response_length" in found:
        ax.plot(*found["eval/response_length"], "o-", color="C3", label="eval")


def _draw_each(keys: tuple[str, ...]) -> Callable[[Axes, dict[str, Series]], None]:
    def draw(ax: Axes, found: dict[str, Series]) -> None:
        for index, key in enumerate(k for k in keys if k in found):
            _raw_and_smooth(ax, found[key], key, f"C{index}")
    return draw


def _draw_throughput(ax: Axes, found: dict[str, Series]) -> None:
    """Tokens/s on the left axis, samples/s on a right one: they differ by the response length."""
    left = ax
    if "tokens_per_s" in found:
        _raw_and_smooth(ax, found["tokens_per_s"], "tokens/s", "C0")
        ax.set_ylabel("tokens / s")
        if "samples_per_s" in found:
            ax = ax.twinx()
    if "samples_per_s" in found:
        _raw_and_smooth(ax, found["samples_per_s"], "samples/s", "C1")
        ax.set_ylabel("samples / s")
        if ax is not left:
            ax.legend(loc="lower right", fontsize="small")


# Seconds spent once, not per step: drawn as a point they would set the axis (a 20 s warm start against
# 0.05 s steps flattens every curve), so the figure names them instead.
_ONCE = ("time/warm_start_s",)


def _draw_time(ax: Axes, found: dict[str, Series]) -> None:
    """Seconds per step, and each kind of plan step's share of it (time/<stage>_s, time/stage/<name>);
    the warm start's seconds in a note, off the axis."""
    once = []
    for key in (key for key in _ONCE if key in found):
        values = [value for value in found[key][1] if math.isfinite(value)]
        once.append(f"{key.removeprefix('time/').removesuffix('_s').replace('_', ' ')} {values[-1]:.1f} s")
    if once:
        ax.annotate(", ".join(once) + " (not per step: not drawn)", (0.01, 0.99), xycoords="axes fraction",
                    va="top", fontsize="small")
    stages = sorted(key for key in found if key != "time/step_s" and key not in _ONCE)
    for index, key in enumerate(["time/step_s", *stages] if "time/step_s" in found else stages):
        _raw_and_smooth(ax, found[key], key.removeprefix("time/"), f"C{index}")


GROUPS = (
    Group("reward", "Reward", "reward", ("reward", "reward/std", "eval/reward"), _draw_reward),
    Group("accuracy", "Accuracy", "accuracy", ("accuracy", "eval/accuracy"), _draw_accuracy),
    Group("kl", "KL to the reference", "KL", ("policy/kl", "kl"), _draw_each(("policy/kl", "kl"))),
    Group("length", "Response length", "tokens", ("response_length/mean", "eval/response_length"), _draw_length),
    Group("throughput", "Throughput", "per second", ("tokens_per_s", "samples_per_s"), _draw_throughput),
    Group("time", "Seconds per step", "seconds", ("time/",), _draw_time),
)


def _found(rows: list[dict], group: Group) -> dict[str, Series]:
    present = {key for row in rows for key in row}
    keys = sorted(k for k in present if any(k == want or (want.endswith("/") and k.startswith(want)) for want in group.keys))
    found = {key: series(rows, key) for key in keys}
    return {key: data for key, data in found.items() if any(math.isfinite(v) for v in data[1])}


def _style(ax: Axes, group: Group) -> None:
    ax.set_title(group.title)
    ax.set_xlabel("step")
    if not ax.get_ylabel():
        ax.set_ylabel(group.ylabel)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize="small")


def _save(figure: Figure, path: Path) -> Path:
    FigureCanvasAgg(figure)
    figure.savefig(path, dpi=100)
    return path


# -- entry point -------------------------------------------------------------------------------
def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> PlotResult:
    """Write the run's curves as PNGs in `out_dir` (default `run_dir/plots`); returns their paths.

    Groups the run has no data for are skipped (listed in `.skipped` and on stderr); a run with
    none of them is refused, naming the keys it does have.
    """
    rows = read_metrics(run_dir)
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "plots"
    if out.exists() and not out.is_dir():
        raise ConfigError(f"plot output {out} is a file, not a directory",
                          fix="pass --out a directory (it is created if missing)")
    found = {group.name: _found(rows, group) for group in GROUPS}
    skipped = {group.name: f"no {' / '.join(group.keys)} in metrics.jsonl" for group in GROUPS if not found[group.name]}
    if len(skipped) == len(GROUPS):
        keys = sorted({key for row in rows for key in row} - {"step", "time"})
        raise MetricsError(f"nothing to plot in {Path(run_dir) / 'metrics.jsonl'}: {len(rows)} rows, keys {keys or 'none'}",
                           fix="plot a run of `rlgraph train` (it logs reward, accuracy, kl, response_length/mean, ...)")
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for group in GROUPS:
        if found[group.name]:
            figure = Figure(figsize=(7, 4.5), layout="constrained")
            ax = figure.add_subplot()
            group.draw(ax, found[group.name])
            _style(ax, group)
            paths.append(_save(figure, out / f"{group.name}.png"))
    paths.append(_save(_overview(found, Path(run_dir).name), out / "overview.png"))
    for name, why in skipped.items():
        print(f"plot: skipped {name}.png ({why})", file=sys.stderr)
    return PlotResult(paths, skipped)


def _overview(found: dict[str, dict[str, Series]], title: str) -> Figure:
    figure = Figure(figsize=(15, 8), layout="constrained")
    figure.suptitle(title)
    for ax, group in zip(figure.subplots(2, 3).flat, GROUPS):
        if found[group.name]:
            group.draw(ax, found[group.name])
            _style(ax, group)
        else:
            ax.set_title(group.title)
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
            ax.set_axis_off()
    return figure

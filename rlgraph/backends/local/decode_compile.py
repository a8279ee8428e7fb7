"""When the native engine compiles its decode step (`generation.compile: auto|on|off`), and what a
run's compiles cost.

`torch.compile` of the static-shape decode step (`lean_decode.compiled_decode_step`) makes every
decode step cheaper but costs seconds of compilation per (rows, cache length) shape. `on` always
compiles, `off` never does, and `auto` compiles a shape only when the run is long enough to repay it:

    saving  = calls x decode steps per call x step_saving(rows, layers, device)
    compile = the seconds this shape took to compile before, in this Inductor cache directory
              (Inductor serves it from disk: a warm compile), else an estimate of a cold compile
    compile the shape when saving > compile

`calls` is how many generate calls of that many rows the run will make (`rlgraph train`: the RL
steps for the rollouts, the evaluations for the held-out set); a shape the run does not project
is not compiled. The step saving and the cold compile are measured figures (docs/benchmarks.md,
"Decode"), on the 2-core CPU with the 2-layer tiny Qwen2: the saving is dispatch the compiled step
removes, so it is taken per layer; on CUDA it is an estimate (CUDA graphs over the step; untested,
docs/gpu.md). Each measured compile is written to `decode_compiles.json` beside Inductor's own
cache, so the next run of the same shapes knows it compiles warm.

>>> policy = DecodeCompile("auto", calls={16: 1000})  # 1000 x 64 x 0.328 ms = 21 s > 14 s
>>> ledger = CompileLedger(policy)
>>> ledger.decide(rows=16, width=48, steps=64, layers=2, device="cpu", signature="qwen2").compile
True
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from rlgraph.ir.errors import ConfigError, did_you_mean

MODES = ("auto", "on", "off")
WIDTH_BUCKET = 16  # compiled decode pads the prompt columns up to a multiple of this: few cache lengths, few compiles

# Measured on the 2-core CPU, tiny Qwen2 (2 layers), 16 tokens a call, one thread, Inductor's C++
# wrapper (benchmarks/decode.py --rows 8 16 64 128 --threads 1, 2026-11-28): 8, 16, 64, 128 rows save
# 0.32, 0.37, 0.15, -0.19 ms a step. The saving is dispatch removed, and shrinks with the rows, where
# Inductor's kernels lose to eager's BLAS calls: a least-squares fit of a + b x rows gives a = 0.405 ms
# and b = -4.5 us a step, per 2 layers (no saving from ~90 rows on).
CPU_SAVING_PER_LAYER_S = 0.20e-3
CPU_SAVING_PER_ROW_LAYER_S = -2.25e-6
# CUDA (estimate, untested): a CUDA graph replays the step's ~20 kernels a layer without the host
# dispatch of each (~10 us an op in eager PyTorch), whatever the rows.
CUDA_SAVING_PER_LAYER_S = 0.2e-3
# A cold compile (empty Inductor cache) of the 2-layer step took 14.3 s on the 2-core CPU; per layer.
COLD_COMPILE_PER_LAYER_S = 7.0
RECORD_FILE = "decode_compiles.json"


def check_mode(mode: Any, where: str = "generation.compile") -> str:
    """`mode` if it is one of `MODES`, else a `ConfigError` naming `where`."""
    if not isinstance(mode, str) or mode not in MODES:
        raise ConfigError(f"{where}={mode!r} is not a decode compile mode{did_you_mean(str(mode), MODES)}",
                          fix=f"{where}: auto (compile when the run repays it), on or off")
    return mode


def _check_calls(calls: Any) -> dict[int, int]:
    if not isinstance(calls, Mapping):
        raise ConfigError(f"DecodeCompile(calls={calls!r}) is not a mapping of rows to generate calls",
                          fix="calls={64: 200}: 200 generate calls of 64 rows (B x n)")
    for rows, count in calls.items():
        for what, value in (("rows", rows), ("calls", count)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"DecodeCompile(calls=...): {what} {value!r} (in {rows!r}: {count!r}) is not a "
                                  "whole number >= 0", fix="calls={64: 200}: 200 generate calls of 64 rows (B x n)")
    return dict(calls)


def _check_width(width: Any) -> None:
    if width is not None and (isinstance(width, bool) or not isinstance(width, int) or width < 1):
        raise ConfigError(f"DecodeCompile(width={width!r}) is not a whole number >= 1",
                          fix="width=the run's longest prompt in tokens (or None)")


def padded_width(width: int, run_width: int | None = None) -> int:
    """The prompt columns a compiled decode runs over: `width`, at least `run_width` (the run's longest
    prompt, so every batch has the same cache length), rounded up to a multiple of `WIDTH_BUCKET`."""
    width = max(width, run_width or 0)
    return -(-width // WIDTH_BUCKET) * WIDTH_BUCKET


@attrs.frozen
class DecodeCompile:
    """The decode compile policy: `mode` (auto, on, off); for auto, the generate `calls` the run
    projects per number of rows; `width`, the run's longest prompt (a compiled decode pads every
    batch's prompts to it, so one shape per number of rows)."""

    mode: str = attrs.field(default="off", validator=lambda _, __, value: check_mode(value, "DecodeCompile.mode"))
    calls: Mapping[int, int] = attrs.field(factory=dict, converter=_check_calls)
    width: int | None = attrs.field(default=None, validator=lambda _, __, value: _check_width(value))

    @classmethod
    def of(cls, value: DecodeCompile | str | bool, where: str = "decode_compile") -> DecodeCompile:
        """`value` as a policy: a `DecodeCompile`, a mode string, or True/False for on/off."""
        if isinstance(value, DecodeCompile):
            return value
        if isinstance(value, bool):
            return cls("on" if value else "off")
        return cls(check_mode(value, where))


@attrs.frozen
class Decision:
    """Whether one (rows, cache length) shape compiles, and why (the line a run prints)."""

    compile: bool
    reason: str

    def text(self) -> str:
        return f"decode {'compiled' if self.compile else 'eager'}: {self.reason}"


def step_saving(rows: int, layers: int, device: str) -> float:
    """Seconds one decode step of `rows` rows saves when compiled (see the module docstring)."""
    if device == "cuda":
        return CUDA_SAVING_PER_LAYER_S * layers
    return (CPU_SAVING_PER_LAYER_S + CPU_SAVING_PER_ROW_LAYER_S * rows) * layers


def records_path() -> Path:
    """Where measured compile times are kept: beside Inductor's cache (TORCHINDUCTOR_CACHE_DIR)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / RECORD_FILE


def read_records() -> dict[str, list[float]]:
    path = records_path()
    try:
        records = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return records if isinstance(records, dict) else {}


def _write_record(key: str, seconds: float) -> None:
    """Append `seconds` to `key`'s measured compiles, atomically (another run may read the file)."""
    records = read_records()
    records[key] = [*records.get(key, [])[-4:], round(seconds, 3)]
    path = records_path()
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(records, indent=1, sort_keys=True))
    os.replace(tmp, path)


@attrs.define
class CompileLedger:
    """One run's decode compiles: the decision per shape (made once), how many times each shape
    compiled, and the seconds spent compiling (reported apart from the decode time)."""

    policy: DecodeCompile = DecodeCompile()
    decisions: dict[tuple, Decision] = attrs.field(factory=dict)
    compiles: dict[tuple, int] = attrs.field(factory=dict)
    seconds: float = 0.0
    _unreported: float = 0.0

    def decide(self, *, rows: int, width: int, steps: int, layers: int, device: str, signature: str) -> Decision:
        """Whether generate calls of `rows` rows over a cache of `width` + `steps` columns compile."""
        shape = (signature, device, rows, width + steps)
        if shape not in self.decisions:
            self.decisions[shape] = self._decide(rows, width + steps, steps, layers, device, signature)
        return self.decisions[shape]

    def _decide(self, rows: int, length: int, steps: int, layers: int, device: str, signature: str) -> Decision:
        mode = self.policy.mode
        if mode != "auto":
            return Decision(mode == "on", f"generation.compile={mode}")
        calls = self.policy.calls.get(rows, 0)
        saving = calls * steps * step_saving(rows, layers, device)
        measured = read_records().get(_record_key(signature, device, rows, length))
        if measured:
            cost, basis = min(measured), f"compiled before in {records_path().parent}: {min(measured):.1f} s"
        else:
            cost = COLD_COMPILE_PER_LAYER_S * layers
            basis = f"cold compile ~{cost:.0f} s ({layers} layers x {COLD_COMPILE_PER_LAYER_S:.0f} s)"
        projected = (f"{calls} calls x {steps} steps x {step_saving(rows, layers, device) * 1e3:.3f} ms "
                     f"= {saving:.1f} s saved")
        verdict = ">" if saving > cost else "<="
        if saving <= 0:
            projected += " (at this many rows the compiled step is not faster)"
        return Decision(saving > cost, f"auto, {rows} rows x {length} columns: {projected} {verdict} {basis}")

    def first_call(self, shape: tuple) -> bool:
        return shape not in self.compiles

    def compiled(self, shape: tuple, seconds: float, *, signature: str, device: str) -> None:
        """Record that the first call of `shape` (rows, cache length) took `seconds` (its compile)."""
        self.compiles[shape] = self.compiles.get(shape, 0) + 1
        self.seconds += seconds
        self._unreported += seconds
        _write_record(_record_key(signature, device, *shape), seconds)

    def pop_seconds(self) -> float:
        """Compile seconds since the last call (a step's `time/compile_s`)."""
        seconds, self._unreported = self._unreported, 0.0
        return seconds

    def timed(self, shape: tuple, call: Any, *, signature: str, device: str) -> Any:
        """`call()`, timed as the compile of `shape` when it is that shape's first call in this run."""
        if not self.first_call(shape):
            return call()
        started = time.perf_counter()
        out = call()
        self.compiled(shape, time.perf_counter() - started, signature=signature, device=device)
        return out


def _record_key(signature: str, device: str, rows: int, length: int) -> str:
    return f"{signature}|{device}|{rows}x{length}"


def model_signature(model: Any) -> str:
    """What a compiled step's graph depends on besides the shapes: the model's class, its sizes and dtype."""
    config = getattr(model, "config", None)
    fields = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "vocab_size")
    sizes = "-".join(str(getattr(config, name, "?")) for name in fields)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return f"{type(model).__name__}-{sizes}-{dtype}"

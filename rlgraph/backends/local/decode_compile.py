"""When the native engine compiles its prefill and decode (`generation.compile: auto|on|off`), and what
a run's compiles cost.

`torch.compile` of the prefill and of the static-shape decode chunk (`lean_decode.compiled_prefill`,
`compiled_decode_chunk`: k = `CHUNK_STEPS` decode steps and their sampling a call) makes every
decoded token cheaper but costs a compile per (rows, cache length, k) shape (minutes on a loaded
2-core CPU). `on` always compiles, `off` never does, and `auto` compiles a shape only when the run
is long enough to repay it:

    saving  = calls x decode steps per call x step_saving(rows, layers, device)
    compile = the seconds this shape took to compile before, in this Inductor cache directory
              (Inductor serves it from disk: a warm compile), else an estimate of a cold compile
    compile the shape when saving > compile

`calls` is how many generate calls of that many rows the run will make (`rlgraph train`: the RL
steps for the rollouts, the evaluations for the held-out set); a shape the run does not project
is not compiled. The saving and the cold compile are measured figures (docs/benchmarks.md,
"Decode"), on the 2-core CPU with the 2-layer tiny Qwen2, taken per layer; on CUDA the saving is
an estimate (CUDA graphs over the chunk; untested, docs/gpu.md). Nucleus sampling (top-p < 1)
compiles a decode step instead of a chunk, whose smaller compile and saving the rule does not
model. Each measured compile is written to `decode_compiles.json` beside Inductor's own cache, so
the next run of the same shapes knows it compiles warm.

>>> policy = DecodeCompile("auto", calls={16: 2000})  # 2000 x 64 x 1.368 ms = 175 s > 147 s
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

from rlgraph.errors import ConfigError, did_you_mean

MODES = ("auto", "on", "off")
WIDTH_BUCKET = 16  # compiled decode pads the prompt columns up to a multiple of this: few cache lengths, few compiles

# Measured on the 2-core CPU, loaded (load average 2-7), tiny Qwen2 (2 layers), 16 tokens a call, one
# thread, 4 samples a prompt (benchmarks/decode.py --rows 8 16 64 128 --samples 4 --threads 1 --chunk 8,
# 2026-11-28): the compiled prefill and chunks of 8 steps save 0.93, 1.52, 2.41, 2.85 ms a token against
# the eager loop at 8, 16, 64, 128 rows. A least-squares fit of a + b x rows gives a = 1.13 ms and
# b = 14.7 us a token, per 2 layers; not extrapolated past the 128 rows measured.
CPU_SAVING_PER_LAYER_S = 0.566e-3
CPU_SAVING_PER_ROW_LAYER_S = 7.36e-6
CPU_SAVING_ROWS_MEASURED = 128
# CUDA (estimate, untested): a CUDA graph replays the step's ~20 kernels a layer without the host
# dispatch of each (~10 us an op in eager PyTorch), whatever the rows.
CUDA_SAVING_PER_LAYER_S = 0.2e-3
# Compiles of shapes new to an Inductor cache directory that had compiled others (loaded, as above):
# the prefill took 22 s (2 layers), the prefill and a chunk of 8 steps 98-246 s (median 146 s, 16
# rows), hence 11 s a layer and 7.8 s a layer and step. A directory's first compile of all also
# builds Inductor's C++ headers: the prefill alone took 116 s in an empty one.
COLD_PREFILL_PER_LAYER_S = 11.0
COLD_CHUNK_PER_LAYER_STEP_S = 7.8
RECORD_FILE = "decode_compiles.json"
# Decode steps one compiled call runs with their sampling (`lean_decode.decode_chunk`) at most.
CHUNK_STEPS = 8


def chunk_steps(steps: int) -> int:
    """k, the decode steps of one compiled chunk, for calls of `steps` tokens: `CHUNK_STEPS`, or fewer
    for a shorter call (whose last chunk would otherwise decode steps that are all trimmed)."""
    return min(CHUNK_STEPS, steps)


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
    """Seconds a decoded token of `rows` rows saves when compiled (see the module docstring)."""
    if device == "cuda":
        return CUDA_SAVING_PER_LAYER_S * layers
    return (CPU_SAVING_PER_LAYER_S + CPU_SAVING_PER_ROW_LAYER_S * min(rows, CPU_SAVING_ROWS_MEASURED)) * layers


def cold_compile(layers: int, k: int) -> float:
    """Seconds of a cold compile (empty Inductor cache) of the prefill and a decode chunk of `k` steps."""
    return (COLD_PREFILL_PER_LAYER_S + COLD_CHUNK_PER_LAYER_STEP_S * k) * layers


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
            self.decisions[shape] = self._decide(rows, width, steps, layers, device, signature)
        return self.decisions[shape]

    def _decide(self, rows: int, width: int, steps: int, layers: int, device: str, signature: str) -> Decision:
        mode = self.policy.mode
        if mode != "auto":
            return Decision(mode == "on", f"generation.compile={mode}")
        calls = self.policy.calls.get(rows, 0)
        saving = calls * steps * step_saving(rows, layers, device)
        k = chunk_steps(steps)
        length = width + -(-steps // k) * k  # the chunk's cache: whole chunks
        measured = read_records().get(_record_key(signature, device, rows, length, k))
        if measured:
            cost, basis = min(measured), f"compiled before in {records_path().parent}: {min(measured):.1f} s"
        else:
            cost = cold_compile(layers, k)
            basis = (f"cold compile ~{cost:.0f} s (prefill {COLD_PREFILL_PER_LAYER_S:.0f} s + a chunk of {k} steps "
                     f"{COLD_CHUNK_PER_LAYER_STEP_S:.1f} s a step, x {layers} layers)")
        projected = (f"{calls} calls x {steps} steps x {step_saving(rows, layers, device) * 1e3:.3f} ms "
                     f"= {saving:.1f} s saved")
        verdict = ">" if saving > cost else "<="
        if step_saving(rows, layers, device) <= 0:
            projected += " (at this many rows the compiled step is not faster)"
        elif calls == 0:
            projected += " (the run projects no generate calls of this many rows: a run bounded by seconds, say)"
        return Decision(saving > cost, f"auto, {rows} rows x {width + steps} columns: {projected} {verdict} {basis}")

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


def _record_key(signature: str, device: str, *shape: int) -> str:
    """"qwen2|cpu|8x48" for a decode step of 8 rows over 48 cache columns, "...|8x48x8" for its chunk of 8 steps."""
    return f"{signature}|{device}|{'x'.join(str(size) for size in shape)}"


def model_signature(model: Any) -> str:
    """What a compiled step's graph depends on besides the shapes: the model's class, its sizes and dtype."""
    config = getattr(model, "config", None)
    fields = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "vocab_size")
    sizes = "-".join(str(getattr(config, name, "?")) for name in fields)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return f"{type(model).__name__}-{sizes}-{dtype}"

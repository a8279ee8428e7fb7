"""The walk of `train(config)` through rlgraph's code: files visited, stops, climbs back up a floor.

    python benchmarks/walk.py [--depth 3] [--runtime local]

A stop is an rlgraph function a reader following `train(config)` meets: the distinct rlgraph
functions called at most `--depth` rlgraph calls below `train` (library frames in between, torch's
or the standard library's, do not count as a level), in the order they are first called. Its floor
is its package's layer (train and service at the top, then api, algorithms, runtime, passes, plan,
backends, the leaves: rewards, data, agents, functional, kernels, ir, the shared bottom modules).
A climb is a stop on a higher floor than the stop before it in that order: the walk went down and
came back up. The run is a tiny local config (the tests' arithmetic data, 3 warm-start steps,
1 RL step with evaluation), so every floor it visits is one `train()` reaches on the local runtime.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import rlgraph

ROOT = Path(rlgraph.__file__).resolve().parent
FLOORS = {"train": 8, "service": 8, "cli": 9, "api": 7, "algorithms": 6, "runtime": 5, "passes": 4, "plan": 3,
          "backends": 2, "rewards": 1, "data": 1, "agents": 1, "supervised": 1, "functional": 1, "kernels": 1, "ir": 0}


def floor(file: str) -> int:
    parts = Path(file).relative_to(ROOT).parts
    return FLOORS.get(parts[0], 0) if len(parts) > 1 else (7 if parts[0] in ("api.py", "__init__.py") else 0)


def config_file(directory: Path) -> Path:
    import yaml

    rows = [{"question": f"{a}+{b}=", "answer": str(a + b)} for a in range(8) for b in range(8)]
    data = directory / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = {"name": "walk", "run_dir": str(directory / "run"),
              "data": {"train": str(data), "eval_fraction": 0.125, "prompt_field": "question", "chat_template": False},
              "rewards": [{"name": "math"}], "algorithm": {"name": "grpo", "hparams": {"kl": 0.04}},
              "rollout": {"prompts_per_step": 4, "n": 4, "max_new_tokens": 4}, "optimizer": {"lr": 1e-3},
              "warm_start": {"steps": 3, "batch_size": 16, "lr": 2e-3}, "train": {"steps": 1, "seed": 0},
              "runtime": {"threads": 1}, "eval": {"every": 1}, "checkpoint": {"every": 1},
              "logging": {"tensorboard": False, "progress": False, "plots": False}}
    path = directory / "walk.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def walk(depth: int, runtime: str) -> dict[str, object]:
    from rlgraph.train.config import load_config
    from rlgraph.train.run import train

    stops: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    levels: dict[int, int] = {}  # id(frame) -> its rlgraph depth below train()

    def profile(frame, event, arg):
        if event == "return":
            levels.pop(id(frame), None)  # a frame's id is reused once it is gone
        if event != "call":
            return
        caller, level = frame.f_back, None
        while caller is not None and level is None:  # the nearest rlgraph caller sets the level
            level = levels.get(id(caller))
            caller = caller.f_back
        file = frame.f_code.co_filename
        if level is None or not file.startswith(str(ROOT)):
            if level is not None:
                levels[id(frame)] = level  # a library frame between two rlgraph ones adds no level
            return
        levels[id(frame)] = level + 1
        stop = (str(Path(file).relative_to(ROOT)), frame.f_code.co_qualname)
        if level + 1 <= depth and stop not in seen:
            seen.add(stop)
            stops.append(stop)

    with tempfile.TemporaryDirectory() as scratch:
        config = load_config(config_file(Path(scratch)), [f"runtime.runtime={runtime}"])
        frame = sys._getframe()
        levels[id(frame)] = 0
        sys.setprofile(profile)
        try:
            train(config)
        finally:
            sys.setprofile(None)
    floors = [floor(str(ROOT / file)) for file, _ in stops]
    climbs = sum(1 for before, after in zip(floors, floors[1:]) if after > before)
    files = sorted({file for file, _ in stops})
    return {"depth": depth, "files": len(files), "stops": len(stops), "climbs": climbs,
            "stops_in_train": sum(file.startswith("train/") for file, _ in stops),
            "file_list": files, "stop_list": [f"{file}:{name}" for file, name in stops]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--runtime", default="local", choices=("local",))
    parser.add_argument("--json", help="also write the whole walk (every stop) to this file")
    args = parser.parse_args()
    if args.depth < 1:
        parser.error(f"--depth must be at least 1, got {args.depth}")
    result = walk(args.depth, args.runtime)
    print({key: result[key] for key in ("depth", "files", "stops", "climbs", "stops_in_train")})
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

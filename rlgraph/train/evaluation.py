"""`rlgraph eval RUN_DIR`: a checkpoint of a run, scored on held-out prompts by the run's rewards.

    evaluate_run("runs/math_grpo")                                  # the latest checkpoint, the run's eval split
    evaluate_run("runs/math_grpo", checkpoint="300", data="other.jsonl", max_prompts=500)

The prompts go through the run's data settings (fields, chat template, length limit), the policy
is built as the run built it (model, LoRA) with the checkpoint's weights, and the scores come from
one run of the compiled `evaluate` plan (greedy decoding), as the evaluations during training.
The result is printed and saved in `RUN_DIR/evals/<checkpoint>-<data>.json`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rich.console import Console

from rlgraph.errors import ConfigError


def evaluate_run(run_dir: str | Path, *, checkpoint: str | None = None, data: str | None = None,
                 max_prompts: int | None = None, overrides: list[str] = (), console: Console | None = None
                 ) -> dict[str, Any]:
    """Score `checkpoint` (default: the latest) of `run_dir` on `data` (default: the run's eval split)."""
    from rlgraph.runtime.plan_runner import PlanRunner
    from rlgraph.train.checkpoint import resolve_checkpoint, verify_checkpoint
    from rlgraph.train.recipe import build_roles
    from rlgraph.train.roles import checkpoint_policy
    from rlgraph.train.run import load_run_config
    from rlgraph.train.session import _Session
    from rlgraph.train.setup import prepare

    console = console or Console()
    run_dir = Path(run_dir)
    extra = [f"data.eval={data}", "data.eval_fraction=0"] if data is not None else []
    if max_prompts is not None:
        extra.append(f"eval.max_prompts={max_prompts}")
    config = load_run_config(run_dir, [*overrides, *extra])
    config = config.model_copy(update={"runtime": config.runtime.model_copy(update={"runtime": "local", "nproc": 1})})
    path = resolve_checkpoint(run_dir, checkpoint)
    verify_checkpoint(path)  # checksums and the LoRA base, before the plans are compiled
    setup = prepare(config)
    if not setup.eval_rows:
        raise ConfigError(f"{run_dir}: the run has no held-out prompts (no data.eval, eval_fraction 0)",
                          fix="pass --data FILE with prompts to score")
    policy, step = checkpoint_policy(config, setup.tokenizer, path)
    executor = build_roles(setup, policy)
    session = _Session(setup, executor, console, training=False)
    session.eval_runner = PlanRunner(setup.eval, executor)
    try:
        metrics = session.evaluate()
    finally:
        session.close()  # the reward workers
    source = data if data is not None else (config.data.eval or f"{config.data.train} (held-out {config.data.eval_fraction:g})")
    result = {"checkpoint": path.name, "step": step, "data": str(source), "prompts": len(setup.eval_rows),
              "accuracy_reward": config.accuracy_reward, **metrics}
    out = run_dir / "evals" / f"{path.name}-{Path(str(data)).stem if data is not None else 'eval'}.json"
    if not out.parent.exists():
        from rlgraph.train.manifest import claim

        claim(run_dir, out.parent.name)
    out.parent.mkdir(exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, out)
    result["saved"] = str(out)
    return result

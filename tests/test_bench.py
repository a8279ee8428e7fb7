"""`rlgraph bench` (rlgraph/bench.py): the rlgraph side runs, TRL's loss equals rlgraph's, options are checked."""

import json

import pytest
import torch

from rlgraph.bench import (
    CONFIGS, RlgraphSide, Schedule, bench_problems, check_options, fixed_batch, loss_check, main, make_trl_trainer,
    trl_available, write_model,
)
from rlgraph.errors import ConfigError

SMALL = CONFIGS["small"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(SMALL, tmp_path_factory.mktemp("bench") / "model")


def test_rlgraph_side_runs_a_grpo_step(model_dir):
    side = RlgraphSide(SMALL, model_dir, bench_problems(SMALL, 4))
    metrics = side.step()
    assert len(side.seconds) == 1 and 0.0 <= metrics["reward"] <= 1.0
    stages = side.stages_per_step(1)
    assert stages["generate"] > 0 and stages["train"] > 0 and stages["infer"] > 0  # generate, update, reference
    assert sum(stages.values()) <= side.seconds[0]


def test_rlgraph_side_is_a_train_run_drawing_the_prompts_in_the_order_trl_gets(model_dir):
    """The side is `rlgraph train`'s wiring (its resolved config: GRPO with the bench's beta as kl, no
    warm start, no evaluation); `order()` is what its steps train on, step after step."""
    import yaml

    problems = bench_problems(SMALL, 3 * SMALL.prompts)
    side = RlgraphSide(SMALL, model_dir, problems)
    saved = yaml.safe_load((side.run.run_dir / "config.yaml").read_text())
    assert saved["algorithm"]["hparams"]["kl"] == SMALL.beta and saved["warm_start"]["steps"] == 0
    assert side.run.setup.eval_rows == [] and saved["optimizer"]["weight_decay"] == 0.0
    order = side.order()
    assert sorted(p.prompt for p in order) == sorted(p.prompt for p in problems)
    drawn, sampler = [], side.run.session.sampler
    draw = sampler.next_batch

    def recorded():
        rows = draw()
        drawn.extend(row.text for row in rows)
        return rows

    sampler.next_batch = recorded
    for _ in range(3):
        side.step()
    assert drawn == [p.prompt for p in order]
    side.close()


def test_schedule_alternates_whole_rounds():
    schedule = Schedule(steps=5, per_round=2, warmup=1)
    assert (schedule.measured, schedule.total) == (6, 7)
    assert [done for done in range(1, 8) if schedule.boundary(done)] == [1, 3, 5, 7]
    assert [done for done in range(1, 5) if Schedule(steps=4, per_round=2, warmup=0).boundary(done)] == [2, 4]


@pytest.mark.parametrize("flag, kwargs", [
    ("--steps", dict(steps=0)), ("--per-round", dict(per_round=-1)), ("--warmup", dict(warmup=-2)),
    ("--threads", dict(threads=0)), ("--steps", dict(steps=2.5)),
])
def test_bad_options_are_refused_naming_the_flag(flag, kwargs):
    options = dict(steps=3, per_round=1, warmup=0, threads=1) | kwargs
    with pytest.raises(ConfigError, match=f"rlgraph bench: {flag} must be an integer >= .*, got {list(kwargs.values())[0]}"):
        check_options(**options)


def test_main_reports_an_error_and_exit_status_2(capsys):
    assert main(["--no-trl", "--steps", "0"]) == 2
    assert "--steps must be an integer >= 1, got 0" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # argparse: an unknown configuration
        main(["--config", "huge"])


def test_main_without_trl_writes_the_report(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["--no-trl", "--no-compiled-decode", "--steps", "1", "--per-round", "1", "--warmup", "0", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"rlgraph", "rlgraph_hf_decode"}
    for result in report["results"].values():
        assert result["steps_measured"] == 1 and result["samples_per_s"] == pytest.approx(8 / result["median_s_per_step"])
    assert report["config"]["max_new_tokens"] == 16 and "ratio" not in report


@pytest.mark.skipif(trl_available() is not None, reason=f"TRL is not importable: {trl_available()}")
def test_trl_loss_equals_rlgraph_loss_on_a_fixed_batch(model_dir, tmp_path):
    problems = bench_problems(SMALL, 4)
    side = RlgraphSide(SMALL, model_dir, problems)
    trainer = make_trl_trainer(SMALL, model_dir, problems, max_steps=1, output_dir=tmp_path / "trl")
    check = loss_check(SMALL, trainer, side)
    assert check.difference < 1e-5, check
    rollouts, given = fixed_batch(SMALL, side)
    assert not rollouts.prompt_mask.all() and not rollouts.mask.all()  # padded prompts and ragged completions
    # the batch is not trivial: the ratio is clipped on some tokens and the KL term moves the loss
    from rlgraph import functional as F

    lp = side.executor.logprobs(side.executor.current("policy"), rollouts)
    _, clipped, _ = F.ppo_clip(lp, given["old"], given["advantages"][:, None], rollouts.mask)
    assert 0.05 < float(clipped) < 0.95
    assert float(SMALL.beta * F.token_mean(F.kl_k3(lp, given["ref"]), rollouts.mask)) > 1e-3
    assert abs(check.rlgraph) > 1e-2

"""The demo with another RL algorithm: a few steps each, through the compiled plan."""

import pytest
import torch
from rich.console import Console

from rlgraph.cli import main
from rlgraph.errors import ConfigError
from rlgraph.train.demo import DemoConfig, run_demo


@pytest.mark.parametrize("algorithm", ["ppo", "dapo"])
def test_the_demo_runs_other_algorithms_through_the_plan(algorithm, tmp_path):
    config = DemoConfig(algorithm=algorithm, sft_max_steps=2, sft_eval_every=1, rl_max_steps=2, rl_prompts=4,
                        rl_samples=2, threads=1, run_dir=str(tmp_path))
    result = run_demo(config, Console(quiet=True))
    assert result.algorithm == algorithm and result.rl_steps == 2
    plan = (tmp_path / "plan.txt").read_text()
    assert f"plan {algorithm}" in plan
    if algorithm == "ppo":
        assert "values=values" in plan and "critic" in plan
    else:
        assert "loop: steps" in plan and result.samples_per_second >= result.trained_per_second


def test_the_demo_refuses_unknown_algorithms_and_fixed_hparams(capsys):
    assert main(["demo", "--algorithm", "grpoo"]) == 1
    assert "rlgraph demo: --algorithm 'grpoo' is not an RL algorithm of the demo; did you mean 'grpo'?" in capsys.readouterr().err
    with pytest.raises(ValueError, match="rl_samples"):
        run_demo(DemoConfig(hparams={"n": 2}), Console(quiet=True))


def test_a_kl_penalty_gets_a_frozen_reference_copy_of_the_warm_started_policy(tmp_path):
    config = DemoConfig(algorithm="ppo", hparams={"kl": 0.05, "kl_target": 0.01}, sft_max_steps=2, sft_eval_every=1,
                        rl_max_steps=2, rl_prompts=4, rl_samples=2, threads=1, run_dir=str(tmp_path))
    result = run_demo(config, Console(quiet=True))
    assert result.rl_steps == 2
    plan = (tmp_path / "plan.txt").read_text()
    assert "ref" in plan and "adaptive_kl_coef" in plan and "kl_coef:f32[]" in plan


@pytest.mark.slow
def test_the_demo_runs_rl_on_two_spmd_worker_processes(tmp_path, monkeypatch):
    from rlgraph.train import run

    # the controller builds no model: the warm start, RL and evaluations run as plans on the workers
    monkeypatch.setattr(run, "build_roles", lambda *_: pytest.fail("the spmd controller built the model roles"))
    config = DemoConfig(sft_max_steps=2, sft_eval_every=1, rl_max_steps=3, rl_prompts=4, rl_samples=2, threads=1,
                        run_dir=str(tmp_path), runtime="spmd", nproc=2, device="cpu")
    result = run_demo(config, Console(quiet=True))
    assert result.rl_steps == 3
    assert "fsdp2 shard=2" in (tmp_path / "plan.txt").read_text()
    assert (tmp_path / "latest").exists()  # the remote run's checkpoint, gathered from the ranks' shards
    assert result.test_before_rl is not None and result.test_after_rl is not None  # evaluated on the workers


@pytest.mark.parametrize("flags, message", [
    (["--nproc", "3"], "must divide the 32 prompts"),
    (["--timeout", "-1"], "positive number of seconds"),
    (["--timeout", "0"], "positive number of seconds"),
])
def test_the_demo_refuses_a_runtime_it_cannot_run_before_training(flags, message, capsys):
    assert main(["demo", "--runtime", "spmd", *flags]) == 1  # one message, before the warm start
    assert message in capsys.readouterr().err
    with pytest.raises(ValueError, match=message):
        run_demo(DemoConfig(runtime="spmd", nproc=int(flags[1]) if flags[0] == "--nproc" else 2,
                            timeout_s=float(flags[1]) if flags[0] == "--timeout" else None), Console(quiet=True))


@pytest.mark.parametrize("flags", [["--nproc", "0"], ["--nproc", "two"], ["--runtime", "mpi"], ["--device", "gpu"]])
def test_the_demo_flags_refuse_bad_values(flags, capsys):
    with pytest.raises(SystemExit):
        main(["demo", *flags])
    err = capsys.readouterr().err
    assert "error: argument " + flags[0] in err  # argparse names the flag


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_the_demo_refuses_cuda_without_a_gpu_before_training():
    with pytest.raises(ConfigError, match="runtime.device 'cuda': .*torch sees no CUDA GPU here"):
        run_demo(DemoConfig(device="cuda", threads=1, run_dir=None), Console(quiet=True))


def test_the_demo_is_a_train_config_that_rlgraph_train_reruns_step_for_step(tmp_path):
    """The demo writes its resolved TrainConfig (config.yaml) and data; `train()` of that file alone
    repeats the run: the same warm start, the same per-step loss and reward, the same evaluations."""
    import json

    from rlgraph.train.run import load_run_config, train

    config = DemoConfig(sft_max_steps=3, sft_eval_every=1, sft_target=0.9, rl_max_steps=2, rl_prompts=4,
                        rl_samples=2, threads=1, run_dir=str(tmp_path / "demo"))
    demo = run_demo(config, Console(quiet=True))
    rerun_config = load_run_config(tmp_path / "demo").model_copy(update={"run_dir": str(tmp_path / "again")})
    again = train(rerun_config, console=Console(quiet=True))
    assert (again.steps, again.eval_before, again.eval_after) == (demo.rl_steps, demo.test_before_rl, demo.test_after_rl)

    def rows(run_dir):
        keep = ("step", "reward", "policy/loss", "policy/grad_norm", "warm_start/steps", "eval/accuracy")
        return [{key: row[key] for key in keep if key in row}
                for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]

    assert rows(tmp_path / "again") == rows(tmp_path / "demo")
    assert demo.sft_steps == 3 and len(rows(tmp_path / "demo")) == 4  # warm start row, 2 RL steps, final evaluation


def test_a_second_demo_in_the_same_directory_starts_afresh_and_another_run_is_left_alone(tmp_path):
    config = DemoConfig(sft_max_steps=1, sft_eval_every=1, rl_max_steps=1, rl_prompts=4, rl_samples=2, threads=1,
                        run_dir=str(tmp_path))
    for _ in range(2):  # `make demo` twice: the first demo's checkpoints are replaced, not resumed or refused
        assert run_demo(config, Console(quiet=True)).rl_steps == 1
    assert sorted(path.name for path in tmp_path.glob("step-*")) == ["step-000001"]
    (tmp_path / "config.yaml").write_text("name: my-run\n")  # now the directory of another run
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        run_demo(config, Console(quiet=True))
    assert (tmp_path / "step-000001").is_dir()

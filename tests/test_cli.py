"""The command line, in process: `rlgraph list`, names in -p, `--import` of the user's module."""

import sys
import textwrap

import attrs
import pytest
from rich.console import Console

from rlgraph import functional as F
from rlgraph.algorithms import ALGORITHMS
from rlgraph.cli import main

USER_MODULE = '''
    """Estimators and losses of a user's project."""
    import rlgraph as rg
    from rlgraph import functional as F


    @F.estimator
    def cli_best_of_group(r):                     # r: f32[n], one group
        """Best-of-group baseline: A_i = r_i - max_g r."""
        return r - r.max()


    @rg.traceable
    def cli_plain_pg(lp, old_lp, adv, mask):
        """Plain policy gradient: L = token_mean(-A lp)."""
        return (F.token_mean(-adv * lp, mask),)


    F.register_loss("cli_plain_pg", cli_plain_pg, metrics=())
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module `cli_user_module.py` in a fresh working directory, not imported yet."""
    (tmp_path / "cli_user_module.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "cli_user_module", raising=False)
    yield tmp_path / "cli_user_module.py"
    sys.modules.pop("cli_user_module", None)


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_list_prints_every_algorithm_estimator_and_loss_on_one_line(capsys):
    code, out, _ = run(capsys, "list")
    lines = out.splitlines()
    assert code == 0 and [line for line in lines if not line.startswith("  ")] == [
        "algorithms (rlgraph trace|plan <name>, rlgraph demo --algorithm <name>):",
        "estimators (group advantage estimators: -p estimator=<name> for grpo; F.get_estimator(name)):",
        "losses (policy losses: -p loss=<name> for grpo; F.get_loss(name)):",
    ]
    assert len(lines) == 3 + len(ALGORITHMS) + len(F.ESTIMATORS) + len(F.LOSSES)
    assert any(line.split()[:2] == ["rloo", "RLOO:"] for line in lines)
    assert any(line.startswith("  dr_grpo") and "group_normalize(scale=False)" in line for line in lines)
    assert any(line.startswith("  grpo ") and "GRPO (Shao et al." in line for line in lines)


def test_list_one_section_names_the_metrics_of_each_loss(capsys):
    code, out, _ = run(capsys, "list", "losses")
    assert code == 0 and out.startswith("losses (") and "estimators (" not in out
    assert "Returns (loss, clip_frac, approx_kl, entropy, kl)." in out and out.count("\n") == 1 + len(F.LOSSES)


def test_trace_and_plan_take_any_registered_name(capsys):
    code, out, _ = run(capsys, "trace", "grpo", "-p", "estimator=rloo", "-p", "loss=gspo")
    assert code == 0 and "d:f32[N] = rloo b c" in out and "= gspo[clip_low=0.2 clip_high=0.2] lp f e g" in out
    code, out, _ = run(capsys, "plan", "grpo", "-p", "estimator=dr_grpo", "-p", "loss=policy_loss")
    assert code == 0 and "kernels: fused_group_normalize" in out and "fused_policy_loss (in loss)" in out


@pytest.mark.parametrize("command", ["trace", "plan"])
def test_an_unknown_name_is_one_message_not_a_traceback(capsys, command):
    code, out, err = run(capsys, command, "grpo", "-p", "estimator=rlo")
    assert code == 1 and out == "" and "Traceback" not in err
    assert err.startswith(f"rlgraph {command}: estimator='rlo' is not a registered estimator; did you mean 'rloo'?")
    assert "fix: use one of dr_grpo, gpg, group_normalize" in err


def test_import_registers_the_users_estimator_and_loss(capsys, user_module):
    code, out, _ = run(capsys, "list", "--import", "cli_user_module")
    assert code == 0 and "cli_best_of_group" in out and "Best-of-group baseline" in out and "cli_plain_pg" in out
    code, out, _ = run(capsys, "trace", "grpo", "--import", "cli_user_module", "-p", "estimator=cli_best_of_group",
                       "-p", "loss=cli_plain_pg")
    assert code == 0 and "= cli_best_of_group[n=8] b c" in out and "= cli_plain_pg lp f e g" in out
    code, out, _ = run(capsys, "plan", "grpo", "--import", str(user_module), "-p", "estimator=cli_best_of_group")
    assert code == 0 and "cli_best_of_group=cli_best_of_group" in out      # a path works too


def test_an_import_that_is_not_found_says_how_to_fix_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="--import no_such_module: No module named 'no_such_module'; run rlgraph from"):
        main(["trace", "grpo", "--import", "no_such_module"])
    with pytest.raises(SystemExit, match="no file 'missing.py'"):
        main(["list", "--import", "missing.py"])


def test_demo_passes_names_to_the_rl_algorithm_and_checks_them_before_training(capsys, user_module, monkeypatch):
    from rlgraph.train import demo

    configs, run_demo = [], demo.run_demo

    def small_demo(config):  # the CLI's config, shrunk to two SFT and two RL steps
        configs.append(config)
        return run_demo(attrs.evolve(config, sft_max_steps=2, sft_eval_every=1, rl_max_steps=2, rl_prompts=4,
                                     rl_samples=2, threads=1), Console(quiet=True))

    monkeypatch.setattr(demo, "run_demo", small_demo)
    run_dir = user_module.parent / "run"
    code = main(["demo", "--import", "cli_user_module", "-p", "estimator=cli_best_of_group", "-p", "loss=gspo",
                 "--run-dir", str(run_dir)])
    assert code == 0 and configs[0].hparams == {"estimator": "cli_best_of_group", "loss": "gspo"}
    plan = (run_dir / "plan.txt").read_text()
    assert "cli_best_of_group=cli_best_of_group" in plan

    code, _, err = run(capsys, "demo", "-p", "loss=gsop")
    assert code == 1 and "did you mean 'gspo'" in err and len(configs) == 1   # refused before the SFT warm start


def test_check_runs_the_properties_of_a_registered_estimator(capsys):
    assert main(["check", "estimator", "rloo"]) == 0
    out = capsys.readouterr().out
    assert "estimator rloo: padding invariance holds" in out and "group-permutation equivariance holds" in out


def test_check_prints_the_counterexample_of_a_broken_estimator(capsys):
    import rlgraph.functional as F

    @F.estimator(name="cli_first_sample_baseline")
    def first_sample_baseline(r):  # the baseline depends on which sample comes first: not equivariant
        return r - r[0]

    assert main(["check", "estimator", "cli_first_sample_baseline"]) == 1
    out = capsys.readouterr().out
    assert "FAILED group-permutation equivariance" in out and "RolloutBatch.of(" in out


def test_check_names_an_unknown_estimator(capsys):
    assert main(["check", "estimator", "rlo"]) == 1
    assert "did you mean 'rloo'" in capsys.readouterr().err

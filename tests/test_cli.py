"""The command line, in process: `rlgraph list`, names in -p, `--import` of the user's module."""

import re
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


def fresh_module(tmp_path, monkeypatch, name: str, source: str):
    """The module `name`.py holding `source`, in a fresh working directory, not imported yet."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, name, raising=False)
    yield tmp_path / f"{name}.py"
    sys.modules.pop(name, None)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """`cli_user_module.py`: an estimator and a loss."""
    yield from fresh_module(tmp_path, monkeypatch, "cli_user_module", USER_MODULE)


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_list_prints_every_algorithm_estimator_and_loss_on_one_line(capsys):
    code, out, _ = run(capsys, "list")
    lines = out.splitlines()
    assert code == 0 and [line for line in lines if not line.startswith("  ")] == [
        "algorithms (rlgraph trace|plan <name>, rlgraph demo --algorithm <name>):",
        "estimators (group advantage estimators: -p estimator=<name> for grpo, agent_grpo; F.get_estimator(name)):",
        "losses (policy losses: -p loss=<name> for grpo, agent_grpo; F.get_loss(name)):",
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


def test_plan_offloads_only_around_generation_and_update(capsys):
    code, out, _ = run(capsys, "plan", "ppo", "--mesh", "4x8:h200", "--placement", "colocated:tp=8", "--model", "llama3-70b")
    assert code == 0 and "policy    ranks 0-31   train: fsdp2 shard=32 ckpt; generate: vllm tp=8 dp=4" in out
    assert [line for line in out.splitlines() if "optimizer+grads" in line] == [
        "  [2] offload    @policy    optimizer+grads 28.75 GiB; vllm wakes kv_cache",
        "  [17] onload     @policy    optimizer+grads 28.75 GiB; vllm sleeps (weights+kv_cache)"]


def _peak_per_rank(out: str) -> float:
    """The largest per-rank device peak (GiB) of a printed plan's groups."""
    return max(float(peak) for peak in re.findall(r"peak ([\d.]+) GiB/rank", out))


def test_plan_70b_ppo_with_cpu_offload_needs_less_device_memory(capsys):
    # The training state (16 bytes per parameter of the policy and of the critic) moves to host memory.
    args = ["plan", "ppo", "--mesh", "4x8:h100", "--model", "llama3-70b", "--placement"]
    # Without it, the sync after an update holds both trainers' states and the woken engine's weights.
    code, _, err = run(capsys, *args, "colocated:tp=8")
    assert code == 1 and "it needs 82.14 GiB but the device has 80.0 GiB" in err and "when: policy.sync_weights runs" in err
    code, resident, _ = run(capsys, "plan", "ppo", "--mesh", "4x8:h200", *args[4:], "colocated:tp=8")
    assert code == 0 and _peak_per_rank(resident) == 43.15
    # Without cpu_offload the host holds what the offload steps park and the sleeping vLLM engine's weights.
    assert ("  policy    offload       45.17 GiB  (params 16.43 GiB, grads 4.11 GiB, optimizer 16.43 GiB, "
            "master_weights 8.21 GiB)") in resident
    code, out, _ = run(capsys, *args, "colocated:tp=8,cpu_offload=True")
    assert code == 0 and "placement colocated(fsdp=32, tp=8, offload=True, cpu_offload=True)" in out
    assert "policy    ranks 0-31   train: fsdp2 shard=32 ckpt cpu_offload; generate: vllm tp=8 dp=4" in out
    assert _peak_per_rank(out) == 16.55  # the generator's weights and KV cache; training holds 10.66 GiB
    assert "  policy    train       10.66 GiB  (activations 425.16 MiB, logits 469.69 MiB, workspace 9.79 GiB)" in out
    assert "host memory per rank (a node has 2048.00 GiB for 8 ranks):" in out
    assert ("  critic    cpu_offload   41.07 GiB  (params 4.11 GiB, grads 4.11 GiB, optimizer 16.43 GiB, "
            "master_weights 8.21 GiB, workspace 8.21 GiB)") in out
    assert "[2] offload    @policy    nothing (cpu_offload: optimizer+grads stay in host memory) 0 B" in out


def test_plan_70b_ppo_fits_two_nodes_of_h100s_only_with_cpu_offload(capsys):
    args = ["plan", "ppo", "--mesh", "2x8:h100", "--model", "llama3-70b", "--placement"]
    code, _, err = run(capsys, *args, "colocated:tp=8")
    # While the critic trains, the policy's state (43.81 GiB) stays beside the critic's step (104.03 GiB).
    assert code == 1 and "role critic+policy does not fit on rank 0: it needs 147.84 GiB but the device has 80.0 GiB" in err
    assert "when: critic.train runs; critic.infer, policy.generate, policy.train keep what offload=True leaves" in err
    assert "keep parameters, gradients and optimizer state in host memory (cpu_offload=True)" in err
    code, out, _ = run(capsys, *args, "colocated:tp=8,cpu_offload=True")
    assert code == 0 and _peak_per_rank(out) < 80
    code, _, err = run(capsys, "plan", "ppo", "--mesh", "gpu:8", "--model", "llama3-70b", "--placement",
                       "colocated:tp=8,cpu_offload=True")  # one node: its 2 TiB of host memory is too small
    assert code == 1 and err.startswith("rlgraph plan: the host memory of node 0 cannot hold what its ranks offload")


@pytest.mark.parametrize("value", ["yes", "2", "None"])
@pytest.mark.parametrize("placement", ["colocated:tp=2,cpu_offload={}", "split:policy=4,rollout=4,cpu_offload={}"])
def test_plan_cpu_offload_must_be_true_or_false(capsys, placement, value):
    code, out, err = run(capsys, "plan", "grpo", "--mesh", "gpu:8", "--placement", placement.format(value))
    shown = repr(value) if value == "yes" else value
    assert code == 1 and out == "" and f": cpu_offload must be True or False, got {shown}\n  fix: rg." in err


def test_plan_engine_is_named_in_the_layout_and_checked(capsys):
    code, out, _ = run(capsys, "plan", "grpo", "--mesh", "gpu:8", "--engine", "native")
    assert code == 0 and "generate: native tp=1 dp=8" in out
    code, out, err = run(capsys, "plan", "grpo", "--mesh", "cpu:2", "--placement", "colocated:tp=2")
    assert code == 1 and out == "" and err.startswith("rlgraph plan: role 'policy': generate tp=2 needs an engine with "
                                                      "tensor parallelism; the native engine runs tp=1 only")
    assert "fix: rg.colocated(tp=1) (--placement colocated:tp=1), or engine='vllm' (--engine vllm) on a GPU mesh" in err
    code, _, err = run(capsys, "plan", "grpo", "--mesh", "cpu:2", "--engine", "vllm")
    assert code == 1 and err.startswith("rlgraph plan: engine='vllm' on the mesh 1x2 cpu with colocated offload=True")


@pytest.mark.parametrize(("engine", "hint"), [("vlm", "; did you mean 'vllm'?"), ("NATIVE", "; did you mean 'native'?"),
                                              ("", "")])
def test_plan_names_the_engines_there_are(capsys, engine, hint):
    code, out, err = run(capsys, "plan", "grpo", "--engine", engine)
    assert code == 1 and out == "" and "Traceback" not in err
    assert err == f"rlgraph plan: unknown generation engine {engine!r}: choose one of 'auto', 'native', 'vllm'{hint}\n"


@pytest.mark.parametrize(("placement", "message"), [
    ("colocated:tpp=2", "rlgraph plan: --placement 'colocated:tpp=2': unknown option 'tpp'; did you mean 'tp'? "
                        "(colocated takes fsdp, tp, offload, checkpointing, cpu_offload, grad_sync)"),
    ("colocated:offlaod=False", "unknown option 'offlaod'; did you mean 'offload'?"),
    ("colocated:engine=vllm", "unknown option 'engine' (colocated takes fsdp, tp, offload, checkpointing, cpu_offload, grad_sync)"),
    ("colocated:tp=[1", "--placement colocated: tp=[1: '[1' is not a value"),
    ("split:policy", "--placement split: 'policy' must be written key=value"),
])
def test_plan_placement_with_an_unknown_option_says_which_there_are(capsys, placement, message):
    code, _, err = run(capsys, "plan", "grpo", "--mesh", "cpu:2", "--placement", placement)
    assert code == 1 and message in err and "fix:" in err and "Traceback" not in err, err


def test_plan_placement_values_are_checked_by_the_compiler(capsys):
    code, _, err = run(capsys, "plan", "grpo", "--mesh", "cpu:2", "--placement", "colocated:tp=x")
    assert code == 1 and "group 'policy' has 2 ranks, which tp='x' does not divide; tp must be one of [1, 2]" in err
    code, out, _ = run(capsys, "plan", "grpo", "--mesh", "gpu:8", "--placement", "split:policy=4,rollout=4,tp=2,checkpointing=False")
    assert code == 0 and "rollout   ranks 4-7    generate: vllm tp=2 dp=2" in out and "shard=4 ckpt" not in out


def test_import_registers_the_users_estimator_and_loss(capsys, user_module):
    code, out, _ = run(capsys, "list", "--import", "cli_user_module")
    assert code == 0 and "cli_best_of_group" in out and "Best-of-group baseline" in out and "cli_plain_pg" in out
    code, out, _ = run(capsys, "trace", "grpo", "--import", "cli_user_module", "-p", "estimator=cli_best_of_group",
                       "-p", "loss=cli_plain_pg")
    assert code == 0 and "= cli_best_of_group[n=8] b c" in out and "= cli_plain_pg lp f e g" in out
    code, out, _ = run(capsys, "plan", "grpo", "--import", str(user_module), "-p", "estimator=cli_best_of_group")
    assert code == 0 and "cli_best_of_group=cli_best_of_group" in out      # a path works too


def test_an_import_that_is_not_found_says_how_to_fix_it(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, "trace", "grpo", "--import", "no_such_module")
    assert code == 1 and "rlgraph trace: --import no_such_module: No module named 'no_such_module'" in err
    assert "fix: run rlgraph from the directory that holds it" in err
    code, _, err = run(capsys, "list", "--import", "missing.py")
    assert code == 1 and "--import missing.py: no file 'missing.py'" in err


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
    assert "finiteness holds" in out and "singleton groups give 0 holds" in out
    # rloo itself warns nothing; a HypothesisDeprecationWarning about the global `random` state can come
    # from what an earlier test in the same worker left behind, and is summarised, not repeated
    assert [line for line in out.splitlines() if "warning" in line and "HypothesisDeprecationWarning" not in line] == []


def test_check_prints_the_counterexample_of_a_broken_estimator(capsys):
    import rlgraph.functional as F

    @F.estimator(name="cli_first_sample_baseline")
    def first_sample_baseline(r):  # the baseline depends on which sample comes first: not equivariant
        return r - r[0]

    assert main(["check", "estimator", "cli_first_sample_baseline"]) == 1
    out = capsys.readouterr().out
    assert "FAILED group-permutation equivariance" in out and "RolloutBatch.of(" in out


def test_check_fails_an_estimator_whose_singleton_groups_give_nan_and_sums_up_its_warnings(capsys):
    @F.estimator(name="cli_sample_z_score")
    def sample_z_score(r):  # the unbiased std of one sample is NaN, and torch warns at every draw
        return (r - r.mean()) / r.std()

    assert main(["check", "estimator", "cli_sample_z_score"]) == 1
    out = capsys.readouterr().out
    assert "estimator cli_sample_z_score: FAILED finiteness" in out
    assert re.search(r"\n  warning \(\d+x\) UserWarning at .*test_cli.py:\d+: std\(\): degrees of freedom is <= 0", out)
    assert "Triggered internally" not in out  # torch's C++ location is cut: one readable line per warning
    # the counterexample runs as printed (it calls the registered estimator) and gives the NaN
    snippet = textwrap.dedent(out.split("paste into a test to reproduce:\n")[1].split("\n\n  warning")[0])
    namespace: dict = {}
    with pytest.warns(UserWarning, match="degrees of freedom"):
        exec(snippet, namespace)
    assert namespace["out"].isnan().any()


def test_check_names_an_unknown_estimator(capsys):
    assert main(["check", "estimator", "rlo"]) == 1
    assert "did you mean 'rloo'" in capsys.readouterr().err


def test_plan_placement_auto_prints_the_winner_the_runners_up_and_why(capsys):
    code, out, _ = run(capsys, "plan", "ppo", "--mesh", "2x8:h100", "--model", "qwen2.5-7b", "--placement", "auto",
                       "--sizes", "B=64,P=512,T=1024")
    assert code == 0 and "estimated step time on h100:" in out and "placement search:" in out
    assert "  #2 " in out and "why: " in out and "The runner-up" in out
    code, _, err = run(capsys, "plan", "ppo", "--placement", "atuo")
    assert code == 1 and "--placement 'atuo': unknown placement 'atuo'; did you mean 'auto'?" in err


# (argv, what the one-line message must say): each was a raw error or a traceback before
BAD_COMMAND_LINES = [
    (["plan", "grpo", "--mesh", "8"], "cannot parse mesh '8'"),
    (["plan", "grpo", "--mesh", "gpu8"], "cannot parse mesh 'gpu8'"),
    (["plan", "grpo", "--mesh", "h999:8"], "unknown device 'h999'"),
    (["plan", "grpo", "--sizes", "B=4,P=4"], "has no T"),
    (["plan", "grpo", "--sizes", "B=abc,P=4,T=4"], "--sizes B=abc,P=4,T=4: B='abc' is not a whole number"),
    (["plan", "grpo", "--sizes", "B=1.5,P=4,T=4"], "B=1.5 is not a whole number"),
    (["plan", "grpo", "--sizes", "B=0,P=4,T=4"], "sizes: B=0 is not a whole number >= 1"),
    (["trace", "grpo", "-p", "temperature=hot"], "rg.generate: temperature='hot' is not valid"),
    (["trace", "ppo", "-p", "lam=1.5"], "ppo: lam=1.5 is not valid"),
    (["trace", "grpo", "-p", "grad_clip=-1"], "grpo has no hyper-parameter 'grad_clip'"),
    (["plan", "grpo", "--dot", "/no/such/dir/plan.dot"], "--dot /no/such/dir/plan.dot: the directory '/no/such/dir' does not exist"),
    (["plan", "grpo", "--json", "/no/such/dir/plan.json"], "--json /no/such/dir/plan.json"),
]


@pytest.mark.parametrize("argv, message", BAD_COMMAND_LINES, ids=[" ".join(argv[2:]) for argv, _ in BAD_COMMAND_LINES])
def test_a_bad_value_is_one_message_naming_it(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 1 and message in err and "Traceback" not in err, err
    assert "fix:" in err or "did you mean" in err or "it has" in err, err


def test_any_error_is_one_message_and_debug_shows_the_traceback(capsys, monkeypatch):
    import rlgraph.cli as cli

    def broken(args):
        raise KeyError("deep inside")

    monkeypatch.setattr(cli, "_trace", broken)  # main looks the command up when it runs
    code, _, err = run(capsys, "trace", "grpo")
    assert code == 1 and "rlgraph trace: KeyError: 'deep inside'" in err and "Traceback" not in err
    assert "--debug" in err
    for argv in (["--debug", "trace", "grpo"], ["trace", "grpo", "--debug"]):
        code, _, err = run(capsys, *argv)
        assert code == 1 and "Traceback" in err and "KeyError: 'deep inside'" in err


def test_ctrl_c_is_one_line_and_the_exit_status_of_sigint(capsys, monkeypatch, tmp_path):
    import rlgraph.cli as cli
    import rlgraph.train.run as run_module

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_plan", interrupted)
    code, _, err = run(capsys, "plan", "grpo")
    assert (code, err.strip()) == (130, "rlgraph plan: interrupted")
    monkeypatch.setattr(run_module, "train", interrupted)  # before its warm start: no checkpoint to name
    from tests.train.test_run import make_config

    _, config = make_config(tmp_path, "run")
    code, _, err = run(capsys, "train", str(config))
    assert code == 130 and "Traceback" not in err
    assert err.strip() == f"rlgraph train: interrupted; {tmp_path / 'run'} holds no checkpoint yet (the first is " \
                          "written after the warm start)"


USER_ALGORITHM = '''
    import rlgraph as rg


    @rg.algorithm
    def my_pg(state: rg.State, prompts: rg.Prompts, *, n=4, scale=1.0):
        ro = rg.generate(state.policy, prompts, n=n)
        r = rg.score(state.reward, ro)
        return state, {"reward": r.mean() * scale}


    def not_an_algorithm(state, prompts):
        return state, {}
'''


@pytest.fixture
def user_algorithm(tmp_path, monkeypatch):
    """`my_algos.py`: an @rg.algorithm `my_pg` and a plain function."""
    yield from fresh_module(tmp_path, monkeypatch, "my_algos", USER_ALGORITHM)


@pytest.mark.parametrize("spec", ["my_algos.py:my_pg", "my_algos:my_pg"])
def test_trace_and_plan_take_the_users_algorithm(capsys, user_algorithm, spec):
    code, out, err = run(capsys, "trace", spec, "-p", "scale=2e-1")
    assert code == 0, err
    assert "; n=4 scale=0.2 ." in out and "= generate[n=4 " in out  # -p 2e-1 is a float, as -o reads it
    code, out, err = run(capsys, "plan", spec, "--mesh", "cpu:2", "-p", "n=2")
    assert code == 0 and out.startswith("plan my_pg  on 1x2 cpu") and "(32 prompts x n=2)" in out, err


@pytest.mark.parametrize("spec, message", [
    ("my_algos.py:no_such", "algorithm 'my_algos.py:no_such': my_algos.py has no 'no_such'"),
    ("missing.py:my_pg", "algorithm 'missing.py:my_pg': cannot import missing.py: no file 'missing.py'"),
    ("my_algos.py:not_an_algorithm", "algorithm 'my_algos.py:not_an_algorithm' is a function, not an algorithm"),
    ("my_algos.py:", "algorithm 'my_algos.py:' is not 'module:name' or 'file.py:name'"),
    ("grpoo", "algorithm 'grpoo' is not an algorithm; did you mean 'grpo'?"),
])
def test_a_bad_algorithm_spec_is_one_message_naming_it(capsys, user_algorithm, spec, message):
    for command in ("trace", "plan"):
        code, out, err = run(capsys, command, spec)
        assert code == 1 and out == "" and err.startswith(f"rlgraph {command}: {message}") and "fix: " in err, err


@pytest.mark.parametrize("argv", [["bench", "--config", "small", "--no-trl"], ["bench", "--", "--config", "small", "--no-trl"]])
def test_bench_takes_its_flags_with_or_without_the_separator(monkeypatch, argv):
    import rlgraph.bench

    seen = []
    monkeypatch.setattr(rlgraph.bench, "main", lambda args: seen.append(args) or 0)
    assert main(argv) == 0 and seen == [["--config", "small", "--no-trl"]]


def test_bench_help_is_the_benchmarks_own(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert exit.value.code == 0 and "usage: rlgraph bench" in out and "--config {large,small}" in out


def test_another_command_still_refuses_an_unknown_flag(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["trace", "grpo", "--config", "small"])
    assert exit.value.code == 2 and "unrecognized arguments: --config small" in capsys.readouterr().err


def test_train_runtime_flags_are_the_overrides_they_stand_for(tmp_path, capsys):
    from tests.train.test_run import make_config

    _, path = make_config(tmp_path, "flags")
    code, out, err = run(capsys, "train", str(path), "--dry-run", "--runtime", "spmd", "--nproc", "2", "--device", "cpu")
    assert code == 0 and "train: fsdp2 shard=2" in out, err
    code, out, _ = run(capsys, "train", str(path), "--dry-run", "-o", "runtime.nproc=2", "--nproc", "2",
                       "--runtime", "spmd")
    assert code == 0 and "train: fsdp2 shard=2" in out  # the same value twice is no conflict
    code, out, err = run(capsys, "train", str(path), "--dry-run", "-o", "runtime.nproc=3", "--nproc", "2")
    assert code == 1 and out == "" and "rlgraph train: --nproc 2 and -o runtime.nproc=3 disagree" in err
    assert "fix: give one of them: --nproc is short for -o runtime.nproc=..." in err
    assert not (tmp_path / "flags").exists()


@pytest.mark.parametrize("flags", [["--nproc", "0"], ["--nproc", "two"], ["--runtime", "mpi"], ["--device", "gpu"]])
def test_train_runtime_flags_refuse_bad_values_naming_the_flag(flags, capsys):
    with pytest.raises(SystemExit):
        main(["train", "config.yaml", *flags])
    assert "error: argument " + flags[0] in capsys.readouterr().err


def test_dry_run_never_wraps_plan_lines_when_not_on_a_terminal(tmp_path, capsys):
    from tests.train.test_run import make_config
    from rlgraph.train.setup import prepare

    config, path = make_config(tmp_path, "wide")
    plan_lines = prepare(config).rl.as_text().splitlines()
    assert max(map(len, plan_lines)) > 100  # else this test would not see a wrap
    code, out, _ = run(capsys, "train", str(path), "--dry-run")
    assert code == 0 and set(plan_lines) <= set(out.splitlines())


def test_plan_env_workers_say_where_env_steps_run_and_bad_values_name_the_flag(capsys):
    code, out, _ = run(capsys, "plan", "agent_grpo", "--mesh", "cpu:1", "--sizes", "B=2,P=8,T=16", "--env-workers", "3")
    assert code == 0 and "per row in 3 env worker processes per generating rank (4096 MiB each" in out
    for bad in ("0", "two", "-1"):
        code, out, err = run(capsys, "plan", "agent_grpo", "--env-workers", bad)
        assert code == 1 and out == "" and f"--env-workers {bad}: not a whole number >= 1" in err
        assert "fix: --env-workers 2" in err


def test_plan_micro_batch_tokens_prints_packed_micro_batches_and_bad_values_name_the_flag(capsys):
    code, out, _ = run(capsys, "plan", "grpo", "--mesh", "cpu:1", "--sizes", "B=4,P=8,T=4", "-p", "n=4",
                       "--micro-batch-tokens", "24")
    assert code == 0 and "packed micro-batches of <= 24 tokens/rank, no padding" in out
    for bad in ("0", "-5", "x", "2.5"):
        code, out, err = run(capsys, "plan", "grpo", "--micro-batch-tokens", bad)
        assert code == 1 and out == "" and f"--micro-batch-tokens {bad}: not a whole number of tokens >= 1" in err
    code, out, err = run(capsys, "plan", "grpo", "--sizes", "B=4,P=8,T=4", "--micro-batch-tokens", "11")
    assert code == 1 and "--micro-batch-tokens 11 is smaller than the longest row" in err
    assert "fix: --micro-batch-tokens 12" in err and "Traceback" not in err


def test_plan_staleness_prints_the_two_lanes_and_bad_values_name_the_flag(capsys):
    code, out, _ = run(capsys, "plan", "grpo", "--mesh", "cpu:2", "--placement", "split:policy=1,rollout=1",
                       "--sizes", "B=4,P=8,T=4", "--staleness", "1")
    assert code == 0 and "async: staleness 1 (wait:" in out and "rollout lane (batch i+1) on rollout rank 1" in out
    assert "estimated step time overlapped:" in out
    for bad in ("-1", "x", "1.5"):
        code, out, err = run(capsys, "plan", "grpo", "--staleness", bad)
        assert code == 1 and out == "" and f"--staleness {bad}: not a whole number >= 0" in err and "fix: --staleness 1" in err
    code, _, err = run(capsys, "plan", "sft", "--staleness", "1")
    assert code == 1 and "staleness=1: algorithm 'sft' generates nothing" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, expected", [
    (["trace", "grpo", "-p", "clip=-1"], "rlgraph trace: -p clip=-1: grpo: clip=-1 is not valid"),
    (["plan", "ppo", "-p", "lam=1.5"], "rlgraph plan: -p lam=1.5: ppo: lam=1.5 is not valid"),
    (["trace", "rloo", "-p", "n=1"], "rlgraph trace: -p n=1: rloo: n=1 samples per prompt"),
])
def test_a_bad_hyper_parameter_names_its_p_flag(capsys, argv, expected):
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(expected) and "fix: -p " in err and "rlgraph/algorithms/" not in err


def test_the_help_summary_lists_every_command(capsys):
    """The summary above the subcommand list shows a line for each command the parser takes."""
    from rlgraph.cli import _parser

    summary = _parser().description
    commands = next(action for action in _parser()._actions if action.dest == "command").choices
    assert [name for name in commands if f"    rlgraph {name} " not in summary] == []


def test_plan_a_vision_language_model_counts_its_tower_and_image_tokens(capsys):
    code, out, _ = run(capsys, "plan", "grpo", "--model", "qwen2.5-vl-7b", "--mesh", "1x8:h100", "--placement", "auto")
    assert code == 0
    assert ("vision policy: tower 676,550,144 params (frozen); pixel budget 1,003,520 px an image -> <= 1280 image "
            "tokens; 1 image(s) a prompt = 1280 tokens counted in every sequence beside P") in out
    for bad in ("0", "-3", "many"):
        code, _, err = run(capsys, "plan", "grpo", "--model", "qwen2.5-vl-7b", "--pixel-budget", bad)
        assert code == 1 and f"--pixel-budget {bad}: not a whole number >= 1" in err

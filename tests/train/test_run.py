"""`rlgraph train` end to end on the tiny model: the run directory, exact resume (also after a
kill), refused checkpoints, export to a Hugging Face directory, LoRA runs."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from rlgraph.backends.local.state import CheckpointMismatch
from rlgraph.errors import ConfigError, RLGraphError
from rlgraph.train.checkpoint import file_sha256, latest_checkpoint
from rlgraph.train.config import load_config
from rlgraph.train.run import load_run_config, train
from tests.helpers import assert_rows_close, assert_same_training, checkpoint_worker

ROOT = Path(__file__).resolve().parents[2]
# Metrics that depend on the clock, not on the computation.
CLOCK = ("time/", "samples_per_s", "tokens_per_s")


def write_data(tmp_path: Path) -> Path:
    rows = [{"question": f"{a}+{b}=", "answer": str(a + b)} for a in range(8) for b in range(8)]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def config_text(tmp_path: Path, run_dir: Path, **sections) -> str:
    config = {
        "name": "t", "run_dir": str(run_dir),
        "data": {"train": str(write_data(tmp_path)), "eval_fraction": 0.125, "prompt_field": "question",
                 "chat_template": False},
        "rewards": [{"name": "math"}],
        "algorithm": {"name": "grpo", "hparams": {"kl": 0.04}},
        "rollout": {"prompts_per_step": 4, "n": 4, "max_new_tokens": 4},
        "optimizer": {"lr": 1e-3},
        "warm_start": {"steps": 3, "batch_size": 16, "lr": 2e-3},
        "train": {"steps": 4, "seed": 0},
        "runtime": {"threads": 1},
        "eval": {"every": 2},
        "checkpoint": {"every": 1, "keep_last": 2},
        "logging": {"tensorboard": False, "progress": False, "plots": False},
    }
    for section, values in sections.items():
        config[section] = {**config.get(section, {}), **values} if isinstance(values, dict) else values
    return yaml.safe_dump(config)


def make_config(tmp_path: Path, name: str, overrides=(), **sections):
    path = tmp_path / f"{name}.yaml"
    path.write_text(config_text(tmp_path, tmp_path / name, **sections))
    return load_config(path, list(overrides)), path


def metrics_of(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in row.items() if k != "time" and not k.startswith(CLOCK)} for row in rows]


def policy_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from rlgraph.train.checkpoint import read_checkpoint

    return dict(read_checkpoint(latest_checkpoint(run_dir))[0].roles["policy"].model)  # whole, or its ranks' parts


def assert_same_run(a: Path, b: Path) -> None:
    assert metrics_of(a) == metrics_of(b)
    wa, wb = policy_weights(a), policy_weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


def copy_run(run_dir: Path, tmp_path: Path) -> Path:
    """A copy of a finished run to damage or resume differently."""
    return Path(shutil.copytree(run_dir, tmp_path / "copy"))


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("full")
    config, path = make_config(tmp_path, "full")
    result = train(config)
    return tmp_path / "full", result, path


def test_run_directory_holds_everything_a_person_looks_at(full_run):
    run_dir, result, _ = full_run
    assert result.steps == 4
    for name in ("config.yaml", "plan.txt", "metrics.jsonl", "summary.json", "latest"):
        assert (run_dir / name).is_file(), name
    assert sorted(p.name for p in run_dir.glob("step-*")) == ["step-000003", "step-000004"]  # keep_last=2
    assert "plan grpo" in (run_dir / "plan.txt").read_text()
    rows = metrics_of(run_dir)
    steps = [row for row in rows if "reward" in row]
    assert [row["step"] for row in steps] == [1, 2, 3, 4]
    for key in ("reward", "accuracy", "reward/math", "lr", "policy/loss"):
        assert all(key in row for row in steps), key
    evals = [row["step"] for row in rows if "eval/accuracy" in row]
    assert evals == [0, 2, 4]
    assert load_run_config(run_dir) == load_config(None, base=yaml.safe_load((run_dir / "config.yaml").read_text()))


def test_the_saved_config_is_resolved_and_reruns_the_same_run(full_run, tmp_path):
    import inspect

    from rlgraph.algorithms import ALGORITHMS
    from rlgraph.train.user_code import ROLLOUT_HPARAMS

    run_dir, _, _ = full_run
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    defaults = {p.name: p.default for p in inspect.signature(ALGORITHMS["grpo"].fn).parameters.values()
                if p.kind is p.KEYWORD_ONLY and p.name not in ROLLOUT_HPARAMS}  # the rollout section holds those
    assert saved["algorithm"]["hparams"] == {**defaults, "kl": 0.04}  # every default written, the config's kl over it
    assert saved["algorithm"]["hparams"]["clip"] == 0.2 and "n" not in saved["algorithm"]["hparams"]
    rerun = load_config(run_dir / "config.yaml", [f"run_dir={tmp_path / 'rerun'}"])
    train(rerun)
    assert_same_run(run_dir, tmp_path / "rerun")
    assert yaml.safe_load((tmp_path / "rerun" / "config.yaml").read_text())["algorithm"] == saved["algorithm"]


def test_a_run_stepped_by_hand_is_the_run_train_makes(full_run, tmp_path):
    """`train()` is a `Run` stepped to train.steps: stepping one by hand (as the bench does) and
    finishing it gives the same metrics, evaluations, checkpoints and weights, bit for bit."""
    from rlgraph.train.run import Run

    run_dir, result, path = full_run
    config = load_config(path, [f"run_dir={tmp_path / 'stepped'}"])
    with Run(config) as run:
        assert run.steps == 0 and (tmp_path / "stepped" / "plan.txt").is_file()
        rewards = [run.step()["reward"] for _ in range(config.train.steps)]
        assert run.steps == 4 and all(0.0 <= reward <= 1.0 for reward in rewards)
        stepped = run.finish()
    assert (stepped.steps, stepped.eval_before, stepped.eval_after) == \
        (result.steps, result.eval_before, result.eval_after)
    assert_same_run(run_dir, tmp_path / "stepped")
    assert sorted(p.name for p in (tmp_path / "stepped").glob("step-*")) == ["step-000003", "step-000004"]


def test_a_run_left_without_finish_writes_no_summary_and_closes_once(tmp_path):
    from rlgraph.train.run import Run

    config, _ = make_config(tmp_path, "left", warm_start={"steps": 0})
    with Run(config) as run:
        run.step()
    run.close()  # a second close is a no-op
    assert not (tmp_path / "left" / "summary.json").exists()
    rows = metrics_of(tmp_path / "left")
    assert [row["step"] for row in rows] == [0, 1]  # the first evaluation and the one step


def test_a_checkpoint_fingerprinted_before_hparams_were_resolved_still_resumes(tmp_path, monkeypatch):
    import rlgraph.train.checkpoint as checkpoint
    from rlgraph.train.run import _refuse_other_run
    from rlgraph.train.session import fingerprint

    config, _ = make_config(tmp_path, "old")
    old = {**fingerprint(config), "hparams": json.dumps({"kl": 0.04})}  # as runs wrote it: the config's hparams only
    monkeypatch.setattr(checkpoint, "read_extra", lambda path: {"user": {"fingerprint": old}})
    _refuse_other_run(config, tmp_path)  # the same run: accepted
    with pytest.raises(CheckpointMismatch, match="hparams: checkpoint"):
        _refuse_other_run(load_config(None, ["algorithm.hparams={kl: 0.04, clip: 0.3}"], base=config.model_dump()),
                          tmp_path)


def test_resume_continues_exactly(full_run, tmp_path):
    run_dir, _, _ = full_run
    config, _ = make_config(tmp_path, "half", ["train.steps=2"])
    train(config)
    resumed = load_run_config(tmp_path / "half", ["train.steps=4"])
    assert train(resumed, resume=True).steps == 4
    assert_same_run(run_dir, tmp_path / "half")


def test_a_resumed_run_reports_the_runs_first_evaluation_as_before(tmp_path):
    # accuracy = "a digit somewhere": 0.0 at step 0 and 1.0 at step 2 on the tiny model (saturated
    # values, not a borderline float), so a resume at step 2 that took its first evaluation after
    # resuming as "before" would report 1.0; what the run must report holds whatever the values
    reward = ['rewards=[{name: format_regex, options: {pattern: "\\\\d"}}, {name: math}]']
    whole, _ = make_config(tmp_path, "whole", reward)
    expected = train(whole)
    half, _ = make_config(tmp_path, "half", [*reward, "train.steps=2"])
    train(half)
    result = train(load_run_config(tmp_path / "half", ["train.steps=4"]), resume=True)
    evals = {row["step"]: row["eval/accuracy"] for row in metrics_of(tmp_path / "half") if "eval/accuracy" in row}
    assert (result.eval_before, result.eval_after) == (expected.eval_before, expected.eval_after) == (evals[0], evals[4])
    summary = json.loads((tmp_path / "half" / "summary.json").read_text())
    assert (summary["eval_before"], summary["eval_after"]) == (evals[0], evals[4])


def test_a_checkpoint_without_the_first_evaluation_takes_it_from_metrics_jsonl(full_run, tmp_path):
    from types import SimpleNamespace

    from rlgraph.train.session import _Session

    run_dir, result, _ = full_run
    session = SimpleNamespace(first_eval=None)
    _Session.keep_first_eval(session, {}, run_dir)  # a checkpoint written before eval_before was kept
    assert session.first_eval == result.eval_before == metrics_of(run_dir)[0]["eval/accuracy"]
    _Session.keep_first_eval(session, {"eval_before": 0.25}, run_dir)  # the checkpoint's own figure wins
    assert session.first_eval == 0.25
    _Session.keep_first_eval(session, {}, tmp_path)  # no metrics either: no "before"
    assert session.first_eval is None


def kill_after_checkpoint_and_resume(path: Path, target: Path, kill_after: int) -> None:
    """Run `rlgraph train path`, SIGKILL it once a checkpoint of step >= `kill_after` is in
    `target`, then `rlgraph train --resume target` to the end."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-m", "rlgraph", "train", str(path)], cwd=ROOT, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and process.poll() is None:
        latest = latest_checkpoint(target) if (target / "latest").exists() else None
        if latest is not None and int(latest.name.split("-")[1]) >= kill_after:
            os.killpg(process.pid, signal.SIGKILL)
            break
        time.sleep(0.05)
    process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL, process.stderr.read().decode()[-2000:]
    done = subprocess.run([sys.executable, "-m", "rlgraph", "train", "--resume", str(target)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.slow
def test_kill_at_a_random_step_and_resume_gives_the_same_run(full_run, tmp_path):
    run_dir, _, _ = full_run
    _, path = make_config(tmp_path, "killed")
    kill_after_checkpoint_and_resume(path, tmp_path / "killed", int(torch.randint(1, 4, (1,))))  # a random step of 1..3
    assert_same_run(run_dir, tmp_path / "killed")


def test_a_truncated_checkpoint_is_refused(full_run, tmp_path):
    run_dir, _, _ = full_run
    copy = copy_run(run_dir, tmp_path)
    weights = latest_checkpoint(copy) / "policy.safetensors"
    weights.write_bytes(weights.read_bytes()[: 100])
    config = load_run_config(copy, ["train.steps=5"])
    with pytest.raises(ConfigError, match=r"step-000004 is damaged: .*policy\.safetensors is damaged"):
        train(config, resume=True)


def test_a_checkpoint_of_another_run_is_refused(full_run, tmp_path):
    run_dir, _, _ = full_run
    copy = copy_run(run_dir, tmp_path)
    other = load_run_config(copy, ["train.steps=5", "algorithm.name=rloo"])
    with pytest.raises(CheckpointMismatch, match="algorithm: checkpoint 'grpo', this run 'rloo'"):
        train(other, resume=True)


def test_a_checkpoint_of_another_model_shape_is_refused(full_run, tmp_path):
    run_dir, _, _ = full_run
    copy = copy_run(run_dir, tmp_path)
    model_dir = tmp_path / "wide"
    model_dir.mkdir()
    tiny = json.loads((ROOT / "rlgraph/assets/tiny_qwen2.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**tiny, "hidden_size": 32, "intermediate_size": 64}))
    config = load_run_config(copy, ["train.steps=5", f"model.path={model_dir}"])
    with pytest.raises(CheckpointMismatch, match="model"):
        train(config, resume=True)


def test_starting_over_an_existing_run_or_resuming_nothing_is_refused(full_run, tmp_path):
    run_dir, _, path = full_run
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        train(load_config(path))
    config, _ = make_config(tmp_path, "never")
    with pytest.raises(ConfigError, match="no checkpoint there"):
        train(config, resume=True)


def test_export_loads_in_transformers_and_generates(full_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlgraph.train.export import export_run

    run_dir, _, _ = full_run
    out = export_run(run_dir, tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    trained = policy_weights(run_dir)
    for name, value in model.state_dict().items():
        if name in trained:
            assert torch.equal(value, trained[name]), name
    ids = tokenizer(["3+4="], return_tensors="pt")
    generated = model.generate(**ids, max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert generated.shape[1] > ids["input_ids"].shape[1]
    with pytest.raises(ConfigError, match="already exists"):
        export_run(run_dir, out)
    with pytest.raises(ConfigError, match="not a run directory"):
        export_run(tmp_path, tmp_path / "other")


def test_lora_run_trains_only_adapters_and_its_reference_is_the_base(tmp_path):
    config, _ = make_config(tmp_path, "lora", ["model.lora={r: 4, target_modules: [q_proj, v_proj]}", "train.steps=2",
                                               "warm_start.steps=0", "eval.every=0"])
    train(config)
    weights = policy_weights(tmp_path / "lora")
    assert weights and all("lora_" in name for name in weights)  # only adapters are checkpointed
    assert not (latest_checkpoint(tmp_path / "lora") / "ref.safetensors").exists() or \
        not load_file(str(latest_checkpoint(tmp_path / "lora") / "ref.safetensors"))
    from rlgraph.train.export import export_run
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(export_run(tmp_path / "lora", tmp_path / "hf")), local_files_only=True)
    assert not any("lora" in name for name in model.state_dict())


def test_dry_run_prints_the_plan_and_memory_and_builds_nothing(tmp_path, capsys):
    from rlgraph.cli import main

    _, path = make_config(tmp_path, "dry")
    assert main(["train", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "plan grpo" in out and "memory per rank" in out
    assert not (tmp_path / "dry").exists()


@pytest.mark.slow
def test_spmd_run_resumes_on_the_local_runtime(tmp_path):
    """The same config on 2 worker processes (FSDP2 policy), then resumed in one process: a
    checkpoint is runtime-independent; evaluation pulls the trained policy from the workers."""
    config, _ = make_config(tmp_path, "spmd", ["train.steps=2", "runtime.runtime=spmd", "runtime.nproc=2",
                                               "checkpoint.every=2"])
    result = train(config)
    assert result.steps == 2 and result.eval_after is not None
    resumed = load_run_config(tmp_path / "spmd", ["train.steps=3", "runtime.runtime=local"])
    assert train(resumed, resume=True).steps == 3
    assert [row["step"] for row in metrics_of(tmp_path / "spmd") if "reward" in row] == [1, 2, 3]


@pytest.mark.slow  # Inductor compiles of the tiny model's prefill and decode chunk (~1 min cold)
def test_a_run_with_compiled_decoding_compiles_once_and_reports_the_compile_apart(tmp_path, monkeypatch):
    import io

    from rich.console import Console

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    config, _ = make_config(tmp_path, "compiled", ["generation.compile=on", "data.eval_fraction=0",
                                                   "warm_start.steps=0",
                                                   "rollout.max_new_tokens=2"])  # a chunk of 2: the least to compile
    out = Console(file=io.StringIO(), width=300)
    train(config, console=out)
    assert "generation.compile=on: decode compiled: generation.compile=on" in out.file.getvalue()
    rows = [json.loads(line) for line in (tmp_path / "compiled" / "metrics.jsonl").read_text().splitlines()]
    compiles = [row["time/compile_s"] for row in rows if "reward" in row]
    assert len(compiles) == 4 and compiles[0] > 0 and compiles[1:] == [0.0, 0.0, 0.0]  # one shape: the first step
    first = next(row for row in rows if "reward" in row)
    assert first["samples_per_s"] == pytest.approx(16 / (first["time/step_s"] - first["time/compile_s"]))
    assert first["time/step_s"] > first["time/compile_s"]


@pytest.mark.parametrize("overrides, expected", [
    (["generation.compile=on", "runtime.engine=vllm"], r"generation.compile=on with runtime.engine='vllm'"),
    (["runtime.engine=vllm", "runtime.runtime=ray", "runtime.nproc=2", "runtime.device=cpu"],
     r"runtime.engine=vllm with runtime.runtime=ray on CPU is not tested"),
    # vLLM's engine joins the whole torch.distributed world while it starts: a rank without one would hang it
    (["runtime.engine=vllm", "runtime.runtime=spmd", "runtime.nproc=2", "runtime.device=cpu",
      "runtime.placement=split:policy=1,rollout=1,ref=policy"],
     r"(?s)runtime.placement 'split:policy=1,rollout=1,ref=policy' with runtime.engine=vllm: the plan generates with "
     r"vLLM on ranks \[1\] of \[0, 1\], but ranks \[0\] build no vLLM engine.*fix: runtime.placement: colocated"),
    (["runtime.engine=vllm", "model.lora.r=4", "warm_start.steps=5"],
     r"runtime.engine=vllm with model.lora and a warm start: the warm start's adapters are merged into the base"),
])
def test_generation_where_its_engine_cannot_run_is_refused_before_anything_starts(tmp_path, overrides, expected):
    from rlgraph.train.setup import prepare

    config, _ = make_config(tmp_path, "bad", overrides)
    with pytest.raises(ConfigError, match=expected):
        prepare(config)


@pytest.mark.parametrize("placement, expected", [
    ("colocatd", "did you mean 'colocated'"),
    ("colocated:fsdpp=2", "unknown option 'fsdpp'"),
    ("split:policy=x", "group .policy. shares .x., which has no ranks"),
])
def test_a_bad_placement_names_the_key(tmp_path, placement, expected):
    from rlgraph.train.setup import prepare

    # on spmd: the local runtime refuses every split first (tests/train/test_composition.py)
    config, _ = make_config(tmp_path, "bad", [f"runtime.placement={placement}", "runtime.runtime=spmd", "runtime.nproc=2"])
    with pytest.raises(RLGraphError, match=expected):
        prepare(config)


@pytest.mark.parametrize("override, expected", [
    ("model.path=/nonexistent/model", r"model.path '/nonexistent/model' does not exist"),
    ("model.path={tmp}", r"model.path '.*' is a directory without a config.json"),
    ("model.path=Qwen/Qwen2.5-0.5B", r"model.path 'Qwen/Qwen2.5-0.5B' does not exist; it looks like a Hugging Face Hub id, "
                                     r"and rlgraph does not download models\n  fix: download it first \(huggingface-cli"),
    ("rewards=[{name: math}, {name: format_regex, options: {pattern: '(a'}}]",
     r"rewards\[1\] \(format_regex\): format_regex: pattern '\(a' is not a valid regular expression"),
    ("rewards=[{name: exact_mach}]", r"rewards\[0\] \(exact_mach\): unknown reward 'exact_mach'; did you mean 'exact_match'"),
    ("rewards=[{name: no_such_module:fn}]", r"rewards\[0\] \(no_such_module:fn\): 'no_such_module:fn': cannot import"),
])
def test_bad_model_and_reward_entries_name_the_key(tmp_path, override, expected):
    from rlgraph.train.setup import prepare

    config, _ = make_config(tmp_path, "bad", [override.replace("{tmp}", str(tmp_path))])
    with pytest.raises(ConfigError, match=expected):
        prepare(config)


@pytest.mark.parametrize("overrides, sections, expected", [
    (["algorithm.hparams.kl=-0.5"], {}, r"algorithm.hparams.kl \(-o algorithm.hparams.kl=-0.5\): grpo: kl=-0.5 is not valid"
                                        r"(.|\n)*fix: set algorithm.hparams.kl= a finite number >= 0"),
    ([], {"algorithm": {"name": "grpo", "hparams": {"clip": -1}}},
     r"algorithm.hparams.clip \(.*bad_hparam.yaml:\d+\): grpo: clip=-1 is not valid"),
    (["rollout.n=1"], {}, r"rollout.n \(-o rollout.n=1\): grpo: n=1 samples per prompt"),
])
def test_a_bad_hyper_parameter_names_its_config_line_or_flag_before_the_data_loads(tmp_path, overrides, sections, expected):
    from rlgraph.train.setup import prepare

    # the data file is missing too: the hyper-parameter is found first
    config, _ = make_config(tmp_path, "bad_hparam", [*overrides, f"data.train={tmp_path / 'missing.jsonl'}"], **sections)
    with pytest.raises(ConfigError, match=expected):
        prepare(config)


def test_a_tokenizer_without_eos_is_refused_naming_the_key_before_the_data_loads(tmp_path):
    from rlgraph.backends.local.generation import TokenizerError
    from rlgraph.backends.local.models import load_tokenizer
    from rlgraph.train.setup import prepare

    tokenizer = load_tokenizer()
    tokenizer.eos_token = None
    tokenizer.save_pretrained(tmp_path / "no_eos")
    config, _ = make_config(tmp_path, "no_eos_run", [f"model.tokenizer={tmp_path / 'no_eos'}",
                                                      f"data.train={tmp_path / 'missing.jsonl'}"])
    # the tokenizer is refused first: the missing data file would be the next error
    with pytest.raises(TokenizerError, match=r"the tokenizer of model.tokenizer '.*no_eos': eos_token_id is None; "
                                             r"generation needs one\n  fix: tokenizer.eos_token = "):
        prepare(config)


REWARDS_PY = """
def score(completions, **_):
    return [1.0] * len(completions)

def needs_level(completions, answer, level, **_):
    return [float(a == str(l)) for a, l in zip(answer, level)]

def narrow(completions, answer):
    return [1.0] * len(completions)
"""


@pytest.mark.parametrize("overrides, expected", [
    # the missing file is the first error, not the accuracy_reward that names it
    (["rewards=[{name: '{tmp}/missing.py:fn'}]", "eval.accuracy_reward=fn"],
     r"rewards\[0\] \({tmp}/missing.py:fn\): .*cannot import {tmp}/missing.py: no file '{tmp}/missing.py'"),
    (["rewards=[{name: '{tmp}/rw.py:scroe'}]"], r"rewards\[0\] .*rw.py has no 'scroe'; did you mean 'score'"),
    (["rewards=[{name: '{tmp}/rws.py:score'}]"], r"no file '{tmp}/rws.py'; did you mean '{tmp}/rw.py'"),
    (["rewards=[{name: 'rlgraph.rewards.verifiabel:exact_match'}]"],
     r"No module named 'rlgraph.rewards.verifiabel'; did you mean 'rlgraph.rewards.verifiable'"),
    (["rewards=[{name: 'rlgraph.rewards.verifiable:exact_mach'}]"],
     r"rlgraph.rewards.verifiable has no 'exact_mach'; did you mean 'exact_match'"),
    (["rewards=[{name: '{tmp}/rw.py:needs_level'}]"],
     r"rewards\[0\] \({tmp}/rw.py:needs_level\) reads the per-row field\(s\) level, which the data does not pass"
     r"(.|\n)*fix: add them to data.extra_fields .*extra_fields: \[level\]"),
    (["rewards=[{name: '{tmp}/rw.py:narrow'}]"],
     r"rewards\[0\] .* does not take the per-row field\(s\) text(.|\n)*fix: add \*\*_"),
    (["rewards=[{name: math}, {name: '{tmp}/rw.py:score'}]", "eval.accuracy_reward=score"],
     r"eval.accuracy_reward 'score' is not one of the rewards .*; did you mean '{tmp}/rw.py:score'"),
    (["eval.accuracy_reward=maht"],
     r"eval.accuracy_reward 'maht' is not one of the rewards \(math\); did you mean 'math'"),
])
def test_reward_files_functions_and_fields_are_checked_before_step_one(tmp_path, overrides, expected):
    from rlgraph.train.setup import prepare

    (tmp_path / "rw.py").write_text(REWARDS_PY)
    config, _ = make_config(tmp_path, "bad", [o.replace("{tmp}", str(tmp_path)) for o in overrides])
    with pytest.raises(ConfigError, match=expected.replace("{tmp}", str(tmp_path))):
        prepare(config)


def test_dry_run_catches_a_reward_field_the_data_does_not_pass_and_extra_fields_fixes_it(tmp_path, capsys):
    from rlgraph.cli import main

    (tmp_path / "rw.py").write_text(REWARDS_PY)
    rows = [{"question": f"{a}+{b}=", "answer": str(a + b), "level": str(a + b)} for a in range(8) for b in range(8)]
    _, path = make_config(tmp_path, "dry")
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    reward = ["-o", f"rewards=[{{name: '{tmp_path}/rw.py:needs_level'}}]"]
    assert main(["train", str(path), "--dry-run", *reward]) != 0
    assert "reads the per-row field(s) level" in capsys.readouterr().err
    assert main(["train", str(path), "--dry-run", *reward, "-o", "data.extra_fields=[level]"]) == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_cuda_without_a_gpu_names_runtime_device(tmp_path):
    from rlgraph.train.setup import prepare

    config, _ = make_config(tmp_path, "bad", ["runtime.device=cuda"])
    with pytest.raises(ConfigError, match=r"runtime.device 'cuda': .*no CUDA GPU(.|\n)*fix: set runtime.device: cpu"):
        prepare(config)


def train_rows(run_dir: Path) -> list[dict]:
    """The training steps' metrics (evaluations left out)."""
    return [{k: v for k, v in row.items() if not k.startswith("eval/")} for row in metrics_of(run_dir) if "reward" in row]


def train_local_and_spmd(tmp_path: Path, overrides: list[str]) -> tuple[list[dict], list[dict]]:
    """The training rows of the same config run on the local runtime and on 2 spmd ranks."""
    for name, extra in (("local", []), ("spmd", ["runtime.runtime=spmd", "runtime.nproc=2"])):
        config, _ = make_config(tmp_path, name, [*overrides, *extra])
        train(config)
    return train_rows(tmp_path / "local"), train_rows(tmp_path / "spmd")


def test_evaluating_more_often_does_not_change_the_training_samples(full_run, tmp_path):
    run_dir, _, _ = full_run  # eval.every=2
    config, _ = make_config(tmp_path, "often", ["eval.every=1"])
    train(config)
    assert train_rows(tmp_path / "often") == train_rows(run_dir)


@pytest.mark.slow
def test_a_spmd_run_matches_the_local_run_and_its_controller_builds_no_model(full_run, tmp_path, monkeypatch):
    """The workers warm-start, train and evaluate (compiled plans); the controller registers not one
    parameter (no model, no value head), and the run's metrics, evaluations and weights are the local run's."""
    run_dir, _, _ = full_run
    registered = []
    register = torch.nn.Module.register_parameter
    monkeypatch.setattr(torch.nn.Module, "register_parameter",
                        lambda module, name, param: (registered.append(type(module).__name__), register(module, name, param)))
    config, _ = make_config(tmp_path, "spmd", ["runtime.runtime=spmd", "runtime.nproc=2"])
    train(config)
    assert registered == []  # the spawned workers build the models; this process built none
    assert_rows_close(train_rows(tmp_path / "spmd"), train_rows(run_dir))
    evaluations = [[row.get(key) for key in ("step", "eval/accuracy", "eval/response_length")] for row in metrics_of(run_dir)]
    assert [[row.get(key) for key in ("step", "eval/accuracy", "eval/response_length")]
            for row in metrics_of(tmp_path / "spmd")] == evaluations  # greedy decoding of the same weights
    # 3 AdamW warm-start steps (lr 2e-3) and 4 RL steps (lr 1e-3) on each runtime: an element whose
    # gradient is at rounding level may take a step of up to ~lr of either sign on one and not the other
    # (helpers.assert_same_training), so two runs differ by at most 2 * sum(lr) = 0.02 per element.
    local, spmd = policy_weights(run_dir), policy_weights(tmp_path / "spmd")
    assert local.keys() == spmd.keys()
    for name in local:
        torch.testing.assert_close(spmd[name], local[name], rtol=0, atol=2 * (3 * 2e-3 + 4 * 1e-3))
    assert not (tmp_path / "spmd" / "start_weights").exists()  # the warm-started policy's file is gone
    # Stage times are the ranks' own (commands are pipelined: the controller's clock sees only its waits)
    steps = [json.loads(line) for line in (tmp_path / "spmd" / "metrics.jsonl").read_text().splitlines()]
    for row in (row for row in steps if "reward" in row):
        assert row["time/sync_weights_s"] > 0 and row["time/train_s"] > 0 and row["time/generate_s"] > 0, row
        assert row["time/train_s"] < row["time/step_s"]


@pytest.mark.slow
def test_a_ray_run_warm_starts_trains_and_evaluates_on_its_actors_like_the_local_run(full_run, tmp_path):
    """The same recipe on Ray actors: the warm start's actors write the warm-started policy, the RL
    actors read it; the first two steps' metrics are the local run's (whose steps 1-2 do not depend on
    its length: a constant learning rate)."""
    pytest.importorskip("ray")
    run_dir, _, _ = full_run
    config, _ = make_config(tmp_path, "ray", ["runtime.runtime=ray", "runtime.nproc=2", "train.steps=2"])
    train(config)
    assert_rows_close(train_rows(tmp_path / "ray"), train_rows(run_dir)[:2])
    assert not (tmp_path / "ray" / "start_weights").exists()


def test_export_picks_a_checkpoint_by_step_and_never_replaces_the_run(full_run, tmp_path):
    from rlgraph.train.export import export_run

    run_dir, _, _ = full_run  # checkpoints step-000003 and step-000004 (keep_last=2)
    out = export_run(run_dir, tmp_path / "at3", checkpoint="3")
    assert load_file(str(out / "model.safetensors")).keys()
    with pytest.raises(ConfigError, match=r"--checkpoint '1': no such checkpoint(.|\n)*one of step-000003, step-000004"):
        export_run(run_dir, tmp_path / "at1", checkpoint="1")
    for target in (run_dir, run_dir.parent):
        with pytest.raises(ConfigError, match="would replace the run"):
            export_run(run_dir, target, overwrite=True)
    assert (run_dir / "config.yaml").is_file()
    assert export_run(run_dir, out, overwrite=True) == out  # an earlier export is replaced
    mine = tmp_path / "my-models"  # not an export: --overwrite does not delete it
    mine.mkdir()
    (mine / "weights.bin").write_bytes(b"mine")
    with pytest.raises(ConfigError, match="is not an export rlgraph wrote"):
        export_run(run_dir, mine, overwrite=True)
    assert (mine / "weights.bin").read_bytes() == b"mine"


@pytest.mark.slow
def test_the_learning_rate_schedule_reaches_the_spmd_workers(tmp_path):
    """Warmup then linear decay: the workers' optimizers step with the controller's schedule."""
    schedule = ["optimizer.warmup_steps=2", "optimizer.schedule=linear", "train.steps=4", "eval.every=0"]
    rows_local, rows_spmd = train_local_and_spmd(tmp_path, schedule)
    assert [row["lr"] for row in rows_local] == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3, 0.5e-3])
    assert_rows_close(rows_spmd, rows_local, ("reward", "policy/loss", "policy/grad_norm", "policy/kl"))
    # 4 AdamW steps at most at optimizer.lr (1e-3), from the same weights: the warm start runs in-process on both
    assert_same_training(checkpoint_worker(tmp_path / "local", lr=1e-3), policy_weights(tmp_path / "spmd"), None, steps=4)


def test_a_resume_over_other_prompts_is_refused(full_run, tmp_path):
    run_dir, _, _ = full_run
    copy = copy_run(run_dir, tmp_path)
    rows = [{"question": f"{a}+{b}=", "answer": str(a + b + (a == 7))} for a in range(8) for b in range(8)]  # 8 answers differ
    changed = tmp_path / "changed.jsonl"
    changed.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = load_run_config(copy, ["train.steps=5", f"data.train={changed}"])
    with pytest.raises(CheckpointMismatch, match=r"other training prompts: 56 usable prompts .* now gives 56"):
        train(config, resume=True)


def test_every_file_of_the_run_directory_takes_the_umask(full_run):
    """Checkpoints were 0700/0600 (mkdtemp, mkstemp, safetensors) beside a 0644 config: one rule now."""
    import stat

    from rlgraph.train.modes import current_umask

    run_dir, _, _ = full_run
    mask = current_umask()
    modes = {str(path.relative_to(run_dir)): stat.S_IMODE(path.stat().st_mode) for path in [run_dir, *run_dir.rglob("*")]}
    wrong = {name: oct(found) for name, found in modes.items()
             if found != (0o777 if (run_dir / name).is_dir() else 0o666) & ~mask}
    assert "step-000004/policy.safetensors" in modes and not wrong


def test_eval_scores_a_checkpoint_like_the_run_did(full_run, tmp_path):
    from rich.console import Console

    from rlgraph.cli import main
    from rlgraph.train.evaluation import evaluate_run

    run_dir, _, _ = full_run
    last = [row for row in metrics_of(run_dir) if "eval/accuracy" in row][-1]  # the evaluation at step 4
    shown = Console(file=io.StringIO(), width=200)
    result = evaluate_run(run_dir, console=shown)
    assert "generation.compile" not in shown.file.getvalue()  # the training rollouts' decision: no rollout runs here
    assert (result["step"], result["prompts"]) == (4, 8)
    assert result["eval/accuracy"] == last["eval/accuracy"] and result["eval/reward"] == last["eval/reward"]
    assert json.loads(Path(result["saved"]).read_text())["eval/accuracy"] == last["eval/accuracy"]
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"question": f"{a}+1=", "answer": str(a + 1)}) + "\n" for a in range(5)))
    result = evaluate_run(run_dir, checkpoint="3", data=str(other), max_prompts=3)
    assert (result["step"], result["prompts"], result["checkpoint"]) == (3, 3, "step-000003")
    with pytest.raises(ConfigError, match="no such checkpoint"):
        evaluate_run(run_dir, checkpoint="9")
    assert main(["eval", str(run_dir), "--max-prompts", "0"]) == 1


def test_ppo_with_a_lora_policy_trains_a_full_critic_from_the_merged_weights(tmp_path):
    from safetensors.torch import load_file as load

    config, _ = make_config(tmp_path, "ppo", ["algorithm={name: ppo, hparams: {kl: 0.02}}", "model.lora={r: 4}",
                                              "train.steps=2", "checkpoint.every=2"])
    train(config)
    rows = train_rows(tmp_path / "ppo")
    assert [row["step"] for row in rows] == [1, 2] and all(row["critic/grad_norm"] > 0 for row in rows)
    checkpoint = latest_checkpoint(tmp_path / "ppo")
    policy, critic = load(str(checkpoint / "policy.safetensors")), load(str(checkpoint / "critic.safetensors"))
    assert policy and all(".lora_" in name for name in policy)             # the policy: adapters only
    assert any(name.startswith("backbone.") for name in critic) and not any(".lora_" in name for name in critic)


@pytest.mark.slow
def test_ppo_with_a_lora_policy_on_spmd_matches_local(tmp_path):
    ppo = ["algorithm={name: ppo, hparams: {kl: 0.02}}", "model.lora={r: 4}", "train.steps=3", "eval.every=0"]
    rows_local, rows_spmd = train_local_and_spmd(tmp_path, ppo)
    assert_rows_close(rows_spmd, rows_local,
                      ("reward", "ref_kl", "policy/loss", "policy/grad_norm", "critic/loss", "critic/grad_norm"))


def test_a_lora_warm_start_becomes_the_base_and_the_kl_reference(tmp_path):
    from transformers import AutoModelForCausalLM

    from rlgraph.train.export import export_run

    config, _ = make_config(tmp_path, "lora", ["model.lora={r: 4}", "train.steps=2", "checkpoint.every=1"])
    train(config)
    run_dir = tmp_path / "lora"
    assert (run_dir / "base.safetensors").is_file()
    first = train_rows(run_dir)[0]
    assert abs(first["policy/kl"]) < 1e-6  # fresh adapters on the warm-started base: policy == reference
    # Resume, export and eval rebuild the same policy from the saved base and the adapters.
    resumed = load_run_config(run_dir, ["train.steps=3"])
    assert train(resumed, resume=True).steps == 3
    straight, _ = make_config(tmp_path, "straight", ["model.lora={r: 4}", "train.steps=3", "checkpoint.every=1"])
    train(straight)
    assert_same_run(tmp_path / "straight", run_dir)  # the resume was exact: metrics and adapters
    out = export_run(run_dir, tmp_path / "hf")
    assert AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True) is not None
    with pytest.raises(ConfigError, match="adapters apply to its warm-started base"):
        export_run(run_dir, tmp_path / "adapter", adapter=True)
    # One flipped bit in the base's tensor data (issue 34, item 12): resume, eval and export refuse it.
    from rlgraph.train.evaluation import evaluate_run

    base = run_dir / "base.safetensors"
    intact = base.read_bytes()
    flipped = bytearray(intact)
    flipped[-9] ^= 0x40
    base.write_bytes(bytes(flipped))
    damaged = "base.safetensors is not the file checkpoint step-000003 was saved with"
    with pytest.raises(ConfigError, match=damaged):
        train(load_run_config(run_dir, ["train.steps=4"]), resume=True)
    with pytest.raises(CheckpointMismatch, match=damaged):
        export_run(run_dir, tmp_path / "hf2")
    with pytest.raises(CheckpointMismatch, match=damaged):
        evaluate_run(run_dir)
    assert not (tmp_path / "hf2").exists() and not (run_dir / "evals").exists()
    base.write_bytes(intact)
    base.unlink()
    with pytest.raises(ConfigError, match="base.safetensors is missing: checkpoint step-000003 was saved with it"):
        train(load_run_config(run_dir, ["train.steps=4"]), resume=True)


def test_resume_from_an_older_checkpoint_follows_the_uninterrupted_run(full_run, tmp_path):
    """Every step checkpointed (keep_last 4): resumed from step 2 of a finished 4-step run, the run
    trains steps 3-4 again to the same metrics and weights, and the abandoned branch is gone."""
    straight, _ = make_config(tmp_path, "straight", ["checkpoint.keep_last=4"])
    train(straight)
    copy = Path(shutil.copytree(tmp_path / "straight", tmp_path / "again"))
    assert train(load_run_config(copy), resume=True, checkpoint="2").steps == 4
    assert_same_run(tmp_path / "straight", copy)  # metrics.jsonl cut back to step 2, then the same rows
    samples = [(tmp_path / "straight" / "samples.jsonl").read_text(), (copy / "samples.jsonl").read_text()]
    assert samples[0] == samples[1] and '"step": 4' in samples[0]  # cut back too: no step-3/4 lines twice
    assert sorted(p.name for p in copy.glob("step-*")) == [f"step-00000{k}" for k in range(1, 5)]


def test_resume_from_an_older_checkpoint_deletes_the_abandoned_branch_first(full_run, tmp_path):
    from rlgraph.train.checkpoint import abandon_later_checkpoints

    run_dir, _, _ = full_run
    copy = copy_run(run_dir, tmp_path)
    gone = abandon_later_checkpoints(copy, copy / "step-000003")
    assert [p.name for p in gone] == ["step-000004"] and latest_checkpoint(copy).name == "step-000003"
    assert sorted(p.name for p in copy.glob("step-*")) == ["step-000003"]
    assert abandon_later_checkpoints(copy, copy / "step-000003") == []  # nothing later: nothing changes


@pytest.mark.parametrize("chosen, expected", [("7", "no such checkpoint"), ("step-000001", "no such checkpoint"),
                                              ("../full", "no such checkpoint"),
                                              ("", "no such checkpoint")])
def test_a_bad_resume_checkpoint_is_refused_listing_the_runs_checkpoints(full_run, tmp_path, chosen, expected):
    run_dir, _, _ = full_run
    copy = copy_run(run_dir, tmp_path)
    with pytest.raises(ConfigError, match=f"{expected}.*\n  fix: one of step-000003, step-000004"):
        train(load_run_config(copy, ["train.steps=5"]), resume=True, checkpoint=chosen)
    other = run_dir / "step-000003"  # a checkpoint of another run directory
    with pytest.raises(ConfigError, match="is not a checkpoint of"):
        train(load_run_config(copy, ["train.steps=5"]), resume=True, checkpoint=str(other))
    with pytest.raises(ConfigError, match="only taken with --resume"):
        train(load_run_config(copy, ["train.steps=5"]), checkpoint="3")


@pytest.mark.parametrize("damage", ["bitflip", "nan", "unreadable"])
def test_a_damaged_latest_checkpoint_names_the_newest_intact_one(full_run, tmp_path, damage):
    from safetensors.torch import save_file

    run_dir, _, _ = full_run
    copy = copy_run(run_dir, tmp_path)
    weights = copy / "step-000004" / "policy.safetensors"
    if damage == "bitflip":
        data = bytearray(weights.read_bytes())
        data[-5] ^= 0x10
        weights.write_bytes(bytes(data))
    elif damage == "nan":  # saved with NaN and checksummed as such: only the values say it
        tensors = load_file(str(weights))
        name = next(k for k in tensors if ".layers." in k)
        tensors[name].view(-1)[0] = float("nan")
        save_file(tensors, str(weights))
        meta = json.loads((weights.parent / "meta.json").read_text())
        meta["sha256"]["policy.safetensors"] = __import__("hashlib").sha256(weights.read_bytes()).hexdigest()
        (weights.parent / "meta.json").write_text(json.dumps(meta))
        (weights.parent / "meta.sha256").write_text(file_sha256(weights.parent / "meta.json"))
    else:
        (copy / "step-000004" / "run_state.pt").write_bytes(b"")
    config = load_run_config(copy, ["train.steps=5"])
    with pytest.raises(ConfigError, match=r"latest checkpoint step-000004 is damaged.*\n  fix: .*--checkpoint step-000003"):
        train(config, resume=True)
    assert (copy / "step-000004").is_dir() and latest_checkpoint(copy).name == "step-000004"  # nothing was touched


def test_the_cli_resumes_from_a_chosen_checkpoint_and_names_a_bad_one(full_run, tmp_path, capsys):
    from rlgraph.cli import main

    run_dir, _, _ = full_run
    copy = copy_run(run_dir, tmp_path)
    assert main(["train", "--resume", str(copy), "--checkpoint", "abc"]) == 1
    assert "--checkpoint 'abc': no such checkpoint" in capsys.readouterr().err
    shutil.copytree(copy / "step-000003", copy / "step-best")  # the user's own copy and notes (issue 34, item 10)
    (copy / "step-notes").mkdir()
    (copy / "step-notes" / "plan.md").write_text("try kl 0.1")
    assert main(["train", "--resume", str(copy), "--checkpoint", "3"]) == 0
    assert_same_run(run_dir, copy)  # steps 4 trained again from step 3: the same run
    assert (copy / "step-best" / "meta.json").is_file() and (copy / "step-notes" / "plan.md").read_text() == "try kl 0.1"


def test_a_fresh_run_into_a_directory_holding_the_users_files_is_refused_unless_overwrite(tmp_path, capsys):
    """Issue 34, item 11: nothing of the user's is overwritten without --overwrite; never the config you
    ran (run_dir: .), never a base.safetensors rlgraph did not write, never an earlier run's checkpoints."""
    from rlgraph.cli import main
    from rlgraph.train.manifest import read_manifest

    config, path = make_config(tmp_path, "mine", ["train.steps=1", "warm_start.steps=0", "eval.every=0",
                                                  "checkpoint.every=1"])
    run_dir = tmp_path / "mine"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("my own notes\n")
    with pytest.raises(ConfigError, match=r"holds files rlgraph did not write \(config.yaml\).*\n  fix: .*--overwrite"):
        train(config)
    assert (run_dir / "config.yaml").read_text() == "my own notes\n" and sorted(os.listdir(run_dir)) == ["config.yaml"]
    (run_dir / "base.safetensors").write_bytes(b"another run's base")
    with pytest.raises(ConfigError, match="holds a base.safetensors rlgraph did not write"):
        train(config, overwrite=True)  # not even with overwrite: it is neither deleted nor started from
    (run_dir / "base.safetensors").unlink()
    (run_dir / "notes.txt").write_text("keep me")
    assert train(config, overwrite=True).steps == 1
    assert (run_dir / "notes.txt").read_text() == "keep me" and "my own notes" not in (run_dir / "config.yaml").read_text()
    assert {"config.yaml", "metrics.jsonl", "step-000001", "latest", "summary.json"} <= set(read_manifest(run_dir))
    assert "notes.txt" not in read_manifest(run_dir)
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        train(config, overwrite=True)  # an earlier run's checkpoints are resumed, never written over
    here = tmp_path / "here"
    here.mkdir()
    (here / "config.yaml").write_text(config_text(tmp_path, Path(".")))
    cwd = os.getcwd()
    os.chdir(here)
    try:
        assert main(["train", "config.yaml", "--overwrite"]) == 1
    finally:
        os.chdir(cwd)
    assert "over config.yaml, the config you ran" in capsys.readouterr().err
    assert "rlgraph-manifest.json" not in os.listdir(here)


ASYNC = {"staleness": 1}


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("async")
    config, _ = make_config(tmp_path, "full", rollout=ASYNC)
    train(config)
    return tmp_path / "full"


def test_an_async_run_logs_its_lag_and_resumes_exactly_with_its_batch_in_flight(async_run, tmp_path):
    rows = [row for row in metrics_of(async_run) if "rollout/staleness" in row]
    assert [row["rollout/staleness"] for row in rows] == [0.0, 1.0, 1.0, 1.0]  # batch 0 is on-policy
    # the reward terms logged at a step are those of the batch it trained (scored a step earlier), as the
    # plan's reward is: with the one term `math`, the two are the same number
    assert all(row["reward/math"] == row["reward"] for row in rows)
    config, _ = make_config(tmp_path, "half", ["train.steps=2"], rollout=ASYNC)
    train(config)
    assert train(load_run_config(tmp_path / "half", ["train.steps=4"]), resume=True).steps == 4
    assert_same_run(async_run, tmp_path / "half")


@pytest.mark.parametrize("override, expected", [
    ("rollout.staleness=-1", r"rollout.staleness: Input should be greater than or equal to 0"),
    ("rollout.staleness=1.5", r"rollout.staleness: Input should be a valid integer"),
    ("rollout.staleness=true", r"rollout.staleness: Input should be a valid integer"),
    ("rollout.staleness_policy=drop", r"rollout.staleness_policy: Input should be 'wait'"),
])
def test_bad_staleness_values_name_the_key(tmp_path, override, expected):
    with pytest.raises(ConfigError, match=expected):
        make_config(tmp_path, "bad", [override])


def test_a_loss_invalid_off_policy_is_refused_naming_the_config_key(tmp_path):
    config, _ = make_config(tmp_path, "gpg", ["algorithm.hparams={loss: gpg_loss}"], rollout=ASYNC)
    with pytest.raises(ConfigError, match=r"rollout.staleness=1: the loss 'loss' of update uses gpg_loss"):
        train(config)


@pytest.mark.slow
def test_an_async_run_killed_and_resumed_gives_the_same_run(async_run, tmp_path):
    _, path = make_config(tmp_path, "killed", rollout=ASYNC)
    kill_after_checkpoint_and_resume(path, tmp_path / "killed", 2)  # a batch is in flight at every checkpoint
    assert_same_run(async_run, tmp_path / "killed")


def write_dev(tmp_path: Path, rows: int) -> Path:
    path = tmp_path / "dev.jsonl"  # held-out sums outside the train file's 0..7 + 0..7
    path.write_text("".join(json.dumps({"question": f"{a}+9=", "answer": str(a + 9)}) + "\n" for a in range(rows)))
    return path


def test_the_warm_start_target_is_measured_on_its_own_dev_split(tmp_path, monkeypatch):
    """warm_start.eval: the target accuracy is checked on those prompts; the run's evaluations
    (before RL, every eval.every, at the end) stay on the held-out split."""
    from rich.console import Console

    from rlgraph.train.session import _Session

    evaluated, evaluate = [], _Session.evaluate

    def counted(self, runner=None, rows=None):
        evaluated.append(len(self.setup.eval_rows if rows is None else rows))
        return evaluate(self, runner, rows)

    monkeypatch.setattr(_Session, "evaluate", counted)
    config, _ = make_config(tmp_path, "dev", warm_start={"steps": 2, "target_accuracy": 1.0, "eval_every": 1,
                                                         "eval": str(write_dev(tmp_path, 3))},
                            train={"steps": 1}, eval={"every": 0})
    train(config, console=Console(quiet=True))
    assert evaluated == [3, 3, 8, 8]  # two warm start checks on the 3 dev prompts; before and after RL on the 8 held out


@pytest.mark.parametrize("sections, error", [
    ({"warm_start": {"eval": "DEV"}}, r"warm_start.eval .*dev.jsonl: prompts to measure warm_start.target_accuracy on, "
                                      r"but no target is set"),
    ({"warm_start": {"eval": "/nonexistent/dev.jsonl", "target_accuracy": 0.5}}, r"/nonexistent/dev.jsonl"),
    ({"warm_start": {"eval": "DEV", "target_accuracy": 0.5}, "runtime": {"runtime": "spmd", "nproc": 2}},
     r"the warm start's held-out prompts: 3 rows cannot be split evenly over the 2 data-parallel ranks.*\n.*"
     r"set warm_start.eval so that there are 2"),
])
def test_a_bad_warm_start_dev_split_is_refused_naming_the_key(tmp_path, sections, error):
    from rlgraph.train.setup import prepare

    dev = str(write_dev(tmp_path, 3))
    sections = {key: {k: dev if v == "DEV" else v for k, v in value.items()} for key, value in sections.items()}
    config, _ = make_config(tmp_path, "bad", **sections)
    with pytest.raises(RLGraphError, match=error):
        prepare(config)

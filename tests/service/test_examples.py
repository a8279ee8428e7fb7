"""The service examples run as stated: the two tenants equal each alone; GRPO learns the task."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("tinker")  # the fixtures serve the SDK

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "service"


def load(name: str):
    sys.path.insert(0, str(EXAMPLES))
    try:
        spec = importlib.util.spec_from_file_location(f"service_example_{name}", EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(EXAMPLES))


def test_two_tenants_on_one_server_each_equal_running_alone():
    result = load("two_tenants").main()
    assert result["same"]
    assert result["sft"][-1] < result["sft"][0]  # the SFT tenant trained
    assert len({tuple(map(tuple, tokens)) for tokens, _ in result["rl"]}) > 1  # the RL tenant's samples moved


def test_the_grpo_loop_gives_identical_results_in_process_and_over_http(server, client_a, tmp_path):
    from rlgraph.service.client import LocalServiceClient

    rl_loop = load("rl_loop")
    local = LocalServiceClient("tiny", state_dir=tmp_path)
    try:
        in_process = rl_loop.run(local, "tiny", rl_steps=3, prompts=2, n=4, lr=1e-2, test_size=4, log=lambda _: None)
    finally:
        local.scheduler.close()
    over_http = rl_loop.run(client_a, "tiny", rl_steps=3, prompts=2, n=4, lr=1e-2, test_size=4, log=lambda _: None)
    assert in_process == over_http


@pytest.mark.parametrize("target", [0.0, 1.5, "0.3"])
def test_the_warm_base_refuses_a_target_accuracy_sft_cannot_stop_at(target, tmp_path):
    with pytest.raises(ValueError, match=r"target is the dev accuracy SFT stops at, a number in \(0, 1\)"):
        load("rl_loop").warm_base(str(tmp_path / "base"), target=target)
    assert not (tmp_path / "base").exists()  # refused before any training


@pytest.mark.parametrize("flags, message", [(["--seed", "-1"], "--seed must be a whole number >= 0, got -1"),
                                            (["--seed", "x"], "invalid int value: 'x'"),
                                            (["--rl-steps", "0"], "--rl-steps must be at least 1, got 0")])
def test_the_grpo_loop_flags_refuse_bad_values_before_training(flags, message, monkeypatch, capsys):
    rl_loop = load("rl_loop")
    monkeypatch.setattr(rl_loop, "warm_base", lambda *args, **kwargs: pytest.fail("trained despite a bad flag"))
    monkeypatch.setattr(sys, "argv", ["rl_loop.py", *flags])
    with pytest.raises(SystemExit):
        rl_loop.main()
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_the_grpo_loop_learns_the_arithmetic_task(tmp_path, monkeypatch):
    """SFT to the demo's 30% dev accuracy makes the base (train()'s warm start), then 100 GRPO steps
    of 16 x 8 on a LoRA tenant, lr 5e-4 decayed to 0 over the 100, all on one torch thread (the
    demo's two would fight the other test worker; the base, and so the trajectory, depends on the
    thread count). Measured held-out gains of exactly this (docs/service.md, 2026-11-28; held-out at
    steps 0/25/50/75/100): seed 0 32/46/41/40/45 (+13), seed 1 42/52/61/60/60 (+18), seed 2
    27/42/48/48/49 (+22). The bound, +10 points = 10 of the 100 greedy test problems, is the
    issue's; seed 0, the test's, clears it by 3 problems (the example's 200 steps on this base: +9,
    its peak being early, so more steps do not make the test safer)."""
    from rlgraph.service.client import LocalServiceClient
    from rlgraph.train import demo

    one_thread = demo.DemoConfig
    monkeypatch.setattr(demo, "DemoConfig", lambda **fields: one_thread(**{"threads": 1, **fields}))
    rl_loop = load("rl_loop")
    base = rl_loop.warm_base(str(tmp_path / "base"), seed=0)
    service = LocalServiceClient(base, state_dir=tmp_path / "states")
    try:
        result = rl_loop.run(service, base, seed=0, rl_steps=100)
    finally:
        service.scheduler.close()
    assert result["after"] - result["before"] > 0.10, result

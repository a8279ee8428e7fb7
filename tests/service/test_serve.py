"""`rlgraph serve`: keys, option checks, and the real command serving the SDK."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from rlgraph.errors import ConfigError
from rlgraph.service.serve import check_options, read_keys
from tests.service.conftest import KEY_A, free_port, tinker

REPO = Path(__file__).resolve().parents[2]


def test_keys_come_from_a_file_or_the_environment(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"# team A\n{KEY_A}\n\n")
    assert read_keys(str(keys), {}) == {KEY_A}
    assert read_keys(None, {"RLGRAPH_SERVE_KEYS": f"{KEY_A}, tml-{'c' * 20}"}) == {KEY_A, f"tml-{'c' * 20}"}
    assert read_keys(None, {}) is None


@pytest.mark.parametrize("content, message", [("", "holds no key"), ("sk-" + "x" * 30, "must start with 'tml-'"),
                                              ("tml-short", "at least 16"), ("tml-" + "x" * 10 + " " + "y" * 10, "spaces")])
def test_bad_keys_files_are_refused_naming_the_line(tmp_path, content, message):
    keys = tmp_path / "keys"
    keys.write_text(content)
    with pytest.raises(ConfigError, match=message):
        read_keys(str(keys), {})
    with pytest.raises(ConfigError, match="no such file"):
        read_keys(str(tmp_path / "missing"), {})


@pytest.mark.parametrize("host, port, runtime, keys, insecure, message", [
    ("127.0.0.1", 8000, "local", None, False, "refuses to start without them"),
    ("0.0.0.0", 8000, "local", None, True, "only on a loopback host"),
    ("127.0.0.1", 70000, "local", {KEY_A}, False, "not a TCP port"),
    ("127.0.0.1", 8000, "local", {KEY_A}, True, "pick one")])
def test_bad_serve_options_are_refused(host, port, runtime, keys, insecure, message):
    with pytest.raises(ConfigError, match=message):
        check_options(host, port, runtime, keys, insecure)


@pytest.mark.parametrize("device, message", [("tpu", "is not cpu, cuda"), ("gpu:0", "is not cpu, cuda"),
                                             ("cuda", "no CUDA GPU")])
def test_bad_devices_and_state_dirs_are_refused(tmp_path, device, message):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match=message):
        check_options("127.0.0.1", 8000, "local", {KEY_A}, False, device)
    file = tmp_path / "file"
    file.write_text("")
    with pytest.raises(ConfigError, match="is a file"):
        check_options("127.0.0.1", 8000, "local", {KEY_A}, False, "cpu", str(file))


def test_a_model_that_is_not_a_directory_is_refused_naming_the_flag(tmp_path):
    from rlgraph.service.errors import CallError
    from rlgraph.service.tenants import BaseModel

    for source in (str(tmp_path / "missing"), str(tmp_path), "llama"):
        with pytest.raises(CallError, match="neither 'tiny', a model config") as error:
            BaseModel.build(source)
        assert error.value.field == "--model"
    bad_configs = {"a.json": "{not json", "b.json": "{}", "c.json": '{"model_type": "qwen2", "vocab_size": 10}'}
    for name, text in bad_configs.items():  # a config file (random init): each mistake named, not a raw error
        (tmp_path / name).write_text(text)
        with pytest.raises(CallError, match="is not a model config this server can build") as error:
            BaseModel.build(str(tmp_path / name))
        assert error.value.field == "--model"


def test_the_command_refuses_to_start_without_keys(tmp_path):
    done = subprocess.run([sys.executable, "-m", "rlgraph", "serve", "--state-dir", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 1 and "refuses to start without them" in done.stderr and "Traceback" not in done.stderr


def test_the_command_serves_the_sdk(tmp_path):
    pytest.importorskip("tinker")
    keys = tmp_path / "keys"
    keys.write_text(KEY_A + "\n")
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "rlgraph", "serve", "--model", "tiny", "--port", str(port),
                                "--keys", str(keys), "--state-dir", str(tmp_path / "states")], cwd=REPO,
                               env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{url}/api/v1/healthz", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                assert process.poll() is None and time.monotonic() < deadline, process.stdout.read().decode()
                time.sleep(0.2)
        client = tinker.ServiceClient(base_url=url, api_key=KEY_A)
        training = client.create_lora_training_client(base_model="tiny", rank=4).result()
        assert training.get_info().model_data.tokenizer_id.endswith("char_tokenizer")
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.mark.parametrize("runtime, nproc, message", [
    ("ray", 1, r"--runtime ray --nproc 1: one rank is the local runtime(.|\n)*fix: --runtime local, or --runtime ray"),
    ("gpu", 1, r"--runtime 'gpu' is not a runtime \(local, spmd or ray\)"),
    ("spmd", 1, r"--runtime spmd --nproc 1: one rank is the local runtime"),
    ("spmd", 0, r"--nproc 0 is not a number of ranks in 1..64"),
    ("spmd", "2", r"--nproc '2' is not a number of ranks"),
    ("local", 2, r"--nproc 2 with --runtime local: the local runtime is one process(.|\n)*fix: --runtime spmd --nproc 2"),
])
def test_bad_runtimes_and_rank_counts_are_refused_saying_why(runtime, nproc, message):
    with pytest.raises(ConfigError, match=message):
        check_options("127.0.0.1", 8000, runtime, {KEY_A}, False, nproc=nproc)
    check_options("127.0.0.1", 8000, "spmd", {KEY_A}, False, nproc=2)  # the good form passes


def test_a_python_without_the_service_extra_gets_the_fix_not_a_traceback(tmp_path, monkeypatch):
    from rlgraph.service.serve import serve

    monkeypatch.setitem(sys.modules, "rlgraph.service.http", None)  # as in .venv-vllm built without the extra
    with pytest.raises(ConfigError, match="needs the `service` extra") as error:
        serve("tiny", host="127.0.0.1", port=0, state_dir=str(tmp_path), keys_file=None, insecure_local=True)
    assert "pip install 'rlgraph[service]'" in str(error.value)

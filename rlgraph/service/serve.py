"""`rlgraph serve`: the checks on its options and the server's run.

    rlgraph serve --model tiny --keys keys.txt --state-dir states            # 127.0.0.1:8000
    RLGRAPH_SERVE_KEYS=tml-... rlgraph serve --model /models/qwen --state-dir states
    rlgraph serve --model tiny --insecure-local --state-dir /tmp/states      # no keys: this machine only
    rlgraph serve --model tiny --runtime spmd --nproc 2 --keys keys.txt --state-dir states   # the base on 2 ranks
    rlgraph serve --model tiny --runtime ray --nproc 2 --keys keys.txt --state-dir states    # on 2 Ray actors
    rlgraph serve --model rlgraph/assets/tiny_qwen2_vllm.json --engine vllm --keys keys.txt --state-dir states

A keys file holds one API key a line (`#` starts a comment). Keys start with `tml-` (the Tinker
SDK refuses any other) and have at least 16 characters after it. Without keys the server
refuses to start unless `--insecure-local`, which also refuses any host but a loopback one.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import torch

from rlgraph.errors import ConfigError
from rlgraph.service.tenants import MAX_RANK
from rlgraph.service.vllm import check_engine

KEYS_ENV = "RLGRAPH_SERVE_KEYS"
MIN_KEY_BODY = 16


def read_keys(path: str | None, environ: dict[str, str] | None = None) -> set[str] | None:
    """The keys of `path` (--keys) or of $RLGRAPH_SERVE_KEYS (comma-separated); None when neither is given."""
    environ = os.environ if environ is None else environ
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"--keys {path}: no such file", fix="write one API key a line, e.g. tml-<32 random hex digits>")
        lines = [(n, line.split("#", 1)[0].strip()) for n, line in enumerate(file.read_text().splitlines(), 1)]
        entries = [(f"--keys {path}:{n}", key) for n, key in lines if key]
        where = f"--keys {path}"
    elif environ.get(KEYS_ENV):
        entries = [(f"${KEYS_ENV} item {i}", key.strip()) for i, key in enumerate(environ[KEYS_ENV].split(",")) if key.strip()]
        where = f"${KEYS_ENV}"
    else:
        return None
    if not entries:
        raise ConfigError(f"{where} holds no key", fix="one key a line: tml-<at least 16 characters>")
    for place, key in entries:
        if not key.startswith("tml-") or len(key) < 4 + MIN_KEY_BODY or any(c.isspace() for c in key):
            raise ConfigError(f"{place}: a key must start with 'tml-' (the Tinker SDK refuses others) and have at least "
                              f"{MIN_KEY_BODY} characters after it, without spaces",
                              fix='python -c "import secrets; print(\'tml-\' + secrets.token_hex(16))"')
    return {key for _, key in entries}


def check_options(host: str, port: int, runtime: str, keys: set[str] | None, insecure_local: bool,
                  device: str = "cpu", state_dir: str | None = None, nproc: object = 1, engine: object = "native",
                  max_lora_rank: object = MAX_RANK) -> str:
    """Refuse bad options naming the flag; returns the device to serve on."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port {port} is not a TCP port", fix="--port 8000 (0 picks a free one)")
    if runtime not in ("local", "spmd", "ray"):
        raise ConfigError(f"--runtime {runtime!r} is not a runtime (local, spmd or ray)", fix="--runtime local or spmd")
    _check_nproc(runtime, nproc)
    check_engine(engine, nproc, max_lora_rank)
    if keys is None and not insecure_local:
        raise ConfigError("no API keys: the server refuses to start without them",
                          fix=f"--keys FILE (one tml-... key a line) or ${KEYS_ENV}; or --insecure-local on a "
                              "machine only you use")
    if keys is not None and insecure_local:
        raise ConfigError("--insecure-local and keys were both given; pick one", fix="drop --insecure-local")
    if insecure_local and not _loopback(host):
        raise ConfigError(f"--insecure-local serves without keys, so only on a loopback host, not --host {host}",
                          fix="--host 127.0.0.1, or give --keys")
    if state_dir is not None and Path(state_dir).exists() and not Path(state_dir).is_dir():
        raise ConfigError(f"--state-dir {state_dir} is a file; saved states need a directory",
                          fix="--state-dir a new or existing directory")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ConfigError(f"--device {device!r} is not cpu, cuda, cuda:N or auto", fix="--device cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: torch sees no CUDA GPU here", fix="--device cpu (or auto)")
    return device


MAX_NPROC = 64


def _check_nproc(runtime: str, nproc: object) -> None:
    if isinstance(nproc, bool) or not isinstance(nproc, int) or not 1 <= nproc <= MAX_NPROC:
        raise ConfigError(f"--nproc {nproc!r} is not a number of ranks in 1..{MAX_NPROC}", fix="--nproc 2")
    if runtime == "local" and nproc != 1:
        raise ConfigError(f"--nproc {nproc} with --runtime local: the local runtime is one process",
                          fix=f"--runtime spmd --nproc {nproc}")
    if runtime != "local" and nproc < 2:
        raise ConfigError(f"--runtime {runtime} --nproc 1: one rank is the local runtime without the worker process",
                          fix=f"--runtime local, or --runtime {runtime} --nproc 2")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(model: str, *, host: str, port: int, state_dir: str, keys_file: str | None, insecure_local: bool,
          runtime: str = "local", device: str = "cpu", nproc: int = 1, engine: str = "native",
          max_lora_rank: int = MAX_RANK) -> None:
    """Check the options, build the service and run uvicorn until interrupted."""
    from rlgraph.service.core import Service

    keys = read_keys(keys_file)
    device = check_options(host, port, runtime, keys, insecure_local, device, state_dir, nproc, engine, max_lora_rank)
    try:
        import uvicorn

        from rlgraph.service.http import build_app
    except ImportError as exc:  # e.g. .venv-vllm built without the extra: say which, not a deep traceback
        raise ConfigError(f"rlgraph serve needs the `service` extra (tinker, fastapi, uvicorn): {exc}",
                          fix="pip install 'rlgraph[service]' into this Python") from exc
    service = Service(model, state_dir=state_dir, device=device, nproc=nproc, runtime=runtime, engine=engine,
                      max_lora_rank=max_lora_rank)
    try:
        app = build_app(service, keys)
        ranks = f", {nproc} {runtime} ranks" if nproc > 1 else ""
        ranks += ", sampling on vLLM" if engine == "vllm" else ""
        print(f"rlgraph serve: {service.base.name} on http://{host}:{port} ({len(keys or ())} keys{ranks}; "
              f"states in {state_dir})")
        try:
            uvicorn.run(app, host=host, port=port, log_level="warning")
        finally:
            app.state.server.scheduler.close()
    finally:
        service.close()

"""The service's samplers on vLLM (`rlgraph serve --engine vllm`, rlgraph/service/vllm.py).

The refusals run everywhere; the live test runs where vLLM is importable (`make test` runs this
module a second time in `.venv-vllm`), against the same service on the native engine.
"""

import importlib.util
import json

import pytest
import torch

from rlgraph.backends.local.models import TINY_VLLM_CONFIG
from rlgraph.errors import ConfigError
from rlgraph.service.core import SampleParams, Service
from rlgraph.service.datums import Datum
from rlgraph.service.errors import CallError
from rlgraph.service.serve import check_options
from rlgraph.service.tenants import LoraSpec

HAS_VLLM = importlib.util.find_spec("vllm") is not None
live = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed here: `make test` runs this module in .venv-vllm")
OWNER = "local"
# Both sides fp32 on CPU: the log-prob bound of tests/backends/test_vllm_live.py (GEMM and reduction order only).
LOGPROB_BOUND = 3e-3


def test_bad_engines_and_vllm_on_worker_ranks_are_refused_before_anything_starts(tmp_path):
    for engine in ("sglang", "", None, "VLLM"):
        with pytest.raises(CallError, match="is not a generation engine") as error:
            check_options("127.0.0.1", 8000, "local", None, True, engine=engine)
        assert error.value.field == "--engine" and "--engine native" in str(error.value)
    with pytest.raises(CallError, match="runs in the server's process, not on 2 ranks") as error:
        check_options("127.0.0.1", 8000, "spmd", None, True, nproc=2, engine="vllm")
    assert "--runtime local" in error.value.fix
    with pytest.raises(CallError, match="not on 2 ranks"):  # the API refuses it as the flag does, before any model
        Service("tiny", state_dir=tmp_path, nproc=2, engine="vllm")
    if not HAS_VLLM:
        with pytest.raises(CallError, match="vLLM is not installed"):
            check_options("127.0.0.1", 8000, "local", None, True, engine="vllm")
    for rank in (0, 129, "32", True):
        with pytest.raises(CallError, match="is not a LoRA rank in 1..128") as error:
            check_options("127.0.0.1", 8000, "local", None, True, engine="native", max_lora_rank=rank)
        assert error.value.field == "--max-lora-rank"
    with pytest.raises(ConfigError, match="--port"):  # the other flags are still checked first
        check_options("127.0.0.1", -1, "local", None, True, engine="vllm")


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    """The same base (a head_dim-32 tiny Qwen2 with logits spread wide enough that greedy argmaxes are not
    near-ties) served on vLLM and on the native engine. The vLLM engine is never shut down: it shares
    this process's vLLM parallel groups with the session's other engines (tests/backends/conftest.py)."""
    config = tmp_path_factory.mktemp("model") / "tiny_qwen2_vllm.json"
    config.write_text(json.dumps({**json.loads(TINY_VLLM_CONFIG.read_text()), "initializer_range": 0.3}))
    on_vllm = Service(str(config), state_dir=tmp_path_factory.mktemp("vllm_states"), engine="vllm", max_lora_rank=8)
    native = Service(str(config), state_dir=tmp_path_factory.mktemp("native_states"))
    yield on_vllm, native
    on_vllm.close()
    native.close()


def _train_and_snapshot(service, text):
    """A tenant (LoRA on attention and MLP) trained 3 steps towards `text`, then its sampler snapshot."""
    service.create_model(OWNER, "m", service.base.name, LoraSpec(rank=8, train_unembed=False))
    ids = service.base.tokenizer.encode(text)
    datum = Datum(ids[:-1], {"target_tokens": ids[1:]})
    for _ in range(3):
        service.forward(OWNER, "m", [datum], "cross_entropy", backward=True)
        service.optim_step(OWNER, "m", {"learning_rate": 0.05})
    service.save_for_sampler(OWNER, "m", "after")


def _greedy(service, sampler, prompt, samples=2):
    out = service.sample(OWNER, sampler, prompt, samples, SampleParams(max_tokens=8, temperature=0.0))
    return [(seq.tokens, torch.tensor(seq.logprobs)) for seq in out["sequences"]]


@live
def test_samplers_generate_on_vllm_as_the_native_engine_and_sync_by_version(services):
    on_vllm, native = services
    prompt = on_vllm.base.tokenizer.encode("12+34=")
    for service in services:
        service.create_sampler(OWNER, "base", base_model=service.base.name)
        _train_and_snapshot(service, "12+34=46")
    host, engine = on_vllm.ranks.host, on_vllm.ranks.host.vllm
    results = {}
    for sampler in ("base", "after", "base"):  # base, then the adapter, then the base again: three syncs
        got, want = _greedy(on_vllm, sampler, prompt), _greedy(native, sampler, prompt)
        for (tokens, lp), (ref_tokens, ref_lp) in zip(got, want):
            assert tokens == ref_tokens
            assert float((lp - ref_lp).abs().max()) < LOGPROB_BOUND
        assert engine.version == host.executors[on_vllm.samplers[sampler].key].models["policy"].version
        results[sampler] = got
    (base_tokens, base_lp), (tuned_tokens, tuned_lp) = results["base"][0], results["after"][0]
    # the adapter reached vLLM: the trained sampler's greedy answer is not the base's
    assert tuned_tokens != base_tokens or float((tuned_lp - base_lp).abs().max()) > 0.1
    syncs = len(host.executors[on_vllm.samplers["base"].key].syncs)
    _greedy(on_vllm, "base", prompt)
    assert len(host.executors[on_vllm.samplers["base"].key].syncs) == syncs  # served already: no sync
    plan = on_vllm.plan("sample")[0][1].as_text()
    assert "sync_weights" in plan and "vllm" in plan


@live
def test_what_vllm_cannot_serve_is_refused_with_the_reason(services, tmp_path):
    on_vllm, _ = services
    with pytest.raises(CallError, match="rank 16 is above 8") as error:  # the engine takes ranks <= 8 here
        on_vllm.create_model(OWNER, "wide", on_vllm.base.name, LoraSpec(rank=16, train_unembed=False))
    assert error.value.field == "lora_config.rank" and "--max-lora-rank" in error.value.fix
    with pytest.raises(CallError, match="cannot apply an adapter to lm_head") as error:
        on_vllm.create_model(OWNER, "unembed", on_vllm.base.name, LoraSpec(rank=8))  # Tinker's default: train_unembed
    assert error.value.field == "lora_config.train_unembed" and "train_unembed=False" in error.value.fix
    assert "unembed" not in on_vllm.tenants
    from rlgraph.backends.vllm.engine import VLLMError

    with pytest.raises(VLLMError, match="head_dim 16"):  # the shipped tiny model: refused before vLLM starts
        Service("tiny", state_dir=tmp_path, engine="vllm")

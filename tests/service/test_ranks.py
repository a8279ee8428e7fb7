"""`rlgraph serve --runtime spmd --nproc 2`: the tiny base FSDP2-sharded over 2 worker ranks serves two
tenants through the official tinker SDK, gives the single-process server's numbers, and passes the
SDK tests the single-process server passes (`test_sdk.py`)."""

from __future__ import annotations

import pytest

pytest.importorskip("tinker")

from tests.service import test_sdk
from tests.service.conftest import KEY_A, KEY_B, RunningServer, datum, tinker

types = tinker.types
pytestmark = pytest.mark.slow  # two worker processes

TEXTS = ["12+7=19", "3+4=7", "20+5=25"]  # 3 datums: the ranks get 2 each, one a zero-weight copy (`_padded`)
# Each rank sums its rows' gradients and the ranks add theirs (one all-reduce): the same fp32 terms as one
# process, added in another order (~1e-7 relative); two Adam steps at lr 1e-2 carry that into the losses at
# ~1e-6. 1e-5 is well above it and far below what one step changes (> 1%).
SAME_LOSS = 1e-5


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    local = RunningServer(tmp_path_factory.mktemp("local"))
    try:
        ranked = RunningServer(tmp_path_factory.mktemp("spmd"), nproc=2)
    except BaseException:
        local.stop()
        raise
    yield local, ranked
    ranked.stop()
    local.stop()


def _calls(url: str) -> list:
    """Two tenants (two API keys), each: forward_backward, optim_step twice, a forward, a seeded sample."""
    found = []
    for key, seed in ((KEY_A, 0), (KEY_B, 1)):
        training = tinker.ServiceClient(base_url=url, api_key=key).create_lora_training_client(
            base_model="tiny", rank=4, seed=seed).result()
        data = [datum(training.get_tokenizer(), text) for text in TEXTS]
        for _ in range(2):
            found.append(training.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
            found.append(training.optim_step(types.AdamParams(learning_rate=1e-2)).result().metrics["grad_norm:mean"])
        found.append(training.forward(data, "cross_entropy").result().metrics["loss:sum"])
        sampler = training.save_weights_and_get_sampling_client().result()
        prompt = types.ModelInput.from_ints(training.get_tokenizer().encode("12+"))
        result = sampler.sample(prompt, 3, types.SamplingParams(max_tokens=4, seed=5)).result()
        found.append([sequence.tokens for sequence in result.sequences])  # counter-based: the same draws anywhere
    return found


def test_two_ranks_give_the_single_process_numbers(servers):
    local, ranked = servers
    ours, theirs = _calls(ranked.url), _calls(local.url)
    for mine, reference in zip(ours, theirs):
        assert mine == (reference if isinstance(reference, list) else pytest.approx(reference, rel=SAME_LOSS))
    # the tenants live on the ranks, not in the server's process
    assert all(tenant.executor is None for tenant in ranked.service.tenants.values())


@pytest.mark.parametrize("sdk_test", [test_sdk.test_rl_step_with_importance_sampling,
                                      test_sdk.test_sampling_returns_tokens_logprobs_and_stop_reasons,
                                      test_sdk.test_save_and_restore_give_identical_forward_results])
def test_the_sdk_tests_pass_on_two_ranks(servers, sdk_test):
    sdk_test(tinker.ServiceClient(base_url=servers[1].url, api_key=KEY_A))


def test_ray_actors_serve_with_the_same_commands_and_numbers(tmp_path):
    """The tenant commands reach Ray actors through the same `WorkerPool.command` (a local cluster)."""
    pytest.importorskip("ray")
    from rlgraph.service.core import Service
    from rlgraph.service.datums import Datum
    from rlgraph.service.tenants import LoraSpec

    def losses(service):
        try:
            tokenizer = service.base.tokenizer
            service.create_model("owner", "m", "tiny", LoraSpec(rank=4, seed=0))
            data = [Datum(seq[:-1], {"target_tokens": seq[1:]}) for seq in map(tokenizer.encode, TEXTS)]
            found = [service.forward("owner", "m", data, "cross_entropy", backward=True)["metrics"]["loss:sum"]]
            service.optim_step("owner", "m", {"learning_rate": 1e-2})
            return found + [service.forward("owner", "m", data, "cross_entropy")["metrics"]["loss:sum"]]
        finally:
            service.close()

    reference = losses(Service("tiny", state_dir=tmp_path / "local"))
    assert losses(Service("tiny", state_dir=tmp_path / "ray", nproc=2, runtime="ray")) == pytest.approx(reference, rel=SAME_LOSS)
    assert reference[1] < reference[0]  # the step moved the adapter

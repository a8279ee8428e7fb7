"""The vLLM engine: pure conversions and bookkeeping with fakes (a live vLLM: test_vllm_live.py)."""

import contextlib
import json
import sys
import types
from dataclasses import dataclass, field

import pytest
import torch

from rlgraph.backends.local.executor import StaleVersionError
from rlgraph.backends.local.counter_sampling import SamplingParams, sampling_keys
from rlgraph.backends.protocols import ModelRef
from rlgraph.backends.vllm import (
    VISION_ON_VLLM, VLLMEngine, VLLMError, check_head_dim, check_text_model, import_vllm, request_seeds,
    rollouts_from_outputs, sampling_kwargs, token_prompts,
)
from rlgraph.batches import Prompts
from rlgraph.testing import tiny_executor, tiny_prompts

EOS, PAD = 2, 0


# -- fakes of vLLM's output records (vllm.outputs.RequestOutput / CompletionOutput, vllm.sequence.Logprob) --------


@dataclass
class Logprob:
    logprob: float


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[Completion]


def completion(tokens, logprobs, reason):
    return Completion(tokens, [{t: Logprob(lp)} for t, lp in zip(tokens, logprobs)], reason)


# two prompts, left-padded to P = 3: "5 6" and "7 8 9"
PROMPTS = Prompts(torch.tensor([[PAD, 5, 6], [7, 8, 9]]), torch.tensor([[False, True, True], [True, True, True]]),
                  {"answer": ["a", "b"]})
# n = 2 samples each, max_new_tokens = 4
COMPLETIONS = [
    completion([3, EOS], [-0.5, -0.25], "stop"),            # prompt 0, sample 0: stops at EOS
    completion([4, 5, 6, 7], [-1.0, -2.0, -3.0, -4.0], "length"),  # prompt 0, sample 1: the token budget
    completion([EOS], [-0.125], "stop"),                    # prompt 1, sample 0: EOS at once
    completion([8], [-0.75], "length"),                     # prompt 1, sample 1: the context limit
]


def per_row_outputs(completions=COMPLETIONS, prompts=((5, 6), (7, 8, 9))):
    """B*n outputs of one completion each (one request per row, as VLLMEngine sends them)."""
    return [RequestOutput(list(prompts[row // 2]), [c]) for row, c in enumerate(completions)]


def convert(outputs, prompts=PROMPTS, n=2):
    return rollouts_from_outputs(outputs, prompts, n, max_new_tokens=4, eos_token_id=EOS, pad_token_id=PAD)


# -- conversions ---------------------------------------------------------------------------------


def test_token_prompts_strip_the_left_padding():
    assert token_prompts(PROMPTS) == [{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7, 8, 9]}]


@pytest.mark.parametrize("mask, message", [
    ([[True, True, False], [True, True, True]], "left padding"),             # right-padded
    ([[True, False, True], [True, True, True]], "rows \\[0\\] have padding between tokens"),
    ([[False, False, False], [True, True, True]], "at least one token"),     # an empty prompt
])
def test_prompts_that_are_not_left_padded_are_refused(mask, message):
    with pytest.raises(ValueError, match=message):
        token_prompts(Prompts(PROMPTS.ids, torch.tensor(mask)))


def image_prompts(grids):
    """PROMPTS with images: row r's grids `grids[r]` ((t, h, w) each; all zero: no image), 8 patches a row."""
    grid = torch.tensor(grids, dtype=torch.long)  # [B, I, 3]
    return Prompts(PROMPTS.ids, PROMPTS.mask, pixel_values=torch.zeros(2, 8, 12), image_grid_thw=grid)


@pytest.mark.parametrize("grids, rows", [
    ([[[0, 0, 0]], [[1, 2, 2]]], "\\[1\\]"),                           # one row of two holds an image
    ([[[1, 2, 2]], [[1, 2, 4]]], "\\[0, 1\\]"),                         # both do
    ([[[1, 2, 2], [0, 0, 0]], [[0, 0, 0], [1, 2, 2]]], "\\[0, 1\\]"),   # images in different slots
])
def test_prompts_carrying_images_are_refused_naming_the_rows_never_sent_without_them(grids, rows):
    with pytest.raises(ValueError, match=f"prompt rows {rows} carry images; vLLM cannot generate for a vision"):
        token_prompts(image_prompts(grids))
    padded_only = token_prompts(image_prompts([[[0, 0, 0]], [[0, 0, 0]]]))  # image fields, no image: text rows
    assert padded_only == token_prompts(PROMPTS)


def test_outputs_become_rollouts_with_the_native_conventions():
    ro = convert(per_row_outputs())
    assert torch.equal(ro.response_ids, torch.tensor([[3, EOS, PAD, PAD], [4, 5, 6, 7], [EOS, PAD, PAD, PAD],
                                                      [8, PAD, PAD, PAD]]))
    assert torch.equal(ro.mask, torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 0, 0, 0]]).bool())
    assert torch.equal(ro.logprobs, torch.tensor([[-0.5, -0.25, 0, 0], [-1, -2, -3, -4], [-0.125, 0, 0, 0],
                                                  [-0.75, 0, 0, 0]]))
    assert ro.logprobs.dtype == torch.float32 and ro.response_ids.dtype == torch.long
    assert torch.equal(ro.group, torch.tensor([0, 0, 1, 1]))                 # row i*n + j: sample j of prompt i
    assert torch.equal(ro.prompt_ids, PROMPTS.ids.repeat_interleave(2, 0))  # still left-padded
    assert torch.equal(ro.prompt_mask, PROMPTS.mask.repeat_interleave(2, 0))
    assert ro.meta == {"answer": ["a", "a", "b", "b"]}


def test_the_native_engines_rollouts_survive_a_round_trip_through_vllms_output_records():
    executor = tiny_executor(max_new_tokens=5)
    prompts = tiny_prompts(3)
    native = executor.generate(executor.current("policy"), prompts, n=2, temperature=1.0)  # [6, 5], padded to 5
    eos, pad = executor.tokenizer.eos_token_id, executor.tokenizer.pad_token_id
    outputs = []
    for row in range(len(native)):
        tokens = native.response_ids[row][native.mask[row]].tolist()
        reason = "stop" if tokens[-1] == eos else "length"
        prompt = prompts.ids[row // 2][prompts.mask[row // 2]].tolist()
        outputs.append(RequestOutput(prompt, [completion(tokens, native.logprobs[row][native.mask[row]].tolist(),
                                                         reason)]))
    again = rollouts_from_outputs(outputs, prompts, 2, max_new_tokens=5, eos_token_id=eos, pad_token_id=pad)
    for name in ("prompt_ids", "prompt_mask", "response_ids", "mask", "logprobs", "group"):
        assert torch.equal(getattr(again, name), getattr(native, name)), name
    assert again.meta == native.meta


def test_one_output_per_prompt_with_n_completions_gives_the_same_rollouts():
    grouped = [RequestOutput([5, 6], COMPLETIONS[:2]), RequestOutput([7, 8, 9], COMPLETIONS[2:])]
    a, b = convert(grouped), convert(per_row_outputs())
    for name in ("prompt_ids", "prompt_mask", "response_ids", "mask", "logprobs", "group"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize("completions, message", [
    (COMPLETIONS[:3], "3 completions for 2 prompts x n=2"),
    ([completion([1, 2, 3, 4, 5], [-1.0] * 5, "length")] + COMPLETIONS[1:], "more than max_new_tokens=4"),
    ([completion([3, EOS, 4], [-1.0] * 3, "length")] + COMPLETIONS[1:], "continues after EOS"),
    ([completion([3, 4], [-1.0] * 2, "stop")] + COMPLETIONS[1:], "stopped without ending in EOS"),
    ([Completion([3, EOS], None, "stop")] + COMPLETIONS[1:], "no log-prob per token"),
    ([completion([3], [-1.0], "abort")] + COMPLETIONS[1:], "finished with 'abort'"),
])
def test_outputs_that_break_the_conventions_are_refused(completions, message):
    with pytest.raises(ValueError, match=message):
        convert(per_row_outputs(completions))


def test_outputs_out_of_request_order_are_refused():
    with pytest.raises(ValueError, match="row 0 answers another prompt than prompt 0"):
        convert(per_row_outputs(prompts=((7, 8, 9), (5, 6))))


def test_request_seeds_are_the_native_row_keys_on_any_shard():
    index = torch.tensor([4, 9, 2])
    seeds = request_seeds(7, 3, index, 2)
    keys = sampling_keys(7, 3, index, 2)
    assert seeds == [k & (2**63 - 1) for k in keys.tolist()] and all(0 <= s < 2**63 for s in seeds)
    assert len(set(seeds)) == 6
    shards = request_seeds(7, 3, index[:1], 2) + request_seeds(7, 3, index[1:], 2)
    assert shards == seeds  # a prompt keeps its index on a shard: the same seeds, the same samples
    assert request_seeds(7, 4, index, 2) != seeds  # the next generate call samples afresh


def test_sampling_kwargs_map_the_native_params():
    kwargs = sampling_kwargs(SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=5), [11, 12], eos_token_id=EOS)
    assert kwargs == [
        dict(n=1, temperature=0.7, top_p=0.9, max_tokens=5, logprobs=0, stop_token_ids=[EOS], ignore_eos=True,
             detokenize=False, seed=seed) for seed in (11, 12)]
    greedy = sampling_kwargs(SamplingParams(temperature=0.0, max_new_tokens=3), [11], eos_token_id=EOS)
    assert greedy[0]["temperature"] == 0.0 and greedy[0]["seed"] is None  # greedy: vLLM's argmax, no noise


# -- the engine, on a fake vLLM ------------------------------------------------------------------


@dataclass
class FakeModel:
    loaded: list = field(default_factory=list)
    reloads: list = field(default_factory=list)  # "start" / "finish" of vLLM's layerwise reload

    def load_weights(self, weights):
        self.loaded.append(list(weights))

    def modules(self):
        return [self]

    def parameters(self, recurse=True):
        return []


class FakeLLM:
    """Records what VLLMEngine asks of `vllm.LLM`, and answers generate with COMPLETIONS."""

    def __init__(self, **kwargs):
        self.kwargs, self.calls, self.model = kwargs, [], FakeModel()
        runner = types.SimpleNamespace(model_runner=types.SimpleNamespace(get_model=lambda: self.model),
                                       vllm_config=types.SimpleNamespace(model_config=None))
        worker = types.SimpleNamespace(worker=runner)  # vLLM's WorkerWrapperBase holds the Worker
        self.llm_engine = types.SimpleNamespace(model_executor=types.SimpleNamespace(driver_worker=worker))

    def generate(self, prompts, sampling_params, use_tqdm):
        self.calls.append(("generate", prompts, sampling_params))
        return [RequestOutput(p["prompt_token_ids"], [c]) for p, c in zip(prompts, COMPLETIONS)]

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


def fake_vllm_modules(*, cpu=False):
    """`vllm` and the submodules VLLMEngine imports: the platform, and the layerwise reload that records
    its start and finish on the FakeModel."""
    module = types.ModuleType("vllm")
    module.LLM = FakeLLM
    module.SamplingParams = lambda **kwargs: kwargs
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(is_cpu=lambda: cpu, is_sleep_mode_available=lambda: not cpu)
    config = types.ModuleType("vllm.config")
    config.set_current_vllm_config = lambda _: contextlib.nullcontext()
    reload = types.ModuleType("vllm.model_executor.model_loader.reload")
    reload.initialize_layerwise_reload = lambda model: model.reloads.append("start")
    reload.finalize_layerwise_reload = lambda model, _: model.reloads.append("finish")
    layerwise = types.ModuleType("vllm.model_executor.model_loader.reload.layerwise")
    layerwise.get_layerwise_info = lambda _: types.SimpleNamespace(can_load=lambda: False)
    return {"vllm": module, "vllm.platforms": platforms, "vllm.config": config,
            "vllm.model_executor": types.ModuleType("vllm.model_executor"),
            "vllm.model_executor.model_loader": types.ModuleType("vllm.model_executor.model_loader"),
            "vllm.model_executor.model_loader.reload": reload,
            "vllm.model_executor.model_loader.reload.layerwise": layerwise}


@pytest.fixture
def fake_vllm(monkeypatch):
    modules = fake_vllm_modules()
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return modules["vllm"]


def synced_engine(version=3, **kwargs):
    engine = VLLMEngine(FakeLLM(), role="policy", eos_token_id=EOS, pad_token_id=PAD, rank=1, **kwargs)
    engine.load_weights([("model.embed_tokens.weight", torch.zeros(2, 2))])
    engine.finish_sync(version)
    return engine


PARAMS = SamplingParams(temperature=1.0, max_new_tokens=4)


def test_build_asks_for_an_in_process_engine_with_sleep_mode_and_processed_logprobs(fake_vllm):
    engine = VLLMEngine.build("/models/tiny", role="policy", eos_token_id=EOS, pad_token_id=PAD, seed=5,
                              load_format="dummy")
    assert engine.llm.kwargs == dict(model="/models/tiny", dtype="bfloat16", seed=5, gpu_memory_utilization=0.5,
                                     enable_sleep_mode=True, skip_tokenizer_init=True,
                                     distributed_executor_backend="external_launcher",
                                     logprobs_mode="processed_logprobs", load_format="dummy", enable_prefix_caching=True)


def test_generate_sends_one_seeded_request_per_row_and_returns_rollouts(fake_vllm):
    engine = synced_engine()
    ro = engine.generate(PROMPTS, 2, PARAMS, seed=7, call=0, model=ModelRef("policy", 3))
    _, prompts, sampling = engine.llm.calls[-1]
    assert [p["prompt_token_ids"] for p in prompts] == [[5, 6], [5, 6], [7, 8, 9], [7, 8, 9]]
    assert [s["seed"] for s in sampling] == request_seeds(7, 0, PROMPTS.index, 2)
    assert torch.equal(ro.response_ids, convert(per_row_outputs()).response_ids)


def test_weights_load_one_bucket_at_a_time_and_the_version_is_set_after_the_last(fake_vllm):
    engine = VLLMEngine(FakeLLM(), role="policy", eos_token_id=EOS, pad_token_id=PAD, rank=1)
    buckets = [[("a.weight", torch.ones(2))], [("b.weight", torch.ones(3)), ("c.bias", torch.ones(1))]]
    for bucket in buckets:
        engine.load_weights(iter(bucket))
        assert engine.version is None  # half loaded: serves nothing
    engine.finish_sync(4)
    loaded = [[name for name, _ in bucket] for bucket in engine.llm.model.loaded]
    assert loaded == [["a.weight"], ["b.weight", "c.bias"]]
    assert engine.llm.model.reloads == ["start", "finish"]  # one layerwise reload around the buckets
    assert engine.version == 4 and engine.llm.calls[-1] == ("reset_prefix_cache",)


def test_a_version_the_engine_does_not_hold_is_refused_naming_both(fake_vllm):
    fresh = VLLMEngine(FakeLLM(), role="policy", eos_token_id=EOS, pad_token_id=PAD, rank=1)
    with pytest.raises(StaleVersionError, match="policy@0 but rank 1's vLLM engine serves no complete policy weights"):
        fresh.generate(PROMPTS, 2, PARAMS, seed=0, call=0, model=ModelRef("policy", 0))
    with pytest.raises(StaleVersionError, match="policy@2 but rank 1's vLLM engine serves policy@3"):
        synced_engine().generate(PROMPTS, 2, PARAMS, seed=0, call=0, model=ModelRef("policy", 2))
    with pytest.raises(StaleVersionError, match="ref@3 but .* serves policy@3"):
        synced_engine().generate(PROMPTS, 2, PARAMS, seed=0, call=0, model=ModelRef("ref", 3))


def test_sleep_and_wake_up_gate_loading_and_generating(fake_vllm):
    engine = synced_engine()
    engine.sleep()
    engine.sleep()  # already asleep: nothing more to release
    assert engine.llm.calls[-1] == ("sleep", 1) and engine.llm.calls.count(("sleep", 1)) == 1
    with pytest.raises(RuntimeError, match="weights asleep"):
        engine.load_weights([("a.weight", torch.ones(1))])
    engine.wake_up(["weights"])
    engine.load_weights([("a.weight", torch.ones(1))])  # a sync with the KV cache still released
    engine.finish_sync(4)
    with pytest.raises(RuntimeError, match=r"asleep \(kv_cache\)"):
        engine.generate(PROMPTS, 2, PARAMS, seed=0, call=0, model=ModelRef("policy", 4))
    engine.wake_up()
    assert engine.llm.calls[-1] == ("wake_up", ["kv_cache"])  # only what is still asleep
    engine.generate(PROMPTS, 2, PARAMS, seed=0, call=0, model=ModelRef("policy", 4))


def test_level_2_sleep_drops_the_weights_and_their_version(fake_vllm):
    engine = synced_engine(sleep_level=2)
    engine.sleep()
    engine.wake_up()
    with pytest.raises(StaleVersionError, match="serves no complete policy weights"):
        engine.generate(PROMPTS, 2, PARAMS, seed=0, call=0, model=ModelRef("policy", 3))


@pytest.mark.parametrize("n", [0, -1, "2"])
def test_bad_sample_counts_are_refused(fake_vllm, n):
    with pytest.raises(ValueError, match="n \\(samples per prompt\\) must be an int >= 1"):
        synced_engine().generate(PROMPTS, n, PARAMS, seed=0, call=0, model=ModelRef("policy", 3))


@pytest.mark.parametrize("params", [None, {"temperature": 1.0}, 1.0])
def test_params_other_than_rlgraphs_sampling_params_are_refused(fake_vllm, params):
    with pytest.raises(TypeError, match="params must be rlgraph's SamplingParams"):
        synced_engine().generate(PROMPTS, 2, params, seed=0, call=0, model=ModelRef("policy", 3))


@pytest.mark.parametrize("token", [-1, "2", None])
def test_bad_token_ids_are_refused(token):
    with pytest.raises(ValueError, match="eos_token_id must be an int >= 0"):
        VLLMEngine(FakeLLM(), role="policy", eos_token_id=token, pad_token_id=PAD)


@pytest.mark.parametrize("level", [0, 3, "1"])
def test_bad_sleep_levels_are_refused(level):
    with pytest.raises(ValueError, match="sleep_level must be 1"):
        VLLMEngine(FakeLLM(), role="policy", eos_token_id=EOS, pad_token_id=PAD, sleep_level=level)


@pytest.mark.parametrize("version", [-1, "3", 2.0])
def test_bad_versions_are_refused(version):
    engine = VLLMEngine(FakeLLM(), role="policy", eos_token_id=EOS, pad_token_id=PAD)
    with pytest.raises(ValueError, match="version must be an int >= 0"):
        engine.finish_sync(version)


@pytest.mark.parametrize("tags", [["weight"], [], "kv_cache"])
def test_bad_wake_up_tags_are_refused(tags):
    engine = VLLMEngine(FakeLLM(), role="policy", eos_token_id=EOS, pad_token_id=PAD)
    with pytest.raises(ValueError, match="tags must be a non-empty subset"):
        engine.wake_up(tags)


def test_an_engine_core_in_another_process_is_explained():
    llm = FakeLLM()
    llm.llm_engine = types.SimpleNamespace()  # no model_executor: vLLM's multiprocess engine core
    engine = VLLMEngine(llm, role="policy", eos_token_id=EOS, pad_token_id=PAD)
    with pytest.raises(RuntimeError, match="external_launcher"):
        engine.load_weights([("a.weight", torch.ones(1))])


def test_without_vllm_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # what a missing package looks like to `import`
    with pytest.raises(ImportError, match=r"pip install 'rlgraph\[vllm\]'"):
        import_vllm()
    with pytest.raises(ImportError, match=r"pip install 'rlgraph\[vllm\]'"):
        VLLMEngine.build("/models/tiny", role="policy", eos_token_id=EOS, pad_token_id=PAD)


def test_on_cpu_build_asks_for_float32_an_explicit_kv_cache_and_no_sleep_mode(monkeypatch):
    for name, module in fake_vllm_modules(cpu=True).items():
        monkeypatch.setitem(sys.modules, name, module)
    engine = VLLMEngine.build("/models/tiny", role="policy", eos_token_id=EOS, pad_token_id=PAD)
    kwargs = engine.llm.kwargs
    assert (kwargs["dtype"], kwargs["enable_sleep_mode"], kwargs["kv_cache_memory_bytes"]) == ("float32", False, 64 << 20)
    assert engine.can_sleep is False
    with pytest.raises(VLLMError, match="cannot sleep: this platform has no vLLM sleep mode"):
        engine.sleep()


def test_a_failed_start_names_the_rank_the_role_and_the_fix(fake_vllm):
    def out_of_memory(**kwargs):
        raise ValueError("Available memory on node 0 (1.0/23.4 GiB) on kv cache allocation is less than requested")
    fake_vllm.LLM = out_of_memory
    with pytest.raises(VLLMError, match=r"(?s)rank 3's vLLM engine for 'policy' .* failed to start.*fix: a smaller "
                                        "kv_cache_memory_bytes"):
        VLLMEngine.build("/models/tiny", role="policy", eos_token_id=EOS, pad_token_id=PAD, rank=3)


def test_an_engine_core_that_fails_mid_generate_is_named_and_never_used_again(fake_vllm):
    engine = synced_engine()

    def dead(*args, **kwargs):
        raise RuntimeError("EngineCore encountered an issue. See stack trace (above) for the root cause.")

    engine.llm.generate = dead
    with pytest.raises(VLLMError, match=r"(?s)rank 1's vLLM engine for 'policy' failed during generate: RuntimeError: "
                                        r"EngineCore .*not used again\n  fix: .*rlgraph train --resume RUN_DIR") as caught:
        engine.generate(PROMPTS, 2, PARAMS, seed=0, call=0, model=ModelRef("policy", 3))
    assert caught.value.rank == 1  # the plan runner names the rank and the step with it (RankFailure)
    engine.llm.generate = FakeLLM().generate  # even if the core answered again, its state is unknown
    for call in (lambda: engine.generate(PROMPTS, 2, PARAMS, seed=0, call=0, model=ModelRef("policy", 3)),
                 lambda: engine.load_weights([("a.weight", torch.ones(1))]),
                 lambda: engine.continue_rows([[5, 6]], [2], [0], PARAMS, ModelRef("policy", 3))):
        with pytest.raises(VLLMError, match="failed earlier \\(RuntimeError: EngineCore .* \\(during generate\\)\\)"):
            call()


def test_a_failed_start_releases_what_vllm_set_up_in_a_process_that_had_no_world(fake_vllm, monkeypatch):
    released = []
    parallel_state = types.ModuleType("vllm.distributed.parallel_state")
    parallel_state.cleanup_dist_env_and_memory = lambda: released.append(True)
    monkeypatch.setitem(sys.modules, "vllm.distributed", types.ModuleType("vllm.distributed"))
    monkeypatch.setitem(sys.modules, "vllm.distributed.parallel_state", parallel_state)

    def kv_cache_too_small(**kwargs):
        raise ValueError("To serve at least one request with the model's max seq len (4096), (0.5 GiB KV cache is "
                         "needed, which is larger than the available KV cache memory (0.06 GiB)")

    fake_vllm.LLM = kv_cache_too_small
    with pytest.raises(VLLMError, match=r"(?s)rank 0's vLLM engine .* failed to start \(before the plan's first step\)"
                                        r".*fix: a smaller max_model_len .*, or a larger kv_cache_memory_bytes"):
        VLLMEngine.build("/models/tiny", role="policy", eos_token_id=EOS, pad_token_id=PAD)
    assert released == [True]


def test_a_bucket_that_fails_closes_the_reload_and_leaves_no_version(fake_vllm):
    engine = synced_engine()
    engine.load_weights([("a.weight", torch.ones(1))])
    engine.llm.model.load_weights = lambda weights: (_ for _ in ()).throw(KeyError("b.weight"))
    with pytest.raises(VLLMError, match="rank 1's vLLM engine failed to load a weight bucket of 'policy': KeyError"):
        engine.load_weights([("b.weight", torch.ones(1))])
    assert engine.version is None and not engine.loading
    assert engine.llm.model.reloads == ["start", "finish", "start", "finish"]  # the first sync, then the aborted one


@pytest.mark.parametrize("config", [{"hidden_size": 64, "num_attention_heads": 4}, {"head_dim": 16},
                                    {"hidden_size": 8, "num_attention_heads": 1}])
def test_heads_too_small_for_vllms_cpu_attention_are_refused_before_it_starts(config):
    with pytest.raises(VLLMError, match="is below 32, which vLLM's CPU attention needs"):
        check_head_dim(config, "model.path")
    check_head_dim({"hidden_size": 64, "num_attention_heads": 2}, "model.path")


def test_the_local_runtimes_engine_refuses_the_shipped_head_dim_16_model_before_vllm_starts():
    from rlgraph.backends.local.models import build_causal_lm, load_tokenizer
    from rlgraph.backends.vllm.local import build_local_engine

    tokenizer = load_tokenizer()
    model = build_causal_lm(tokenizer=tokenizer)
    with pytest.raises(VLLMError, match=r"model.path: head_dim 16 .*\n  fix: .*tiny_qwen2_vllm.json"):
        build_local_engine(model, role="policy", tokenizer=tokenizer, seed=0, max_model_len=32)


@pytest.mark.parametrize("config", [{"model_type": "qwen2_vl", "text_config": {"hidden_size": 64}},
                                    {"model_type": "qwen2_5_vl"}, {"model_type": "my_vlm", "vision_config": {}}])
def test_vision_language_configs_are_refused_with_the_reason_before_vllm_starts(config):
    reason = r"vLLM cannot generate for a vision-language model here: \(1\) .*torchvision.*\(2\) .*expands again"
    with pytest.raises(VLLMError, match=rf"model.path: a .* model; {reason}.*\n  fix: runtime.engine: native"):
        check_text_model(config, "model.path")
    check_text_model({"model_type": "qwen2", "hidden_size": 64}, "model.path")  # a text model passes


def test_the_local_runtimes_engine_refuses_a_vlm_whose_heads_vllm_could_run_before_vllm_starts():
    from rlgraph.backends.local.vlm import build_vision_lm, build_vl_tokenizer, tiny_vl_config
    from rlgraph.backends.vllm.local import build_local_engine

    tokenizer = build_vl_tokenizer()
    config = tiny_vl_config(tokenizer)
    config["text_config"].update(num_attention_heads=2, num_key_value_heads=1,  # head_dim 32, as vLLM's CPU needs
                                 rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]})
    model = build_vision_lm(config, tokenizer=tokenizer)
    with pytest.raises(VLLMError, match="model.path: a qwen2_vl model; " + VISION_ON_VLLM[:40]):
        build_local_engine(model, role="policy", tokenizer=tokenizer, seed=0, max_model_len=64)


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`:UserWarning")  # peft, on the lm_head case
def test_a_lora_engine_starts_from_the_frozen_base_and_refuses_what_vllms_lora_layers_cannot_serve(tmp_path):
    from safetensors.torch import load_file

    from rlgraph.backends.local.models import TINY_VLLM_CONFIG, build_causal_lm, load_tokenizer
    from rlgraph.backends.lora import LoraSettings, apply_lora
    from rlgraph.backends.vllm.local import lora_engine_args

    config = json.loads(TINY_VLLM_CONFIG.read_text())
    plain = build_causal_lm(config, tokenizer=load_tokenizer(), seed=0)
    expected = {name: tensor.clone() for name, tensor in plain.state_dict().items() if name != "lm_head.weight"}
    policy = apply_lora(plain, LoraSettings(r=4, alpha=8, target_modules=("q_proj", "v_proj")))
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_()  # trained adapters: the base saved must not hold them
    args = lora_engine_args(policy, str(tmp_path), "model.lora")
    assert args == dict(enable_lora=True, max_loras=1, max_lora_rank=8)  # the smallest rank vLLM takes >= 4
    saved = load_file(tmp_path / "model.safetensors")
    assert saved.keys() == expected.keys() and all(torch.equal(saved[k], expected[k]) for k in expected)
    for targets, message in ((("lm_head",), "LoRA on lm_head cannot be served by vLLM's LoRA layers"),
                             (("q_proj", "lm_head"), "LoRA on lm_head cannot be served")):
        other = apply_lora(build_causal_lm(config, tokenizer=load_tokenizer(), seed=0),
                           LoraSettings(r=4, target_modules=targets))
        with pytest.raises(VLLMError, match=message):
            lora_engine_args(other, str(tmp_path), "model.lora")
    huge = apply_lora(build_causal_lm(config, tokenizer=load_tokenizer(), seed=0), LoraSettings(r=600))
    with pytest.raises(VLLMError, match="LoRA rank 600 is above vLLM's largest max_lora_rank 512"):
        lora_engine_args(huge, str(tmp_path), "model.lora")


def test_serving_the_base_drops_the_adapters_and_is_refused_mid_sync(fake_vllm):
    engine = synced_engine(version=3)
    removed = []
    engine.llm.llm_engine.remove_lora = removed.append
    engine.adapter = types.SimpleNamespace(lora_int_id=4)  # as load_adapter leaves it: policy@3's adapters
    engine.serve_base(7)
    assert removed == [4] and engine.adapter is None and engine.version == 7
    assert engine.llm.calls[-1] == ("reset_prefix_cache",)  # no cached prefix of the adapters' version is reused
    # a plain request: FakeLLM.generate has no lora_request keyword, so one passed would fail here
    engine.generate(PROMPTS, 1, PARAMS, seed=0, call=0, model=ModelRef("policy", 7))
    engine.load_weights([("model.embed_tokens.weight", torch.zeros(2, 2))])  # a sync opens
    with pytest.raises(VLLMError, match="in the middle of a sync"):
        engine.serve_base(8)
    for version in (-1, "3", 2.0):
        with pytest.raises(ValueError, match="version must be an int >= 0"):
            engine.serve_base(version)

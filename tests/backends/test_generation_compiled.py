"""The compiled decode step (`NativeGenerator(compile_decode=True)`: the static-shape lean step under
torch.compile) against the eager loop.

The model runs in float64, where Inductor's fused and reordered reductions move the logits by a few
units of 2**-53 relative. The sampler then rounds the logits to float32 (as on every model), so such
a difference can flip one float32 rounding: a log-prob moves by a few float32 ulps of the logits'
magnitude (|logits| < 16 here, ulp ~1e-6), hence 1e-5; a wrong cache column or position moves them
by ~1e-2 (tests/backends/test_lean_static.py). The tokens are the same draws.
"""

import pytest
import torch

from rlgraph.backends.local.generation import NativeGenerator
from rlgraph.backends.local.counter_sampling import SamplingParams
from rlgraph.backends.local.models import build_causal_lm

from tests.backends.conftest import prompts_of
from tests.backends.test_generation import EOS, PAD, TEXTS

pytestmark = pytest.mark.slow  # one Inductor compile of the tiny model's step: ~10-40 s on 2 cores


def test_compiled_decode_draws_the_eager_tokens_and_compiles_once_per_shape(tokenizer):
    model = build_causal_lm(None, dtype=torch.float64).eval()
    prompts, params = prompts_of(tokenizer, TEXTS), SamplingParams(temperature=1.0, max_new_tokens=6)
    want = NativeGenerator(model, eos_token_id=EOS, pad_token_id=PAD).generate(prompts, 2, params, seed=3)
    compiled = NativeGenerator(model, eos_token_id=EOS, pad_token_id=PAD, compile_decode=True)
    got = compiled.generate(prompts, 2, params, seed=3)
    assert torch.equal(got.response_ids, want.response_ids) and torch.equal(got.mask, want.mask)
    assert (got.logprobs - want.logprobs).abs().max() <= 1e-5
    first = compiled.compile_seconds
    assert first > 0  # the first step of the shape compiled, and its time is reported apart

    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    again = compiled.generate(prompts, 2, params, seed=4)  # same shapes, other noise: no new graph
    assert counters["stats"]["unique_graphs"] == graphs and compiled.compile_seconds == first
    assert again.response_ids.shape[0] == want.response_ids.shape[0]


def test_compile_decode_on_a_model_the_lean_step_cannot_drive_is_refused(tokenizer):
    model = build_causal_lm(None)
    with pytest.raises(ValueError, match=r"compile_decode=True\) compiles the lean decode step.*lean=False"):
        NativeGenerator(model, eos_token_id=EOS, pad_token_id=PAD, lean=False, compile_decode=True)

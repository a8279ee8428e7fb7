"""The primitives refuse bad arguments at the user's line: rg.update's training settings, rg.generate's sampling."""

import pytest

import rlgraph as rg
from rlgraph.errors import TraceError


def _update_with(**config):
    @rg.algorithm
    def algo(state: rg.State, prompts: rg.Prompts):
        ro = rg.generate(state.policy, prompts, n=4)
        policy = rg.update(state.policy, ro, lambda lp: -lp.mean(), **config)  # E-update
        return state.replace(policy=policy), {}

    return algo


BAD_UPDATE = [("grad_clip", [-1, 0, float("nan")]), ("epochs", [0, -3, 1.5]), ("minibatches", [0, "2", None]),
              ("micro_batch_size", [0, -1, 0.5]), ("temperature", [0, -1.0, "hot"])]


@pytest.mark.parametrize("name, values", BAD_UPDATE, ids=[name for name, _ in BAD_UPDATE])
def test_update_refuses_settings_that_train_wrongly(name, values):
    for value in values:
        with pytest.raises(TraceError) as exc:
            _update_with(**{name: value}).trace()
        text = str(exc.value)
        assert f"rg.update: {name}={value!r} is not valid" in text and "# E-update" in text and "fix:" in text


def test_update_accepts_no_clipping_and_micro_batches():
    _update_with(grad_clip=None, micro_batch_size=2, epochs=2).trace()


@pytest.mark.parametrize("config", [dict(temperature="hot"), dict(temperature=float("nan")), dict(top_p=0),
                                    dict(top_p=1.5)])
def test_generate_refuses_sampling_settings(config):
    @rg.algorithm
    def algo(state: rg.State, prompts: rg.Prompts):
        ro = rg.generate(state.policy, prompts, n=4, **config)
        return state, {"len": ro.mask.sum()}

    name, value = next(iter(config.items()))
    with pytest.raises(TraceError, match=f"rg.generate: {name}={value!r} is not valid"):
        algo.trace()


def generating_with(stop):
    @rg.algorithm
    def algo(state: rg.State, prompts: rg.Prompts):
        ro = rg.generate(state.policy, prompts, n=4, stop=stop)
        return state, {"len": ro.mask.sum()}

    return algo


@pytest.mark.parametrize("stop", ["\n", ("",), ["a", ""], ("a", 3), None])
def test_generate_refuses_stop_that_is_not_a_tuple_of_strings(stop):
    with pytest.raises(TraceError, match=r"rg.generate: stop must be a tuple \(or list\) of non-empty strings(.|\n)*fix: e.g. stop="):
        generating_with(stop).trace()
    assert "stop=('\\n',)" in str(generating_with(("\n",)).trace())  # a good one is kept in the program


@pytest.mark.parametrize("call, message", [
    (lambda s, ro: rg.logprobs(s.policy, ro, vocab="yes"), r"rg.logprobs\(vocab='yes'\): vocab must be True or False"),
    (lambda s, ro: rg.logprobs(s.policy, ro, vocab=True, entropy=True), r"rg.logprobs\(vocab=True, entropy=True\)"),
    (lambda s, ro: rg.update(s.policy, ro, lambda lp: lp.mean(), vocab=True, outputs=True),
     r"rg.update\(vocab=True, outputs=True\)"),
    (lambda s, ro: rg.update(s.policy, ro, lambda lp, entropy: lp.mean(), vocab=True), "log-probs over the vocabulary"),
])
def test_the_vocabulary_option_refuses_what_it_cannot_give(call, message):
    @rg.algorithm
    def algo(state: rg.State, prompts: rg.Prompts):
        ro = rg.generate(state.policy, prompts, n=2)
        call(state, ro)  # E-vocab
        return state, {}

    with pytest.raises(TraceError, match=message):
        algo.trace()

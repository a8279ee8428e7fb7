"""OpenAI-compatible sampling on a tenant's sampler weights, with token ids and log-probs."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("tinker")

from tests.service.conftest import KEY_A, KEY_B, tinker

types = tinker.types


@pytest.fixture(scope="module")
def sampler(client_a):
    training = client_a.create_lora_training_client(base_model="tiny", rank=4).result()
    return training.save_weights_and_get_sampling_client().result()


def openai(server, route: str, body: dict, key: str = KEY_A) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{route}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def test_completions_return_token_ids_and_logprobs_of_the_tenants_weights(server, sampler):
    tokenizer = sampler.get_tokenizer()
    answer = openai(server, "completions", {"model": sampler._sampling_session_id, "prompt": "12+7=", "max_tokens": 4,
                                            "n": 2, "seed": 5, "logprobs": 1})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["object"] == "text_completion" and len(body["choices"]) == 2
    prompt = tokenizer.encode("12+7=")
    direct = sampler.sample(types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=4, seed=5)).result()
    for choice, sequence in zip(body["choices"], direct.sequences):
        # the same sampler, prompt and seed: the same draw as the Tinker call
        assert choice["token_ids"] == sequence.tokens and choice["prompt_token_ids"] == prompt
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(sequence.logprobs, abs=1e-6)
        assert choice["text"] == tokenizer.decode(sequence.tokens, skip_special_tokens=True)
        assert choice["finish_reason"] == sequence.stop_reason
    assert body["usage"]["prompt_tokens"] == len(prompt)


def test_chat_completions_render_the_chat_template(server, sampler):
    answer = openai(server, "chat/completions", {"model": sampler._sampling_session_id, "max_tokens": 3, "seed": 1,
                                                 "messages": [{"role": "user", "content": "2+2="}]})
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert len(choice["token_ids"]) == len(choice["logprobs"]["content"]) <= 3
    assert all(item["logprob"] <= 0 for item in choice["logprobs"]["content"])


def test_base_model_by_name_and_bad_requests(server, sampler):
    assert openai(server, "completions", {"model": "tiny", "prompt": [1, 5, 6], "max_tokens": 2}).status_code == 200
    cases = [({"model": sampler._sampling_session_id, "prompt": "1+1=", "max_tokens": 2}, KEY_B, 404, "model"),
             ({"model": "nope", "prompt": "1+1="}, KEY_A, 404, "model"),
             ({"model": "tiny", "prompt": ""}, KEY_A, 400, "prompt"),
             ({"model": "tiny", "prompt": "1", "max_tokens": 10_000}, KEY_A, 413, "sampling_params.max_tokens"),
             ({"model": "tiny", "prompt": "1", "stream": True}, KEY_A, 400, "stream"),
             ({"model": "tiny", "prompt": "1", "best_of": 3}, KEY_A, 400, "best_of")]
    for body, key, status, field in cases:
        answer = openai(server, "completions", body, key)
        assert (answer.status_code, answer.json().get("field")) == (status, field), answer.text
    bad_chat = openai(server, "chat/completions", {"model": "tiny", "messages": [{"role": "user"}]})
    assert (bad_chat.status_code, bad_chat.json()["field"]) == (400, "messages[0]")
    assert server.healthy()


def test_a_long_prompt_is_refused_untokenised_and_tokenising_never_blocks_healthz(server, monkeypatch):
    """Issue 34 item 3: a 15 MB prompt was tokenised on the request thread for 44.5 s before its
    length was checked, and another client's healthz waited 42.7 s."""
    import threading
    import time

    tokenizer = server.service.base.tokenizer
    limits = server.service.limits
    calls = []
    encode = tokenizer.encode

    def slow_encode(text, *args, **kwargs):  # a tokeniser that takes 1.5 s: where does it run?
        calls.append(len(text))
        time.sleep(1.5)
        return encode(text, *args, **kwargs)
    monkeypatch.setattr(tokenizer, "encode", slow_encode)
    too_long = openai(server, "completions", {"model": "tiny", "prompt": "1" * (limits.max_prompt_chars + 1)})
    assert (too_long.status_code, too_long.json()["field"]) == (413, "prompt") and calls == []  # never tokenised
    chat = openai(server, "chat/completions", {"model": "tiny", "messages": [
        {"role": "user", "content": "1" * limits.max_prompt_chars}]})
    assert (chat.status_code, chat.json()["field"]) == (413, "messages") and calls == []
    answers = []
    worker = threading.Thread(target=lambda: answers.append(openai(server, "completions", {
        "model": "tiny", "prompt": "1+1=", "max_tokens": 2})))
    worker.start()
    while not calls:
        time.sleep(0.01)
    start = time.perf_counter()
    assert server.healthy()  # while the tokeniser works
    waited = time.perf_counter() - start
    worker.join(timeout=60)
    assert waited < 0.75 and answers[0].status_code == 200, (waited, answers)  # not 1.5 s: off the event loop

"""OpenAI-compatible sampling on a tenant's sampler weights: `/v1/completions` and
`/v1/chat/completions`, so agent code written against an OpenAI client produces rollouts.

`model` names the weights: a sampling session id (what `save_weights_and_get_sampling_client`
made), a `tinker://.../sampler_weights/<name>` path of this key, or the base model's name.
Extensions beyond OpenAI's fields, for training on the rollouts: each choice carries
`token_ids` (the sampled ids) and `prompt_token_ids`; `logprobs` gives one log-prob per sampled
token (`token_logprobs` for completions, `content[i].logprob` for chat).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import FastAPI, Request

from rlgraph.service.core import SampleParams
from rlgraph.service.errors import CallError, not_found

OPENAI_FIELDS = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n",
                 "stop", "seed", "logprobs", "top_logprobs", "stream", "user"}


def add_openai_routes(app: FastAPI, server: Any) -> None:
    service = server.service

    async def sampler_for(owner: str, model: object) -> str:
        if not isinstance(model, str) or not model:
            raise CallError("names the weights to sample from: a sampling session id, a sampler_weights path or "
                            f"{service.base.name!r}", field="model")
        if model in service.names:
            sampler_id = f"openai:{owner}:base"
            kwargs: dict[str, Any] = {"base_model": service.base.name}
        elif model.startswith("tinker://"):
            sampler_id = f"openai:{owner}:{model}"
            kwargs = {"model_path": model}
        else:
            if model not in service.samplers or service.samplers[model].owner != owner:
                raise not_found("sampler", model, "model")  # another key's session reads as missing
            return model
        if sampler_id not in service.samplers:
            await server.run(sampler_id, lambda: service.create_sampler(owner, sampler_id, **kwargs))
        return sampler_id

    async def complete(request: Request, chat: bool) -> dict[str, Any]:
        owner = server.owner(request)
        try:
            body = await request.json()
        except ValueError:
            raise CallError("the body is not JSON", field="body") from None
        if not isinstance(body, dict):
            raise CallError("the body must be a JSON object", field="body")
        unknown = sorted(set(body) - OPENAI_FIELDS)
        if unknown:
            raise CallError(f"unknown field {unknown[0]!r}", field=unknown[0])
        if body.get("stream"):
            raise CallError("streaming is not supported", field="stream", fix="stream=false")
        sampler_id = await sampler_for(owner, body.get("model"))
        prompt = _chat_prompt(service, body.get("messages")) if chat else _text_prompt(service, body.get("prompt"))
        params = SampleParams(max_tokens=body.get("max_completion_tokens", body.get("max_tokens")), seed=body.get("seed"),
                              stop=body.get("stop"), temperature=body.get("temperature", 1.0), top_p=body.get("top_p", 1.0))
        n = body.get("n", 1)
        result = await server.run(sampler_id, lambda: service.sample(owner, sampler_id, prompt, n, params))
        choices = [_choice(service, i, sequence, prompt, chat) for i, sequence in enumerate(result["sequences"])]
        completion = sum(len(sequence.tokens) for sequence in result["sequences"])
        return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:12]}",
                "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": body["model"], "choices": choices,
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": completion,
                          "total_tokens": len(prompt) + completion}}

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict:
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> dict:
        return await complete(request, chat=True)


def _text_prompt(service: Any, prompt: object) -> list[int]:
    if isinstance(prompt, str) and prompt:
        return list(service.base.tokenizer.encode(prompt))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise CallError(f"must be a non-empty string or a list of token ids, got {str(prompt)[:60]!r}", field="prompt")


def _chat_prompt(service: Any, messages: object) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise CallError("must be a non-empty list of {role, content} messages", field="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise CallError(f"message {i} needs a string role and a string content, got {str(message)[:60]!r}",
                            field=f"messages[{i}]")
    tokenizer = service.base.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise CallError("the base model's tokenizer has no chat template", field="messages",
                        fix="use /v1/completions with a rendered prompt")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text))


def _choice(service: Any, index: int, sequence: Any, prompt: list[int], chat: bool) -> dict[str, Any]:
    tokenizer = service.base.tokenizer
    text = tokenizer.decode(sequence.tokens, skip_special_tokens=True)
    pieces = [tokenizer.decode([token]) for token in sequence.tokens]
    finish = "stop" if sequence.stop_reason == "stop" else "length"
    common = {"index": index, "finish_reason": finish, "token_ids": sequence.tokens, "prompt_token_ids": prompt}
    if chat:
        content = [{"token": piece, "logprob": lp} for piece, lp in zip(pieces, sequence.logprobs)]
        return {**common, "message": {"role": "assistant", "content": text}, "logprobs": {"content": content}}
    return {**common, "text": text, "logprobs": {"tokens": pieces, "token_logprobs": sequence.logprobs}}

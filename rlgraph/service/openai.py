"""OpenAI-compatible sampling on a tenant's sampler weights: `/v1/completions` and
`/v1/chat/completions`, so agent code written against an OpenAI client produces rollouts.

`model` names the weights: a sampling session id (what `save_weights_and_get_sampling_client`
made), a `tinker://.../sampler_weights/<name>` path of this key, or the base model's name.
Extensions beyond OpenAI's fields, for training on the rollouts: each choice carries
`token_ids` (the sampled ids) and `prompt_token_ids`; `logprobs` gives one log-prob per sampled
token (`token_logprobs` for completions, `content[i].logprob` for chat).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request

from rlgraph.service.bodies import json_body
from rlgraph.service.core import SampleParams
from rlgraph.service.datums import check_tokens
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
            await server.run(owner, sampler_id, lambda: service.create_sampler(owner, sampler_id, **kwargs))
        return sampler_id

    async def complete(request: Request, chat: bool) -> dict[str, Any]:
        owner = server.owner(request)
        body = await json_body(request)
        if not isinstance(body, dict):
            raise CallError("the body must be a JSON object", field="body")
        unknown = sorted(set(body) - OPENAI_FIELDS)
        if unknown:
            raise CallError(f"unknown field {str(unknown[0])[:60]!r}", field=str(unknown[0])[:60])
        if body.get("stream"):
            raise CallError("streaming is not supported", field="stream", fix="stream=false")
        # sizes first, then the tokeniser on its own thread: a long prompt never holds the event loop
        if chat:
            messages = _chat_messages(service, body.get("messages"))
            prompt = await _on_tokenizer_thread(lambda: _render_chat(service, messages))
        else:
            prompt = _text_prompt(service, body.get("prompt"))
            if isinstance(prompt, str):
                text = prompt
                prompt = await _on_tokenizer_thread(lambda: list(service.base.tokenizer.encode(text)))
        prompt = check_tokens(prompt, "messages" if chat else "prompt", service.limits)
        sampler_id = await sampler_for(owner, body.get("model"))
        params = SampleParams(max_tokens=body.get("max_completion_tokens", body.get("max_tokens")), seed=body.get("seed"),
                              stop=body.get("stop"), temperature=body.get("temperature", 1.0), top_p=body.get("top_p", 1.0))
        n = body.get("n", 1)
        result = await server.run(owner, sampler_id, lambda: service.sample(owner, sampler_id, prompt, n, params))
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


# One thread tokenises every OpenAI prompt: a burst of long prompts queues here, never on the event
# loop, and never takes the default pool's threads that the other routes use.
_TOKENIZER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlgraph-tokenize")


async def _on_tokenizer_thread(work: Callable[[], list[int]]) -> list[int]:
    return await asyncio.wrap_future(_TOKENIZER.submit(work))


def _text_prompt(service: Any, prompt: object) -> str | list[int]:
    """A text prompt (its length capped before it is tokenised) or a list of token ids."""
    limits = service.limits
    if isinstance(prompt, str) and prompt:
        if len(prompt) > limits.max_prompt_chars:
            raise CallError(f"is {len(prompt)} characters; this server tokenises at most {limits.max_prompt_chars} "
                            f"({limits.chars_per_token} a token of the model's {limits.max_tokens}-token context)",
                            field="prompt", status=413, fix="send a shorter prompt")
        return prompt
    if isinstance(prompt, list) and prompt:
        return check_tokens(prompt, "prompt", limits)
    raise CallError(f"must be a non-empty string or a list of token ids, got {str(prompt)[:60]!r}", field="prompt")


def _chat_messages(service: Any, messages: object) -> list[dict[str, str]]:
    """The messages, each a {role, content} of strings, their text capped like a prompt's."""
    limits = service.limits
    if not isinstance(messages, list) or not messages:
        raise CallError("must be a non-empty list of {role, content} messages", field="messages")
    if len(messages) > limits.max_tokens:
        raise CallError(f"holds {len(messages)} messages; the model's context is {limits.max_tokens} tokens",
                        field="messages", status=413)
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise CallError(f"message {i} needs a string role and a string content, got {str(message)[:60]!r}",
                            field=f"messages[{i}]")
    size = sum(len(message["role"]) + len(message["content"]) for message in messages)
    if size > limits.max_prompt_chars:
        raise CallError(f"hold {size} characters; this server tokenises at most {limits.max_prompt_chars}",
                        field="messages", status=413, fix="send shorter messages")
    if not getattr(service.base.tokenizer, "chat_template", None):
        raise CallError("the base model's tokenizer has no chat template", field="messages",
                        fix="use /v1/completions with a rendered prompt")
    return messages


def _render_chat(service: Any, messages: list[dict[str, str]]) -> list[int]:
    tokenizer = service.base.tokenizer
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

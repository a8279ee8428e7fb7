"""A request's body, read within bounds before any route works on it: its size counted as it is
read (a chunked body has no Content-Length to trust), its arrival time, its JSON nesting; and the
digest that tells a retried request from another one under the same seq id (docs/security.md).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from rlgraph.service.errors import CallError


class BodyLimit:
    """ASGI middleware: a request's whole body, read before the route sees it, counted as it is read
    (a chunked body has no Content-Length to trust) and cut at `max_body_bytes` (413) or when it
    has not arrived within `body_seconds` (408); compressed bodies are refused (415)."""

    def __init__(self, app: Any, limits: Any):
        self.app, self.limits = app, limits

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {name.lower(): value for name, value in scope["headers"]}
        limit = self.limits.max_body_bytes
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            return await _refuse(scope, receive, send, 413, f"the body is {length.decode(errors='replace')[:20]} bytes; "
                                 f"this server takes at most {limit}", "body")
        if headers.get(b"content-encoding", b"identity") not in (b"identity", b""):
            return await _refuse(scope, receive, send, 415, "compressed bodies are not accepted", "Content-Encoding")
        chunks, size = [], 0
        deadline = asyncio.get_running_loop().time() + self.limits.body_seconds
        while True:
            try:
                message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
            except asyncio.TimeoutError:
                return await _refuse(scope, receive, send, 408, f"the body did not arrive within "
                                     f"{self.limits.body_seconds:g} s", "body")
            if message["type"] == "http.disconnect":
                return None  # the client left: nothing to answer
            size += len(message.get("body", b""))
            if size > limit:
                return await _refuse(scope, receive, send, 413, f"the body passed {limit} bytes (read so far: {size}); "
                                     f"this server takes at most {limit}", "body")
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body, replayed = b"".join(chunks), False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: the disconnect, whenever it comes
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        await self.app(scope, replay, send)


async def _refuse(scope: dict, receive: Callable, send: Callable, status: int, message: str, field: str) -> None:
    await JSONResponse({"error": message, "field": field, "category": "user"}, status_code=status,
                       headers={"Connection": "close"})(scope, receive, send)


async def json_body(request: Request) -> Any:
    """The body as JSON, nested at most `max_json_depth` deep (a body past 1 MiB is parsed on a thread)."""
    limits = request.app.state.server.service.limits
    raw = await request.body()
    try:
        body = await asyncio.to_thread(json.loads, raw) if len(raw) > 2**20 else json.loads(raw)
    except RecursionError:
        body = None  # deeper than Python's parser goes: refused below like any deep body
        depth = limits.max_json_depth + 1
    except ValueError:
        raise CallError("the body is not JSON", field="body") from None
    else:
        depth = _depth(body, limits.max_json_depth)
    if depth > limits.max_json_depth:
        raise CallError(f"the JSON body nests deeper than {limits.max_json_depth} levels", field="body",
                        fix="send the SDK's request types (they nest a few levels)")
    request.state.json = body
    return body


def _depth(value: Any, limit: int) -> int:
    """How deep `value` nests, counted up to `limit + 1` (iteratively: no recursion on hostile input)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth > limit:
                return depth
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def fingerprint(request: Request) -> str:
    """A digest of the request's JSON body, whatever its spacing and key order: what tells a retry
    (the same request) from a reuse of its seq id (another request)."""
    canonical = json.dumps(request.state.json, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()

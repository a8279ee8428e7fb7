"""The HTTP server: the server side of what the Tinker SDK speaks, over the service core.

    app = build_app(Service("tiny", state_dir=...), keys={"secret-key"})
    uvicorn.run(app, host="127.0.0.1", port=8000)           # what `rlgraph serve` does

Calls that change a model answer at once with a request id (Tinker's futures) and run on the
scheduler; `/api/v1/retrieve_future` long-polls for the result ("try_again" while it runs). A bad
request is a 4xx naming the field (checked before it is queued where that needs no model); a call
that fails while running returns `{"error", "category": "user"}` through its future. The SDK
retries 5xx and 408/409/429, so user mistakes are never those. Results of `forward_backward` and
`sample` are the SDK's protobuf messages; everything else is JSON.

Auth: `X-API-Key` (the SDK) or `Authorization: Bearer` (OpenAI clients); a key owns the sessions,
models, samplers and saved states it created (`owner` = a digest of the key; keys are never stored).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import uuid
from collections.abc import Callable, Collection
from typing import Any

import attrs
import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from tinker import types

from rlgraph.service import programs, wire
from rlgraph.service.bodies import BodyLimit, fingerprint, json_body
from rlgraph.service.core import SampleParams, Service, check_adam, check_sample
from rlgraph.service.datums import check_datums, check_tokens
from rlgraph.service.errors import CallError, not_found
from rlgraph.service.losses import check_loss
from rlgraph.service.scheduler import KeyReused, QuotaExceeded, Scheduler
from rlgraph.service.tenants import LoraSpec, check_name

PROTO = "application/x-protobuf"
POLL_SECONDS = 20.0  # one retrieve_future waits this long before answering try_again (the SDK waits 45 s)
LOCAL_OWNER = "local"


def owner_of(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:24]


class Server:
    """The state behind the routes: the service, its scheduler (which keeps each call's owner and
    result encoder) and the sessions."""

    def __init__(self, service: Service, keys: Collection[str] | None):
        self.service = service
        limits = service.limits
        self.scheduler = Scheduler(max_queued=limits.max_queued_calls, max_queued_bytes=limits.max_queued_bytes,
                                   keep_results=limits.max_kept_results, keep_bytes=limits.max_kept_bytes)
        self.owners = None if keys is None else {owner_of(key) for key in keys}
        self.sessions: dict[str, str] = {}  # session id -> owner
        self._sessions_of: dict[str, collections.OrderedDict[str, None]] = {}  # owner -> its sessions, oldest first

    def owner(self, request: Request) -> str:
        key = request.headers.get("x-api-key")
        bearer = request.headers.get("authorization", "")
        if key is None and bearer.lower().startswith("bearer "):
            key = bearer[7:].strip()
        if self.owners is None:
            return LOCAL_OWNER if not key else owner_of(key)
        if not key or owner_of(key) not in self.owners:
            raise CallError("a valid API key is needed" if key else "no API key was sent", field="X-API-Key",
                            status=401, fix="ServiceClient(base_url=..., api_key=<a key of the server's --keys file>)")
        return owner_of(key)

    def new_session(self, owner: str) -> str:
        """A session id for `owner`; past `max_sessions` its oldest session is forgotten (its
        heartbeat then answers 410, and the SDK stops it)."""
        session_id = uuid.uuid4().hex
        held = self._sessions_of.setdefault(owner, collections.OrderedDict())
        held[session_id] = None
        self.sessions[session_id] = owner
        while len(held) > self.service.limits.max_sessions:
            del self.sessions[held.popitem(last=False)[0]]
        return session_id

    def session(self, owner: str, session_id: object) -> str:
        if not isinstance(session_id, str) or self.sessions.get(session_id) != owner:
            raise not_found("session", str(session_id), "session_id")
        return session_id

    def submit(self, owner: str, queue: str, call: Callable[[], Any], encode: Callable[[Any], Any], *,
               key: tuple | None = None, fingerprint: str | None = None, model_id: str | None = None,
               size: int = 0) -> dict[str, Any]:
        """Queue `call` under `owner`'s quota. `key` (the call's name, model or sampler, seq id; None
        without a seq id) makes a retry of the same request (`fingerprint`, its body's digest) answer
        the first call's request id; the same key with another request is refused."""
        try:
            request_id = self.scheduler.submit(queue, call, key=None if key is None else (owner, *key), owner=owner,
                                               tag=encode, fingerprint=fingerprint, size=size)
        except QuotaExceeded as error:
            raise CallError(f"{error}; wait for results before sending more", field="request", status=429,
                            fix="retrieve your pending futures (the SDK retries a 429 after a pause)") from None
        except KeyReused as error:
            field = "model_seq_id" if key[0] == "create_model" else "seq_id"
            raise CallError(f"{field} {key[-1]!r} of {key[1]!r} was already used by another {key[0]} request "
                            f"({error}); a retry must resend the same request", field=field,
                            fix=f"use a new {field} for each call (the SDK counts them per client)") from None
        return {"request_id": request_id, **({"model_id": model_id} if model_id else {})}

    def request(self, owner: str, request_id: object) -> tuple[Any, Callable[[Any], Any]]:
        """The future and encoder of `owner`'s call `request_id`; another key's reads as not found."""
        record = self.scheduler.call(request_id)
        if record is None or record.owner != owner:
            raise CallError(f"no call {str(request_id)[:80]!r} for this API key (unknown, another key's, or its result "
                            "was dropped: a key keeps its newest results only)", field="request_id", status=404)
        return record.future, record.tag

    async def run_sync(self, call: Callable[[], Any]) -> Any:
        """`call` on a thread (compiling a plan takes milliseconds; the event loop keeps serving)."""
        return await asyncio.to_thread(call)

    async def run(self, owner: str, queue: str, call: Callable[[], Any]) -> Any:
        """Queue `call` (under `owner`'s quota) and wait for it (calls whose answer the SDK expects inline)."""
        return await asyncio.wrap_future(self.scheduler.future(self.submit(owner, queue, call, None)["request_id"]))


def parse(model: type[pydantic.BaseModel], body: Any) -> Any:
    """`body` as the SDK's request type; a validation error names the first bad field."""
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "body"
        raise CallError(f"{first['msg']} (got {str(first.get('input'))[:80]!r})", field=field) from None


def call_key(call: str, target: object, seq_id: object) -> tuple | None:
    """The repeat-detection key of a call: its name, its model or sampler and its seq id (None: no seq id, no
    repeat detection)."""
    if seq_id is None:
        return None
    if isinstance(seq_id, bool) or not isinstance(seq_id, int):
        raise CallError(f"must be a whole number (the client's call counter), got {str(seq_id)[:60]!r}", field="seq_id")
    return (call, target, seq_id)


def tokens_of(model_input: Any, field: str) -> list[int]:
    tokens: list[int] = []
    for i, chunk in enumerate(model_input.chunks):
        if getattr(chunk, "type", None) != "encoded_text":
            raise CallError(f"chunk {i} is {getattr(chunk, 'type', chunk)!r}; this server takes text tokens only",
                            field=f"{field}.chunks[{i}]", fix="ModelInput.from_ints(tokens)")
        tokens += list(chunk.tokens)
    return tokens


def build_app(service: Service, keys: Collection[str] | None) -> FastAPI:
    """The FastAPI app; `keys=None` serves without keys (`--insecure-local`)."""
    server = Server(service, keys)
    app = FastAPI(title="rlgraph serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    @app.exception_handler(CallError)
    async def call_error(request: Request, error: CallError) -> JSONResponse:
        return JSONResponse({"error": str(error), "field": error.field, "category": "user"}, status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        return JSONResponse({"error": f"{field}: {first['msg']}", "field": field, "category": "user"}, status_code=400)

    @app.exception_handler(Exception)
    async def server_error(request: Request, error: Exception) -> JSONResponse:  # a bug of ours: named, no traceback
        return JSONResponse({"error": f"the server failed on {request.url.path}: {type(error).__name__}: {error}",
                             "category": "server"}, status_code=500)

    app.add_middleware(BodyLimit, limits=service.limits)

    _session_routes(app, server)
    _future_routes(app, server)
    _training_routes(app, server)
    _state_routes(app, server)
    _sampling_routes(app, server)
    _plan_routes(app, server)
    from rlgraph.service.openai import add_openai_routes

    add_openai_routes(app, server)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def unsupported(path: str, request: Request) -> JSONResponse:  # after every real route
        server.owner(request)
        return JSONResponse({"error": f"rlgraph serve does not support {request.method} /{path} (docs/service.md lists "
                                      "the calls it serves and those it does not)", "field": f"/{path}",
                             "category": "user"}, status_code=404)
    return app


class PlanRequest(pydantic.BaseModel):
    """rlgraph's extension `POST /rlgraph/v1/plan`: a call's name and the settings its plan depends on."""

    model_config = pydantic.ConfigDict(extra="forbid")
    call: pydantic.StrictStr
    model_id: pydantic.StrictStr | None = None  # a training call's model (its adapter sizes the plan)
    loss_fn: pydantic.StrictStr = "cross_entropy"
    loss_fn_config: dict[str, float] | None = None
    adam_params: dict[str, float] | None = None
    num_samples: pydantic.StrictInt = 1
    sampling_params: dict[str, Any] | None = None
    prompt_length: pydantic.StrictInt = 1
    include_prompt_logprobs: pydantic.StrictBool = False


def _plan_routes(app: FastAPI, server: Server) -> None:
    service = server.service

    @app.post("/rlgraph/v1/plan")
    async def plan(request: Request) -> dict:
        """The compiled plans a call runs (`Service.plan`), as text; nothing runs."""
        owner = server.owner(request)
        body = parse(PlanRequest, await json_body(request))
        if body.call in ("forward", "forward_backward"):
            check_loss(body.loss_fn, body.loss_fn_config, registered=False)  # Tinker's losses only, as over HTTP
        if not 1 <= body.prompt_length <= service.limits.max_tokens:
            raise CallError(f"must be in 1..{service.limits.max_tokens} (the model's context), got {body.prompt_length}",
                            field="prompt_length")
        known = [field.name for field in attrs.fields(SampleParams)]
        unknown = sorted(set(body.sampling_params or {}) - set(known))
        if unknown:
            raise CallError(f"unknown sampling parameter {unknown[0]!r} (known: {', '.join(known)})",
                            field=f"sampling_params.{unknown[0]}")
        params = SampleParams(**body.sampling_params) if body.sampling_params is not None else None
        found = await server.run_sync(lambda: service.plan(
            body.call, owner=owner, model_id=body.model_id, loss_fn=body.loss_fn, loss_fn_config=body.loss_fn_config,
            adam_params=body.adam_params,
            num_samples=body.num_samples, sampling_params=params, prompt_length=body.prompt_length,
            include_prompt_logprobs=body.include_prompt_logprobs))
        return {"call": body.call, "plans": programs.describe(found), "text": programs.as_text(found)}


def _session_routes(app: FastAPI, server: Server) -> None:
    service = server.service

    @app.get("/api/v1/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.post("/api/v1/client/config")
    async def client_config(request: Request) -> dict:
        server.owner(request)
        # Plain API keys, serial forward_backward chunks (so a client's calls reach the scheduler in
        # order), no compression, per-request futures; chunks no larger than the server takes.
        return {"pjwt_auth_enabled": False, "use_pyqwest_transport": False, "parallel_fwdbwd_chunks": False,
                "proto_compress_fwdbwd": False, "sample_use_retrieve_futures": False,
                "sample_join_sampling_session": False, "custom_loss_server_side": False,
                "fwdbwd_max_chunk_len": service.limits.max_datums}

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config(request: Request) -> dict:
        server.owner(request)
        return {}

    @app.post("/api/v1/create_session")
    async def create_session(request: Request) -> dict:
        return {"type": "create_session", "session_id": server.new_session(server.owner(request))}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request) -> dict:
        owner, body = server.owner(request), await json_body(request)
        session_id = body.get("session_id") if isinstance(body, dict) else None
        # 410 stops the SDK's heartbeat (a session of a restarted server, or one past the key's quota)
        if not isinstance(session_id, str) or server.sessions.get(session_id) != owner:
            raise CallError(f"no live session {str(session_id)[:80]!r} for this API key (the server restarted?)",
                            field="session_id", status=410, fix="create a new ServiceClient")
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request) -> dict:
        server.session(server.owner(request), session_id)
        return {}

    @app.post("/api/v1/telemetry")
    async def telemetry(request: Request) -> dict:
        server.owner(request)
        return {"status": "accepted"}  # accepted and dropped: this server keeps no client telemetry

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities(request: Request) -> dict:
        server.owner(request)
        return {"supported_models": [{"model_name": service.base.name, "max_context_length": service.limits.max_tokens,
                                      "trainable": True, "sampleable": True}]}



def _future_routes(app: FastAPI, server: Server) -> None:
    @app.post("/api/v1/retrieve_future")
    async def retrieve(request: Request) -> Response:
        owner = server.owner(request)
        body = parse(types.FutureRetrieveRequest, await json_body(request))
        future, encode = server.request(owner, body.request_id)
        try:
            result = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), POLL_SECONDS)
        except asyncio.TimeoutError:
            return JSONResponse({"type": "try_again", "request_id": body.request_id, "queue_state": "active"})
        except CallError as error:
            return JSONResponse({"error": str(error), "category": "user"})
        except Exception as error:  # a bug or a resource failure of the server: said as such, no traceback
            return JSONResponse({"error": f"the server failed this call: {type(error).__name__}: {error}",
                                 "category": "server"})
        encoded = encode(result)
        if isinstance(encoded, bytes):
            return Response(encoded, media_type=PROTO)
        return JSONResponse(encoded)


def _training_routes(app: FastAPI, server: Server) -> None:
    service = server.service

    @app.post("/api/v1/create_model")
    async def create_model(request: Request) -> dict:
        owner = server.owner(request)
        body = parse(types.CreateModelRequest, await json_body(request))
        server.session(owner, body.session_id)
        service.check_base_model(body.base_model)
        if body.optimizer_config.type != "adamw":
            raise CallError(f"optimizer {body.optimizer_config.type!r} is not served here (AdamW only)",
                            field="optimizer_config.type", fix="leave optimizer out (AdamW)")
        config = body.lora_config or types.LoraConfig(rank=32)
        lora = LoraSpec(rank=config.rank, seed=0 if config.seed is None else config.seed, train_attn=config.train_attn,
                        train_mlp=config.train_mlp, train_unembed=config.train_unembed)
        model_id = f"{body.session_id}:train:{body.model_seq_id}"
        call = lambda: service.create_model(owner, model_id, body.base_model, lora)  # noqa: E731
        return server.submit(owner, model_id, call, lambda mid: {"model_id": mid, "type": "create_model"},
                             key=("create_model", model_id, body.model_seq_id), fingerprint=fingerprint(request),
                             model_id=model_id)

    @app.post("/api/v1/get_info")
    async def get_info(request: Request) -> dict:
        owner = server.owner(request)
        body = parse(types.GetInfoRequest, await json_body(request))
        return {"type": "get_info", **service.info(owner, body.model_id)}

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> dict:
        owner = server.owner(request)
        if PROTO not in request.headers.get("content-type", ""):
            raise CallError("forward_backward takes the SDK's protobuf body", field="Content-Type",
                            fix="use the tinker SDK's TrainingClient.forward_backward")
        raw = await request.body()

        def read() -> tuple[dict[str, Any], dict[str, float]]:  # on a thread: a big batch takes the loop no time
            body = wire.read_forward_backward(raw, service.limits)
            service.tenant(owner, body["model_id"])
            config = check_loss(body["loss_fn"], body["loss_fn_config"], registered=False)
            check_datums(body["data"], body["loss_fn"], service.limits)  # a bad batch is a 400 now, not a failed future
            return body, config
        body, config = await server.run_sync(read)
        model_id, name = body["model_id"], "forward" if body["forward_only"] else "forward_backward"
        call = lambda: service.forward(owner, model_id, body["data"], body["loss_fn"], config,  # noqa: E731
                                       backward=not body["forward_only"])
        return server.submit(owner, model_id, call, wire.forward_backward_output, key=call_key(name, model_id, body["seq_id"]),
                             fingerprint=body["fingerprint"], model_id=model_id, size=len(raw))

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request) -> dict:
        owner = server.owner(request)
        raw = await json_body(request)
        if not isinstance(raw, dict) or "adam_params" not in raw:
            raise CallError("optim_step takes adam_params (AdamW is the only optimizer served)", field="adam_params")
        adam = raw["adam_params"]
        if not isinstance(adam, dict):
            raise CallError(f"must be an object, got {adam!r}", field="adam_params")
        model_id, seq_id = raw.get("model_id"), raw.get("seq_id")
        service.tenant(owner, model_id)
        call_key("optim_step", model_id, seq_id)  # a bad seq_id is a 400 before anything else
        check_adam(adam)
        call = lambda: service.optim_step(owner, model_id, adam)  # noqa: E731
        return server.submit(owner, model_id, call, lambda metrics: {"metrics": metrics},
                             key=call_key("optim_step", model_id, seq_id), fingerprint=fingerprint(request),
                             model_id=model_id)



def _state_routes(app: FastAPI, server: Server) -> None:
    service = server.service

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request) -> dict:
        owner = server.owner(request)
        body = parse(types.SaveWeightsRequest, await json_body(request))
        service.tenant(owner, body.model_id)
        name = check_name(body.path or f"state-{uuid.uuid4().hex[:8]}", "path")
        call = lambda: service.save_state(owner, body.model_id, name, overwrite=body.overwrite)  # noqa: E731
        return server.submit(owner, body.model_id, call, lambda path: {"path": path, "type": "save_weights"},
                             key=call_key("save_weights", body.model_id, body.seq_id),
                             fingerprint=fingerprint(request), model_id=body.model_id)

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request) -> dict:
        owner = server.owner(request)
        body = parse(types.LoadWeightsRequest, await json_body(request))
        if body.model_id is None:  # create_training_client_from_state: a new model from the state
            server.session(owner, body.session_id)
            if body.base_model is not None:
                service.check_base_model(body.base_model)
            model_id = f"{body.session_id}:train:{body.model_seq_id}"
            service.store.check(owner, body.path, kinds=("weights",))
            call = lambda: service.create_from_state(owner, model_id, body.path, optimizer=body.optimizer)  # noqa: E731
            key = ("create_model", model_id, body.model_seq_id)
        else:
            model_id = body.model_id
            service.tenant(owner, model_id)
            service.store.check(owner, body.path, kinds=("weights",))
            call = lambda: service.load_state(owner, model_id, body.path, optimizer=body.optimizer)  # noqa: E731
            key = call_key("load_weights", model_id, body.seq_id)
        return server.submit(owner, model_id, call, lambda _: {"path": body.path, "model_id": model_id, "type": "load_weights"},
                             key=key, fingerprint=fingerprint(request), model_id=model_id)


def _sampling_routes(app: FastAPI, server: Server) -> None:
    service = server.service

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_for_sampler(request: Request) -> dict:
        owner = server.owner(request)
        body = parse(types.SaveWeightsForSamplerRequest, await json_body(request))
        service.tenant(owner, body.model_id)
        if body.path is not None:
            check_name(body.path, "path")
        session = body.model_id.split(":train:")[0]
        sampler_id = f"{session}:sample:{body.sampling_session_seq_id if body.path is None else uuid.uuid4().hex[:8]}"
        call = lambda: service.save_for_sampler(owner, body.model_id, sampler_id, body.path)  # noqa: E731
        encode = lambda result: {"path": result[0], "sampling_session_id": result[1],  # noqa: E731
                                 "type": "save_weights_for_sampler"}
        return server.submit(owner, body.model_id, call, encode, key=call_key("save_weights_for_sampler", body.model_id,
                                                                           body.seq_id),
                             fingerprint=fingerprint(request), model_id=body.model_id)

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict:
        owner = server.owner(request)
        body = parse(types.CreateSamplingSessionRequest, await json_body(request))
        server.session(owner, body.session_id)
        sampler_id = f"{body.session_id}:sample:{body.sampling_session_seq_id}"
        if body.model_path is not None:
            service.store.check(owner, body.model_path, "model_path")
        if sampler_id not in service.samplers:
            await server.run(owner, sampler_id, lambda: service.create_sampler(owner, sampler_id, model_path=body.model_path,
                                                                        base_model=body.base_model))
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    @app.get("/api/v1/samplers/{sampler_id}")
    async def sampler_info(sampler_id: str, request: Request) -> dict:
        sampler = service.sampler(server.owner(request), sampler_id)
        return {"sampler_id": sampler_id, "base_model": service.public_name, "model_path": sampler.model_path}

    @app.post("/api/v1/asample")
    async def asample(request: Request) -> dict:
        owner = server.owner(request)
        body = parse(types.SampleRequest, await json_body(request))
        if body.sampling_session_id is None:
            raise CallError("sample needs a sampling session (create a SamplingClient first)", field="sampling_session_id")
        service.sampler(owner, body.sampling_session_id)
        for name in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
            if getattr(body, name):
                raise CallError(f"{name} is not supported by this server", field=name, fix=f"{name}=0")
        if body.target_prompt_logprobs is not None or body.prompt_logprobs_last_n is not None:
            field = "target_prompt_logprobs" if body.target_prompt_logprobs is not None else "prompt_logprobs_last_n"
            raise CallError(f"{field} is not supported by this server", field=field)
        prompt = tokens_of(body.prompt, "prompt")
        p = body.sampling_params
        params = SampleParams(max_tokens=p.max_tokens, seed=p.seed, stop=p.stop, temperature=p.temperature,
                              top_k=p.top_k, top_p=p.top_p)
        steps = check_sample(params, body.num_samples, len(check_tokens(prompt, "prompt", service.limits)), service.limits)
        call = lambda: service.sample(owner, body.sampling_session_id, prompt, body.num_samples, params,  # noqa: E731
                                      prompt_logprobs=bool(body.prompt_logprobs))
        answer = server.submit(owner, body.sampling_session_id, call, wire.sample_response,
                               key=call_key("sample", body.sampling_session_id, body.seq_id),
                               fingerprint=fingerprint(request),  # its result: a token and a log-prob a step and sample
                               size=body.num_samples * (steps + len(prompt)) * 8)
        return {**answer, "sample_sequence_ids": [f"{answer['request_id']}:{i}" for i in range(body.num_samples)]}


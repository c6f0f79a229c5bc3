"""FastAPI routes of the OpenAI-compatible server."""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.bridge import EngineBridge, QueueFullError, RequestStream, Submission
from serving.middleware import ServerErrors
from serving.protocol import (APIError, ParsedRequest, bad, envelope, new_id, parse_chat, parse_completion,
                              resolve_speculation, tercel_stats, usage, validation_error)
from serving.schemas import ChatCompletion, ChatCompletionRequest, Completion, CompletionRequest, ErrorResponse
from verifier.sampling_params import SamplingParams

log = logging.getLogger("tercel.serve")
OPEN_PATHS = {"/health"}


@dataclass(frozen=True)
class ServerConfig:
    model_names: tuple[str, ...]      # names a client may send as "model"; the first is reported
    api_key: str | None = None


def build_app(bridge: EngineBridge, config: ServerConfig) -> FastAPI:
    app = FastAPI(title="Tercel", docs_url=None, redoc_url=None)
    engine = bridge.engine
    tokenizer = engine.tokenizer
    served = config.model_names[0]

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_, e: RequestValidationError):
        err = validation_error(e.errors())
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(e.status_code, str(e.detail), type_=kind).body(), status_code=e.status_code)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if config.api_key and request.url.path not in OPEN_PATHS:
            if request.headers.get("authorization", "") != f"Bearer {config.api_key}":
                err = APIError(401, "missing or invalid API key (Authorization: Bearer <key>)",
                               type_="authentication_error", code="invalid_api_key")
                return JSONResponse(err.body(), status_code=401)
        return await call_next(request)

    @app.get("/health")
    async def health():
        if not bridge.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(bridge.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        # As vLLM's endpoint of the same name: benchmarks start each run with a cold cache.
        if not bridge.alive:
            raise APIError(503, "the engine is not running", type_="server_error")
        return {"dropped_blocks": await bridge.reset_prefix_cache()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served, "object": "model", "created": 0, "owned_by": "tercel"}]}

    @app.post("/v1/chat/completions", response_model=None, responses=_responses(ChatCompletion))
    async def chat(request: Request, body: ChatCompletionRequest):
        req = parse_chat(body)
        _check_model(req.model)
        try:
            ids = tokenizer.apply_chat_template(req.prompts[0])
        except ValueError as e:
            raise bad("messages", str(e)) from None
        return await _generate(request, req, [ids], chat=True)

    @app.post("/v1/completions", response_model=None, responses=_responses(Completion))
    async def completions(request: Request, body: CompletionRequest):
        req = parse_completion(body)
        _check_model(req.model)
        try:
            ids = [engine.tokenize(p) for p in req.prompts]
        except ValueError as e:
            raise bad("prompt", str(e)) from None
        return await _generate(request, req, ids, chat=False)

    def _check_model(name: str) -> None:
        if name not in config.model_names:
            raise APIError(404, f"model {name!r} does not exist; this server serves {served!r}",
                           param="model", type_="not_found_error", code="model_not_found")

    def _params(req: ParsedRequest, ids: list[int], choice: int, chat: bool) -> SamplingParams:
        max_tokens = req.max_tokens or max(1, engine.max_model_len - len(ids))
        seed = req.sampling["seed"]
        sampling = {**req.sampling, "seed": None if seed is None else seed + choice}
        try:
            params = SamplingParams(max_tokens=max_tokens, **sampling)
            engine.validate(ids, params)          # context length, token ids: before any stream starts
        except ValueError as e:
            prompt = "messages" if chat else "prompt"
            param = "max_tokens" if "max_tokens" in str(e) else prompt if "prompt" in str(e) else None
            code = "context_length_exceeded" if "context length" in str(e) else None
            raise APIError(400, str(e), param=param, code=code) from None
        return params

    async def _generate(request: Request, req: ParsedRequest, prompt_ids: list[list[int]], chat: bool):
        # Everything a request can get wrong is refused here, before the response starts.
        spec = resolve_speculation(req.speculation, engine.spec_config, engine.config.drafter)
        jobs = [(p, i * req.n + c) for i, p in enumerate(prompt_ids) for c in range(req.n)]
        params = [_params(req, ids, idx, chat) for ids, idx in jobs]
        streams: list[RequestStream] = []
        try:
            for (ids, _), p in zip(jobs, params):
                streams.append(bridge.submit(Submission(ids, p, spec.speculate, spec.tree)))
        except QueueFullError as e:
            for s in streams:
                s.cancel()
            bridge.metrics.errors.labels(reason="queue_full").inc()
            raise APIError(429, f"server busy: {e}", type_="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        rid = new_id("chatcmpl" if chat else "cmpl")
        if req.stream:
            return EventSourceResponse(_sse(streams, rid, req, chat), ping=15)
        return await _complete(streams, rid, req, chat)

    async def _complete(streams, rid, req, chat):
        try:
            finals = await asyncio.gather(*(_last(s) for s in streams))
        except ValueError as e:
            raise bad(None, str(e)) from None
        except RuntimeError as e:      # engine failure or shutdown: an OpenAI-shaped 503, not a bare 500
            raise APIError(503, str(e), type_="server_error", code="engine_unavailable") from None
        finally:
            for s in streams:
                s.cancel()
        choices = [_choice(i, o, chat) for i, o in enumerate(finals)]
        prompt_tokens = sum(s.num_prompt_tokens for s in streams) // max(1, req.n)   # each prompt once
        return envelope("chat.completion" if chat else "text_completion", rid, served, choices,
                        usage=usage(prompt_tokens, sum(len(o.token_ids) for o in finals)),
                        tercel=tercel_stats(finals))

    async def _sse(streams, rid, req, chat):
        kind = "chat.completion.chunk" if chat else "text_completion"
        merged: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(_pump(i, s, merged)) for i, s in enumerate(streams)]
        finals, open_streams = {}, len(streams)
        try:
            if chat:
                for i in range(len(streams)):
                    yield _data(envelope(kind, rid, served, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                              "logprobs": None, "finish_reason": None}]))
            while open_streams:
                i, out = await merged.get()
                if isinstance(out, Exception):
                    yield _data({"error": APIError(500, str(out), type_="server_error").body()["error"]})
                    break
                if out.delta_text:
                    yield _data(envelope(kind, rid, served, [_delta(i, out.delta_text, None, chat)]))
                if out.finished:
                    finals[i] = out
                    open_streams -= 1
                    yield _data(envelope(kind, rid, served, [_delta(i, "", out.finish_reason, chat)]))
            if req.include_usage:
                outs = list(finals.values())
                prompt_tokens = sum(s.num_prompt_tokens for s in streams) // max(1, req.n)
                yield _data(envelope(kind, rid, served, [], usage=usage(prompt_tokens, sum(len(o.token_ids) for o in outs)),
                                     tercel=tercel_stats(outs)))
            yield {"data": "[DONE]"}
        finally:   # normal end, client disconnect (CancelledError) or error: free the engine's blocks
            for s in streams:
                s.cancel()
            for t in tasks:
                t.cancel()

    app.add_middleware(ServerErrors)   # added last: the outermost layer
    app.openapi = lambda: _openapi(app)
    return app


async def _last(stream: RequestStream):
    out = None
    async for out in stream:
        pass
    return out


async def _pump(i: int, stream: RequestStream, merged: asyncio.Queue) -> None:
    try:
        async for out in stream:
            await merged.put((i, out))
    except Exception as e:   # noqa: BLE001 - forwarded to the client as an error event
        await merged.put((i, e))


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema without its 422: validation errors are answered 400 (`validation_error`)."""
    if app.openapi_schema is None:
        schema = FastAPI.openapi(app)
        for route in schema["paths"].values():
            for op in route.values():
                op.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
    return app.openapi_schema


def _responses(ok_model) -> dict:
    """The statuses a generation route answers, for /openapi.json: the 200 body (or an SSE
    stream when "stream" is true) and the OpenAI error body of every refusal."""
    # Before OpenAPI 3.2 (FastAPI writes 3.1), a text/event-stream schema describes one event.
    event = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string", "description": "a chunk as JSON; the last event is [DONE]"},
                            "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}
    sse = {"text/event-stream": {"schema": event}}
    errors = {400: "invalid request", 401: "missing or invalid API key", 404: "unknown model",
              429: "queue full (Retry-After)", 500: "unexpected server error", 503: "engine unavailable"}
    return {200: {"model": ok_model, "content": sse},
            **{code: {"model": ErrorResponse, "description": text} for code, text in errors.items()}}


def _data(obj: dict) -> dict:
    return {"data": json.dumps(obj, ensure_ascii=False)}


def _choice(i: int, out, chat: bool) -> dict:
    if chat:
        return {"index": i, "message": {"role": "assistant", "content": out.text}, "logprobs": None,
                "finish_reason": out.finish_reason}
    return {"index": i, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason}


def _delta(i: int, text: str, finish: str | None, chat: bool) -> dict:
    if chat:
        return {"index": i, "delta": {"content": text} if text else {}, "logprobs": None, "finish_reason": finish}
    return {"index": i, "text": text, "logprobs": None, "finish_reason": finish}

"""The HTTP routes of the OpenAI-compatible server.

`build_app` wires three parts: the routes (`Routes`, here), the replies they return or stream
(serving/streaming.py) and the errors as OpenAI bodies (serving/errors.py); request bodies
are validated against serving/schemas.py and parsed in serving/protocol.py. The routes never
call the engine: everything goes through the bridge (serving/bridge.py), and on the event
loop they read only what the bridge makes safe there, its frozen `limits`, its `tokenizer`
and its own state.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import threading
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool
from sse_starlette.sse import EventSourceResponse

from serving.bridge import EngineBridge, EngineUnavailable, QueueFullError, RequestStream
from serving.chat_prompt import ChatPrompt
from serving.defaults import SamplingDefaults
from serving.disconnect import until_disconnected
from serving.errors import BEARER, X_API_KEY, engine_stopped, engine_unavailable, error_response, \
    install_error_handlers, queue_full, refused, unauthorized, unknown_model
from serving.fields import check_fields, check_sampling
from serving.flags import LoraServing
from serving.limits import BodyLimit, ServerLimits
from serving.logprobs import TokenPieces
from serving.lora_routes import LoraRoutes
from serving.messages.errors import is_messages
from serving.messages.routes import MessagesRoutes
from serving.messages.schemas import ErrorResponse as AnthropicError, Message, TokenCount
from serving.middleware import ServerErrors
from serving.prediction import check_predictions, tokenized
from serving.protocol import APIError, ParsedRequest, bad, new_id, parse_chat, parse_completion, resolve_speculation
from serving.reasoning import ReasoningFormat, ReasoningParser, thinking_budget
from serving.responses.routes import ResponsesRoutes
from serving.responses.schemas import DeletedResponse, ResponseObject
from serving.responses.store import ResponseStore, StoreLimits
from serving.schemas import ChatCompletion, ChatCompletionRequest, Completion, CompletionRequest, \
    DetokenizeResponse, ErrorResponse, ModelCard, ModelList, TokenizeResponse, VersionResponse
from serving.streaming import Reply, full_reply, sse_events
from serving.tools.formats import HERMES, ToolFormat
from serving.utility_routes import ServedModels, UtilityRoutes
from spec.request import Submission
from verifier.model.tokenizer import prompt_ids
from verifier.sampling.sampling_params import SamplingParams

OPEN_PATHS = {"/health"}


@dataclass(frozen=True)
class ServerConfig:
    model_names: tuple[str, ...]      # names a client may send as "model"; the first is reported
    api_key: str | None = None
    limits: ServerLimits = field(default_factory=ServerLimits)
    allowed_origins: tuple[str, ...] = ()   # CORS for browser clients; none: no CORS headers at all
    special_tokens_in_content: bool = False  # parse `<|im_start|>` in messages as a token (unsafe)
    tool_format: ToolFormat = HERMES          # how the model writes tool calls (--tool-call-parser)
    chat_template: str | None = None          # replaces the model's chat template (--chat-template)
    reasoning: ReasoningFormat | None = None  # splits reasoning from content (--reasoning-parser)
    # what requests that leave sampling fields out get (the model's generation_config.json)
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    lora: LoraServing = LoraServing()         # LoRA adapters under their own names (serving/lora_routes.py)
    responses: StoreLimits = StoreLimits()    # stored responses (--responses-max-stored, --responses-ttl)


def build_app(bridge: EngineBridge, config: ServerConfig) -> FastAPI:
    app = FastAPI(title="Tercel", docs_url=None, redoc_url=None)
    bridge.metrics.model_name = bridge.metrics.model_name or config.model_names[0]
    install_error_handlers(app)
    routes = Routes(bridge, config)
    app.middleware("http")(routes.authorize)
    app.get("/health")(routes.health)
    app.get("/metrics")(routes.metrics)
    app.post("/reset_prefix_cache")(routes.reset_prefix_cache)
    app.get("/v1/models", response_model=ModelList)(routes.models)
    more = UtilityRoutes(routes.served, bridge.limits, bridge.tokenizer, routes.chat_prompt)
    app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_errors(404))(more.model)
    app.get("/version", response_model=VersionResponse)(more.version)
    app.post("/tokenize", response_model=TokenizeResponse, responses=_errors(400, 404))(more.tokenize)
    app.post("/detokenize", response_model=DetokenizeResponse, responses=_errors(400, 404))(more.detokenize)
    app.post("/v1/chat/completions", response_model=None, responses=_responses(ChatCompletion))(routes.chat)
    app.post("/v1/completions", response_model=None, responses=_responses(Completion))(routes.completions)
    messages = MessagesRoutes(routes)
    app.post("/v1/messages", response_model=None,
             responses=_responses(Message, AnthropicError, MESSAGE_EVENT))(messages.create)
    app.post("/v1/messages/count_tokens", response_model=TokenCount,
             responses=_errors(400, 404, model=AnthropicError))(messages.count_tokens)
    responses = ResponsesRoutes(routes, ResponseStore(config.responses))
    app.post("/v1/responses", response_model=None, responses=_responses(ResponseObject, event_data=RESPONSES_EVENT))(
        responses.create)
    stored = {200: {"model": ResponseObject}, 404: {"model": ErrorResponse, "description": "no stored response"}}
    app.get("/v1/responses/{response_id}", response_model=None, responses=stored)(responses.get)
    app.delete("/v1/responses/{response_id}", response_model=None,
               responses={**stored, 200: {"model": DeletedResponse}})(responses.delete)
    if config.lora.allow_runtime:
        lora = LoraRoutes(bridge, routes.served, config.lora)
        app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=_errors(400))(lora.load)
        app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=_errors(404))(lora.unload)
    app.add_middleware(BodyLimit, limit=config.limits.max_body_bytes)
    if config.allowed_origins:      # outside BodyLimit: a 413 still carries the CORS headers
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["x-request-id"])
    app.add_middleware(ServerErrors)   # added last: the outermost layer
    app.openapi = lambda: _openapi(app)
    return app


class Routes:
    """The handlers of one app. Everything a request can get wrong is refused before its
    reply starts: the model name, the prompt (tokenized here), the sampling parameters and
    the speculation settings against the engine's limits, then the queue."""

    def __init__(self, bridge: EngineBridge, config: ServerConfig):
        self.bridge, self.config = bridge, config
        self.served = ServedModels(config.model_names, config.lora.modules)
        self._expected = f"Bearer {config.api_key}".encode() if config.api_key else None
        self._token_chars = longest_token(bridge.tokenizer)
        self._pieces = TokenPieces(bridge.tokenizer)     # token texts for logprobs, cached across requests
        tok = bridge.tokenizer if config.chat_template is None else bridge.tokenizer.with_chat_template(
            config.chat_template)
        self.chat_prompt = ChatPrompt(tok, config.tool_format, config.special_tokens_in_content)

    async def authorize(self, request: Request, call_next):
        path = request.url.path
        if self._expected is not None and path not in OPEN_PATHS and request.method != "OPTIONS":
            messages = is_messages(path)
            if not self._key_matches(request, messages):
                return error_response(path, unauthorized(X_API_KEY if messages else BEARER))
        return await call_next(request)

    def _key_matches(self, request: Request, messages: bool) -> bool:
        """`Authorization: Bearer <key>`, or on the Messages routes `x-api-key: <key>` (the
        anthropic SDK's header). Constant time: no key by timing."""
        given = [request.headers.get("authorization", "")]
        if messages:
            given.append(f"Bearer {request.headers.get('x-api-key', '')}")
        return any([hmac.compare_digest(g.encode("latin-1", "replace"), self._expected) for g in given])

    async def health(self):
        problem = self.bridge.problem
        if problem is not None:
            return JSONResponse({"status": problem}, status_code=503)
        st = self.bridge.stats
        return {"status": "ok", "threads": st.threads, "max_threads": st.max_threads}

    async def metrics(self):
        return Response(self.bridge.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def reset_prefix_cache(self):
        # As vLLM's endpoint of the same name: benchmarks start each run with a cold cache.
        if not self.bridge.alive:
            raise engine_stopped()
        return {"dropped_blocks": await self.bridge.reset_prefix_cache()}

    async def models(self):
        return {"object": "list", "data": self.served.cards()}

    async def chat(self, body: ChatCompletionRequest, request: Request):
        req = self.parsed_chat(body)
        return await until_disconnected(request, self._chat(req, body.chat_template_kwargs))

    def parsed_chat(self, body: ChatCompletionRequest) -> ParsedRequest:
        """A chat request checked as far as it can be before tokenizing (the Messages API's
        bodies, converted to chat requests, pass here too)."""
        check_fields(body, chat=True)
        req = parse_chat(self.config.sampling_defaults.apply(body), self.config.tool_format,
                         self.bridge.limits.max_model_len, self.config.reasoning)
        self._check(req, [m["content"] or "" for m in req.prompts[0]], "messages")
        return self._budgeted(req, body.thinking_token_budget)

    def _budgeted(self, req: ParsedRequest, tokens: int | None) -> ParsedRequest:
        """`req` with its thinking budget (`thinking_token_budget`), which needs the server's reasoning format."""
        if tokens is None:
            return req
        if self.config.reasoning is None:
            raise bad("thinking_token_budget", "'thinking_token_budget' needs a reasoning format: this server was "
                                               "started without --reasoning-parser")
        budget = thinking_budget(self.config.reasoning, self.bridge.tokenizer, tokens)
        return dataclasses.replace(req, params=dataclasses.replace(req.params, thinking=budget))

    async def chat_ids(self, req: ParsedRequest, template_kwargs: dict | None) -> list[int]:
        try:    # off the event loop: a long prompt takes seconds to tokenize
            return await run_in_threadpool(self.chat_prompt.ids, req.prompts[0], req.tools, True, template_kwargs)
        except ValueError as e:
            raise bad("messages", str(e)) from None

    async def _chat(self, req: ParsedRequest, template_kwargs: dict | None):
        return await self._generate(req, [await self.chat_ids(req, template_kwargs)], chat=True)

    async def completions(self, body: CompletionRequest, request: Request):
        check_fields(body, chat=False)
        req = parse_completion(self.config.sampling_defaults.apply(body), self.bridge.limits.max_model_len)
        self._check(req, [p for p in req.prompts if isinstance(p, str)], "prompt")
        return await until_disconnected(request, self._completions(req))

    async def _completions(self, req: ParsedRequest):
        tok = self.bridge.tokenizer
        try:
            ids = await run_in_threadpool(lambda: [prompt_ids(tok, p) for p in req.prompts])
        except ValueError as e:
            raise bad("prompt", str(e)) from None
        return await self._generate(req, ids, chat=False)

    def _check(self, req: ParsedRequest, texts: list[str], param: str) -> None:
        """What can be refused before tokenizing: the model, the stop strings, and a prompt so
        long that even at the vocabulary's longest token it would not fit the context."""
        if req.model not in self.served:
            raise unknown_model(req.model, self.served.first)
        self.config.limits.check_stop(req.params.stop)
        check_sampling(req, self.bridge.limits)
        if self._token_chars:
            context = self.bridge.limits.max_model_len
            for text in texts:
                least = len(text) // self._token_chars
                if least >= context:
                    raise APIError(400, f"the prompt is at least {least} tokens, and this model's context length "
                                        f"is {context} tokens", param=param, code="context_length_exceeded")

    async def _generate(self, req: ParsedRequest, prompt_ids: list[list[int]], chat: bool):
        reply, streams = await self.start(req, prompt_ids, chat)
        if req.stream:
            return EventSourceResponse(sse_events(reply, streams), ping=15,
                                       send_timeout=self.config.limits.send_timeout_s)
        return await full_reply(reply, streams)

    async def start(self, req: ParsedRequest, prompt_ids: list[list[int]],
                    chat: bool) -> tuple[Reply, list[RequestStream]]:
        """Submit every choice of every prompt (all or none), after the last refusals: the
        speculation asked, the constraint compiled, the prediction and each prompt's params
        checked. The reply's description and one stream per choice; any route renders them."""
        limits = self.bridge.limits
        spec = resolve_speculation(req.speculation, limits.speculation, limits.drafter)
        grammar = await self._compile(req) if req.params.structured is not None else None
        prediction = await tokenized(req.prediction, self.bridge.tokenizer) if req.prediction is not None else None
        jobs = [(ids, i * req.n + c) for i, ids in enumerate(prompt_ids) for c in range(req.n)]
        lora = self.served.adapter(req.model)
        subs = [Submission(ids, self._params(req, ids, choice, chat), spec.speculate, spec.tree, grammar, prediction,
                           lora) for ids, choice in jobs]
        if prediction is not None:
            check_predictions(limits, subs)
        streams = self._submit(subs)
        calls = self.config.tool_format if req.tool_choice.mode != "none" else None
        pieces = self._pieces if req.params.logprobs is not None or req.echo else None
        reasoning = ReasoningParser(self.config.reasoning, self.bridge.tokenizer) \
            if chat and self.config.reasoning is not None else None
        reply = Reply(new_id("chatcmpl" if chat else "cmpl"), lora or self.served.first, chat, req.n,
                      req.include_usage, calls, pieces, req.echo, predicted=prediction is not None,
                      reasoning=reasoning)
        return reply, streams

    async def _compile(self, req: ParsedRequest):
        """Compile (and cache) the constraint off the event loop: a bad, too large, too slow or
        empty grammar is a 400 naming its field before any byte; a client that leaves cancels it."""
        cancel = threading.Event()
        try:
            return await run_in_threadpool(self.bridge.grammars.compile, req.params.structured, cancel)
        except ValueError as e:
            raise bad(req.structured_param, str(e)) from None
        except asyncio.CancelledError:
            cancel.set()
            raise

    def _params(self, req: ParsedRequest, ids: list[int], choice: int, chat: bool) -> SamplingParams:
        limits = self.bridge.limits
        params = req.for_prompt(len(ids), choice, limits.max_model_len)
        try:
            limits.validate(ids, params)          # context length, token ids: before any stream starts
        except ValueError as e:
            raise refused(e, chat) from None
        return params

    def _submit(self, subs: list[Submission]) -> list[RequestStream]:
        """All or none: when the queue is full, the ones already in are cancelled (429)."""
        streams: list[RequestStream] = []
        try:
            for sub in subs:
                streams.append(self.bridge.submit(sub))
        except EngineUnavailable as e:
            for s in streams:
                s.cancel()
            raise engine_unavailable(e) from None
        except QueueFullError as e:
            for s in streams:
                s.cancel()
            self.bridge.metrics.errors.labels(reason="queue_full").inc()
            raise queue_full(e) from None
        return streams


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


def _errors(*codes: int, model=ErrorResponse) -> dict:
    """Error bodies (OpenAI's, unless `model`) for /openapi.json, by status."""
    text = {400: "invalid request", 404: "unknown model"}
    return {code: {"model": model, "description": text[code]} for code in codes}


CHAT_EVENT = "a chunk as JSON; the last event is [DONE]"
RESPONSES_EVENT = ("an event as JSON, its `type` also the SSE event's name (response.created, "
                   "response.output_text.delta, ..., response.completed); no [DONE]")
MESSAGE_EVENT = ("an event as JSON, named by `event`: message_start, content_block_start, content_block_delta, "
                 "content_block_stop, message_delta, message_stop, or error")


def _responses(ok_model, error_model=ErrorResponse, event_data: str = CHAT_EVENT) -> dict:
    """The statuses a generation route answers, for /openapi.json: the 200 body (or an SSE
    stream when "stream" is true) and the error body of every refusal."""
    # Before OpenAPI 3.2 (FastAPI writes 3.1), a text/event-stream schema describes one event.
    event = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string", "description": event_data},
                            "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}
    sse = {"text/event-stream": {"schema": event}}
    errors = {400: "invalid request", 401: "missing or invalid API key", 404: "unknown model",
              413: "request body too large", 429: "queue full (Retry-After)", 500: "unexpected server error",
              503: "engine unavailable"}
    return {200: {"model": ok_model, "content": sse},
            **{code: {"model": error_model, "description": text} for code, text in errors.items()}}


def longest_token(tokenizer) -> int | None:
    """Characters in the vocabulary's longest token (its stored spelling, at least the text it
    covers), or None without a vocabulary: a text of c characters is then at least c / that
    many tokens."""
    vocab = getattr(tokenizer, "vocab", None)
    return max((len(t) for t in vocab), default=None) if vocab else None

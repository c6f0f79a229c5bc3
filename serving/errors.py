"""Errors as OpenAI sends them: every refusal is `{"error": {"message", "type", "param",
"code"}}` with its status, and no exception handler of FastAPI's own answers a client.

The statuses, all decided before a reply starts (a stream that fails later ends with an
error event, see serving/streaming.py): 400 a request the server can never run, 401 a
missing or wrong API key, 404 an unknown model or path, 429 a full queue (Retry-After),
503 an engine that failed or is stopping, or (behind Ray Serve) a replica that died under the request. Anything else escapes to serving/middleware.py,
which answers 500. The Messages API's routes answer the same statuses in Anthropic's shape
(serving/messages/errors.py): `error_body` picks the shape by the request's path.
"""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.bridge import EngineUnavailable, RequestFailed
from serving.messages.errors import anthropic_body, is_messages, messages_validation_error
from serving.protocol import APIError, validation_error


def install_error_handlers(app: FastAPI) -> None:
    """APIError as its own body; FastAPI's 422 as a 400; Starlette's 404/405 in OpenAI's shape."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(StarletteHTTPException, _http)


def error_body(path: str, e: APIError) -> dict:
    """The body of `e` as the route at `path` writes errors."""
    return anthropic_body(e) if is_messages(path) else e.body()


def error_response(path: str, e: APIError) -> JSONResponse:
    return JSONResponse(error_body(path, e), status_code=e.status, headers=e.headers)


async def _api_error(request: Request, e: APIError) -> JSONResponse:
    return error_response(request.url.path, e)


async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
    path = request.url.path
    return error_response(path, messages_validation_error(e.errors()) if is_messages(path)
                          else validation_error(e.errors()))


async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return error_response(request.url.path, APIError(e.status_code, str(e.detail), type_=kind))


BEARER = "Authorization: Bearer <key>"
X_API_KEY = "x-api-key: <key>, or Authorization: Bearer <key>"     # the Messages routes take either


def unauthorized(header: str = BEARER) -> APIError:
    return APIError(401, f"missing or invalid API key ({header})", type_="authentication_error",
                    code="invalid_api_key")


def unknown_model(name: str, served: str) -> APIError:
    return APIError(404, f"model {name!r} does not exist; this server serves {served!r}",
                    param="model", type_="not_found_error", code="model_not_found")


def refused(e: ValueError, chat: bool) -> APIError:
    """A prompt and sampling params the engine can never run (EngineLimits.validate, SamplingParams):
    400, naming the parameter at fault where the message does."""
    message = str(e)
    prompt = "messages" if chat else "prompt"
    param = "max_tokens" if "max_tokens" in message else prompt if "prompt" in message else None
    code = "context_length_exceeded" if "context length" in message else None
    return APIError(400, message, param=param, code=code)


def queue_full(e: Exception) -> APIError:
    return APIError(429, f"server busy: {e}", type_="rate_limit_error", code="queue_full",
                    headers={"Retry-After": "1"})


def engine_unavailable(e: Exception) -> APIError:
    """The engine stopped, failed a step no request owned, or is stopping: a 503, not a bare
    500. Only an EngineUnavailable's own message reaches the client; anything else is logged."""
    return APIError(503, _safe(e, "the engine is unavailable"), type_="server_error", code="engine_unavailable")


def request_failed(e: RequestFailed) -> APIError:
    """The engine failed this request alone: its own fault is a 400 saying what, an engine bug
    its data reached a 500 (the details are in the server's log, under the request's id)."""
    if e.error.invalid:
        return APIError(400, e.error.message, code="request_failed")
    return APIError(500, INTERNAL, type_="server_error", code="internal_error")


def _safe(e: Exception, fallback: str) -> str:
    return str(e) if isinstance(e, EngineUnavailable) else fallback


INTERNAL = "the server failed while running this request; the server logged it"


def replica_lost(e: Exception) -> APIError:
    """A Ray Serve replica died (or became unreachable) while it ran the request: a 503, as the
    request may be retried; Ray Serve restarts the replica and routes new requests elsewhere."""
    return APIError(503, f"the replica running this request was lost; retry it ({type(e).__name__})",
                    type_="server_error", code="replica_unavailable")


def engine_stopped() -> APIError:
    return APIError(503, "the engine is not running", type_="server_error")


def stream_error(e: Exception) -> dict:
    """The `error` object of the event that ends a stream whose request failed once under way:
    no internal exception text, which stays in the server's log."""
    return stream_failure(e).body()["error"]


def stream_failure(e: Exception) -> APIError:
    """A stream's failure once under way as the error its event carries (any route's shape)."""
    if isinstance(e, RequestFailed):
        return request_failed(e)
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    return engine_unavailable(e)

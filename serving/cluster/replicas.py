"""Tercel as a Ray Serve application: N engine replicas behind one ingress, routed by prefix.

    client -> Serve's HTTP proxy -> TercelIngress (FastAPI, forwards)
           -> DeploymentHandle, routed by serving/cluster/prefix_router.py -> TercelReplica x N

the shape of Ray Serve LLM (an OpenAI ingress in front of engine deployments): the router must see
the prompt, and Serve's proxy hands a deployment only the ASGI scope, so the ingress reads the
body, computes the prefix key and calls the engine deployment with a `ForwardedRequest`.

Each TercelReplica holds one engine and the app `tercel serve` runs (serving/server.py:launch_app),
and runs every forwarded request through it in-process (serving/cluster/asgi_call.py): routes, 4xx
refusals, SSE and errors are the single-process server's own. Its replies carry the header
`x-tercel-replica`. Ray Serve restarts a replica whose actor dies or whose health check
(`check_health`: the engine thread is alive and its KV pool sound) fails; a request under way
on it gets a 503 in OpenAI's shape, or, once its stream has begun, a last error event.

/metrics, /health and /reset_prefix_cache go to every replica (`DeploymentHandle.broadcast`):
/metrics is every replica's series with a `replica` label, plus the routers' decisions;
/health is 200 while one replica is healthy. `app_builder` is the entry for `serve run` and a
Serve config file (deploy/serve_config.yaml); `tercel serve --replicas N` builds the same app.
"""
import argparse
import json   # no `from __future__ import annotations`: serve.ingress needs real annotations (Request)
import logging
import math
import os
import signal
import threading

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
import ray
from prometheus_client import generate_latest
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from serving.cluster import prefix_router   # a module: pickled by reference, so /metrics reads the live routers' counts
from serving.cluster.asgi_call import REPLICA_HEADER, ForwardedRequest, FullResponse, call_asgi, full_response
from serving.cluster.flags import APP_NAME, affinity_config
from serving.errors import install_error_handlers, replica_lost
from serving.metrics import merge_replica_metrics
from serving.middleware import ServerErrors
from serving.cluster.prefix_index import prefix_text
from serving.cluster.prefix_router import PrefixAffinityRouter
from serving.server import launch_app, parse_serve_args

log = logging.getLogger("tercel.serve")

REPLICA_LOST = (RayActorError, ActorUnavailableError)   # the replica died or cannot be reached
BROADCAST_TIMEOUT_S = 30.0
_HOP_HEADERS = {b"content-length", b"transfer-encoding", b"connection"}


class TercelReplica:
    """One engine, and serving/app.py's app run in-process on each forwarded request."""

    def __init__(self, args):
        self.bridge, self.app = launch_app(args)
        self.replica = serve.get_replica_context().replica_id.unique_id
        self._tag = ((REPLICA_HEADER, self.replica.encode()),)

    async def stream(self, req: ForwardedRequest):
        """ResponseStart, then the body chunks (an SSE event each for a stream)."""
        async for item in call_asgi(self.app, req, self._tag):
            yield item

    async def call(self, req: ForwardedRequest) -> FullResponse:
        return await full_response(self.app, req, self.replica)

    def check_health(self) -> None:
        """Ray Serve's health check: raising makes it replace this replica."""
        if (problem := self.bridge.problem) is not None:
            raise RuntimeError(problem)

    def __del__(self):   # Serve calls it once the replica has drained
        self.bridge.shutdown(0)


async def _forwarded(request: Request) -> ForwardedRequest:
    body = await request.body()
    return ForwardedRequest(request.method, request.url.path, request.url.query.encode(),
                            tuple(request.headers.raw), body, _prefix_key(body))


def _prefix_key(body: bytes) -> str:
    try:
        parsed = json.loads(body) if body else None
    except ValueError:        # the replica answers the 400
        return ""
    return prefix_text(parsed) if isinstance(parsed, dict) else ""


async def _relay(gen):
    try:
        async for chunk in gen:
            yield chunk
    except REPLICA_LOST as e:   # the stream has begun: its status is sent, so end with an error event
        yield f"data: {json.dumps(replica_lost(e).body())}\n\n".encode()
    finally:
        gen.cancel()            # the client left: the replica's stream is cancelled, its engine requests aborted


def _headers(raw) -> dict[str, str]:
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in raw if k.lower() not in _HOP_HEADERS}


def _refusal(replies: list[FullResponse]) -> Response | None:
    """The first replica's refusal (a 401 without the API key), as it sent it; None if all said 200."""
    for r in replies:
        if r.status != 200:
            return Response(r.body, status_code=r.status, headers=_headers(r.headers))
    return None


# serve.ingress pickles the app's routes when it decorates the class: what they call is defined above.
# No schema of its own: /openapi.json is forwarded, so clients see the replicas' (serving/app.py).
api = FastAPI(title="Tercel (Ray Serve ingress)", docs_url=None, redoc_url=None, openapi_url=None)
install_error_handlers(api)     # a 405 or a bad path in OpenAI's shape, as the replicas answer them
api.add_middleware(ServerErrors)   # an unexpected exception: a 500 with OpenAI's body and the request id


@serve.ingress(api)
class TercelIngress:
    def __init__(self, engine: DeploymentHandle):
        self.engine = engine

    @api.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        replies = await self._broadcast(request)
        if (refusal := _refusal(replies)) is not None:
            return refusal
        text = merge_replica_metrics({r.replica: r.body.decode() for r in replies})
        text += generate_latest(prefix_router.ROUTER_REGISTRY)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @api.get("/health")
    async def health(self, request: Request) -> JSONResponse:
        replies = await self._broadcast(request)
        states = {r.replica: json.loads(r.body).get("status") for r in replies}
        ok = any(r.status == 200 for r in replies)
        return JSONResponse({"status": "ok" if ok else "no healthy replica", "replicas": states},
                            status_code=200 if ok else 503)

    @api.post("/reset_prefix_cache")
    async def reset_prefix_cache(self, request: Request) -> Response:
        replies = await self._broadcast(request)
        if (refusal := _refusal(replies)) is not None:
            return refusal
        return JSONResponse({"dropped_blocks": sum(json.loads(r.body)["dropped_blocks"] for r in replies)})

    @api.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(self, request: Request, path: str) -> Response:
        """Any other route, to the replica the router picks; a stream is relayed as it comes."""
        gen = self.engine.options(stream=True).stream.remote(await _forwarded(request))
        try:
            start = await gen.__anext__()
            if start.is_stream:
                return StreamingResponse(_relay(gen), status_code=start.status, headers=_headers(start.headers))
            body = b"".join([chunk async for chunk in gen])
        except REPLICA_LOST as e:
            gen.cancel()
            err = replica_lost(e)
            return JSONResponse(err.body(), status_code=err.status)
        except BaseException:   # cancelled (the client left) or failed: the replica stops working on it
            gen.cancel()
            raise
        return Response(body, status_code=start.status, headers=_headers(start.headers))

    async def _broadcast(self, request: Request) -> list[FullResponse]:
        """The same request on every live replica; the ones that fail are left out."""
        replies = await self.engine.broadcast("call", await _forwarded(request)).results_async(
            timeout_s=BROADCAST_TIMEOUT_S, return_exceptions=True)
        return [r for r in replies if isinstance(r, FullResponse)]


def router_config(args) -> "RequestRouterConfig | None":
    """Prefix affinity, or None for Ray's default (power of two choices by queue length)."""
    if args.routing != "prefix":
        return None
    cfg = affinity_config(args)
    return RequestRouterConfig(request_router_class=PrefixAffinityRouter,
                               request_router_kwargs={"chunk_chars": cfg.chunk_chars,
                                                      "imbalance_threshold": cfg.imbalance_threshold})


def build_application(args):
    """The Serve application for `tercel serve` flags (args from serving/server.py's parser).
    Without --threads a replica runs as many torch threads as the CPUs it reserves (at least one):
    torch's default, every core of the node, would oversubscribe a node of several replicas."""
    args = argparse.Namespace(**{**vars(args), "threads": args.threads or max(1, int(args.replica_cpus))})
    routing = {"request_router_config": cfg} if (cfg := router_config(args)) else {}
    engine = serve.deployment(TercelReplica, name="TercelReplica", num_replicas=args.replicas,
                              ray_actor_options={"num_cpus": args.replica_cpus},
                              # Ray never queues in front of a replica: its engine queues and answers 429
                              max_ongoing_requests=args.max_num_seqs + args.max_queue,
                              graceful_shutdown_timeout_s=args.grace, health_check_period_s=5, **routing)
    ingress = serve.deployment(TercelIngress, name="TercelIngress", ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=10_000)
    return ingress.bind(engine.bind(args))


def app_builder(config: dict):
    """`serve run serving.cluster.replicas:app_builder replicas=2 model=...` or a config file's `args`:
    the keys are `tercel serve` flags without their dashes (`max_num_seqs`, `routing`, ...)."""
    argv = []
    for key, value in config.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value not in (False, None):
            argv += [flag, str(value)]
    args = parse_serve_args(argv)
    if args.replicas is None:
        args.replicas = 1
    return build_application(args)


def run_replicas(args) -> int:
    """Deploy on Ray (a local instance unless --ray-address) and serve until SIGTERM or SIGINT;
    then Serve drains the replicas for --grace seconds and the process exits 0."""
    if args.ray_address:
        ray.init(address=args.ray_address)
    else:   # a replica reserves --replica-cpus: let a small machine hold them all
        cpus = max(os.cpu_count() or 1, math.ceil(args.replicas * args.replica_cpus))
        # No dashboard (its job API runs code; serve.run needs none). The node's agent still listens
        # on the node's IP: Ray token-authenticates a new local instance unless RAY_AUTH_MODE=disabled.
        ray.init(address="local", num_cpus=cpus, include_dashboard=False)   # a new instance, even if one runs
    stop = threading.Event()
    before = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_application(args), name=APP_NAME, route_prefix="/")
        log.info("serving %d replica(s) on http://%s:%d (routing: %s)", args.replicas, args.host, args.port,
                 args.routing)
        stop.wait()
        log.info("stopping: Ray Serve drains the replicas (up to %gs)", args.grace)
        if args.ray_address:
            serve.delete(APP_NAME)   # a shared cluster's other applications keep running
        else:
            serve.shutdown()
    finally:
        ray.shutdown()
        for sig, handler in before.items():
            signal.signal(sig, handler)
    return 0

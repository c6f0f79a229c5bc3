"""`tercel serve --replicas N`: the flags, the check that Ray Serve is installed, and the
process that deploys serving/replicas.py's application and waits for a signal.

Nothing here imports Ray at module level: `tercel serve` without `--replicas` never needs it.
"""
from __future__ import annotations

import importlib.util
import logging
import math
import os
import signal
import threading

from serving.prefix_index import AffinityConfig

log = logging.getLogger("tercel.serve")
INSTALL_HINT = 'pip install -e ".[cluster]"'
ROUTING = ("prefix", "load")
APP_NAME = "tercel"      # the Serve application's name


def add_replica_args(p) -> None:
    p.add_argument("--replicas", type=int, default=None,
                   help="serve N engine replicas behind Ray Serve (default: one process, no Ray)")
    p.add_argument("--routing", default="prefix", choices=ROUTING,
                   help="with --replicas: prefix affinity (default), or Ray's power-of-two-choices by load")
    p.add_argument("--affinity-chunk-chars", type=int, default=64,
                   help="with --routing prefix: characters per hashed prefix chunk")
    p.add_argument("--affinity-imbalance", type=int, default=4,
                   help="with --routing prefix: leave the prefix's replica when it runs this many more "
                        "requests than the least loaded one")
    p.add_argument("--replica-cpus", type=float, default=1.0, help="with --replicas: Ray CPUs each replica reserves")
    p.add_argument("--ray-address", default=os.environ.get("RAY_ADDRESS"),
                   help="with --replicas: an existing Ray cluster (default: $RAY_ADDRESS, else a local Ray)")


def ray_serve_available() -> bool:
    return importlib.util.find_spec("ray") is not None and importlib.util.find_spec("ray.serve") is not None


def check_replica_args(args) -> None:
    """ValueError (exit 2) for replica flags that cannot work, Ray missing included."""
    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    if args.replica_cpus < 0:
        raise ValueError(f"--replica-cpus must be >= 0, got {args.replica_cpus}")
    if not ray_serve_available():
        raise ValueError(f"--replicas {args.replicas} needs Ray Serve, an optional extra: {INSTALL_HINT}")
    affinity_config(args)     # its own checks


def uses_ray(args) -> bool:
    """--replicas given and Ray Serve there to run it; one replica without Ray is one process."""
    if args.replicas is None:
        return False
    if args.replicas == 1 and not ray_serve_available():
        log.warning("--replicas 1 without Ray Serve (%s): serving from this process", INSTALL_HINT)
        return False
    check_replica_args(args)
    return True


def affinity_config(args) -> AffinityConfig:
    return AffinityConfig(chunk_chars=args.affinity_chunk_chars, imbalance_threshold=args.affinity_imbalance)


def run_replicas(args) -> int:
    """Deploy on Ray (a local instance unless --ray-address) and serve until SIGTERM or SIGINT;
    then Serve drains the replicas for --grace seconds and the process exits 0."""
    import ray
    from ray import serve

    from serving.replicas import build_application
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

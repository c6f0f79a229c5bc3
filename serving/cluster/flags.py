"""`tercel serve --replicas N`: the flags and the check that Ray Serve is installed (the
application and its deployment: serving/cluster/replicas.py).

Nothing here imports Ray: `tercel serve` without `--replicas` never needs it.
"""
from __future__ import annotations

import importlib.util
import logging
import os

from serving.cluster.prefix_index import AffinityConfig

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

"""Prefix-affinity routing as a Ray Serve request router (`request_router_config` of the engine
deployment in serving/cluster/replicas.py). The policy is serving/cluster/prefix_index.py's `choose`; this class
feeds it Ray's view of each replica and remembers where each prefix went.

It runs inside every DeploymentHandle to the engine deployment, that is in the ingress replica's
process, and keeps its index there: no extra actor, no call off the routing path. With several
ingress replicas each learns from the requests it routes itself. Load is Ray's own figure, the
router's queue-length cache (requests sent to a replica and not yet finished, corrected by the
replicas' answers to its probes).

Why not Ray Serve LLM's PrefixCacheAffinityRouter: it lives in `ray.llm._internal`, keeps its tree
in a detached actor that it calls with a blocking `ray.get` on every request, and matches the
concatenated message contents without their roles.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from serving.cluster.prefix_index import AffinityConfig, Candidate, PrefixIndex, choose, chunk_hashes

# The routers of this process count their decisions here; the ingress's /metrics adds them.
ROUTER_REGISTRY = CollectorRegistry()
DECISIONS = Counter("tercel_router_decisions", "engine requests routed, by why that replica",
                    ["reason"], registry=ROUTER_REGISTRY)


def _count(reason: str) -> None:
    # Ray pickles the router class by value, with copies of the globals it uses; the import finds
    # the live module, whose registry the ingress's /metrics renders.
    import serving.cluster.prefix_router as live   # lazy: the live module, not the pickled copy's globals
    live.DECISIONS.labels(reason=reason).inc()


class PrefixAffinityRouter(RequestRouter):
    """Ranks the replica `choose` picks first, then the others by load (Ray takes the first rank
    whose replica has room, probing queue lengths it does not know)."""

    def initialize_state(self, **kwargs):
        self.affinity = AffinityConfig(**kwargs)
        self.index = PrefixIndex(self.affinity)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        hashes = self._hashes(pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        choice = choose([Candidate(rid, self._load(r), self.index.matched(rid, hashes), self.index.stored(rid))
                         for rid, r in by_id.items()], self.affinity)
        _count(choice.reason)
        first = by_id[choice.replica]
        rest = sorted((r for r in candidate_replicas if r is not first), key=self._load)
        return [[first], rest]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        # The replica now holds this prompt's prefix (once its prefill runs).
        self.index.insert(replica_id.unique_id, self._hashes(pending_request))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.remove(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.index.keep_only({r.replica_id.unique_id for r in replicas})

    def _load(self, replica: RunningReplica) -> int:
        return self.replica_queue_len_cache.get(replica.replica_id) or 0

    def _hashes(self, pending_request: PendingRequest | None) -> list[bytes]:
        """Chunk hashes of the request's prefix key; [] for calls that carry none."""
        args = pending_request.args if pending_request is not None else ()
        key = getattr(args[0], "prefix_key", "") if args else ""
        return chunk_hashes(key, self.affinity.chunk_chars) if key else []

"""The request router of the replicas on Ray Serve: prefix affinity, then the least loaded.

Serve asks `choose_replicas` for ranks of candidates and sends the request to a replica of the
first rank that has room (below `max_ongoing_requests`; it probes a replica whose queue it does
not know). The ranks here hold one replica each:

    1. a request pinned to a replica (`Forwarded.replica`: the gateway asking each replica for
       its /metrics) -> [[that replica]]
    2. a request whose opening a replica saw (`PrefixTable.lookup` over `Forwarded.prefix`),
       unless that replica holds more than `max_imbalance` requests over the least loaded
       one -> that replica alone for the first `owner_tries` asks (Serve backs off between
       them: on a loaded machine the owner's queue-length answer can come late, and the
       request would go elsewhere, away from its cache), then that replica first and the
       others from the least loaded
    3. otherwise -> every replica, from the least loaded (as last probed and counted since;
       one never probed counts as empty, so it is tried first)

Where a request went is recorded once a replica accepted it (`on_request_routed`); a replica
that dies takes its keys with it. Each gateway process has its own router and so its own table.
"""

from __future__ import annotations

import random

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from verispec.server.affinity import TABLE_ENTRIES, Forwarded, PrefixTable

MAX_ASKED = 10_000  # pending requests whose owner-only asks are counted at once
# app name -> the ids of its replicas the router knows (read by the gateway's /metrics)
KNOWN_REPLICAS: dict[str, tuple[str, ...]] = {}


class PrefixAffinityRouter(RequestRouter):

    def initialize_state(self, max_imbalance: int = 16, table_entries: int = TABLE_ENTRIES,
                         owner_tries: int = 3) -> None:
        self.max_imbalance = max_imbalance
        self.table = PrefixTable(table_entries)
        self.owner_tries = owner_tries
        self._asked: dict[int, int] = {}  # id of a pending request -> times offered its owner

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        # Serve may hand the router a copy of this class pickled by value, whose globals are
        # copies too: the registry is reached through the module itself
        from verispec.server import ray_router

        ray_router.KNOWN_REPLICAS[self.app_name] = tuple(r.replica_id.unique_id
                                                         for r in replicas)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if pending_request is not None:  # when every rank is full, wait before asking again
            pending_request.routing_context.should_backoff = True
        request = _forwarded(pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if request is not None and request.replica in by_id:
            return [[by_id[request.replica]]]
        loads = self._loads(candidate_replicas)
        ranked = [[r] for r in sorted(candidate_replicas, key=lambda r: loads[r.replica_id])]
        owner = None if request is None else self.table.lookup(request.prefix)[0]
        if owner in by_id and loads[by_id[owner].replica_id] - min(loads.values()) <= \
                self.max_imbalance:
            asked = self._asked.get(id(pending_request), 0)
            if pending_request is not None and asked < self.owner_tries:
                if len(self._asked) > MAX_ASKED:  # requests cancelled while being routed
                    self._asked.clear()
                self._asked[id(pending_request)] = asked + 1
                return [[by_id[owner]]]
            ranked.remove([by_id[owner]])
            ranked.insert(0, [by_id[owner]])
        return ranked

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result) -> None:
        self._asked.pop(id(pending_request), None)
        request = _forwarded(pending_request)
        if request is not None and request.prefix:
            self.table.record(request.prefix, replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.forget(replica_id.unique_id)

    def _loads(self, replicas: list[RunningReplica]) -> dict[ReplicaID, int]:
        """Requests each replica holds, as last probed and counted since (unknown: 0, so that
        a replica not probed yet is tried, and probed, first). Ties in random order."""
        cache = self.replica_queue_len_cache
        jitter = random.sample(range(len(replicas)), len(replicas))
        return {r.replica_id: (cache.get(r.replica_id) or 0) + tie / len(replicas)
                for r, tie in zip(replicas, jitter, strict=True)}


def _forwarded(pending_request: PendingRequest | None):
    """The gateway's Forwarded request among the call's arguments, or None (another call)."""
    if pending_request is None or not pending_request.args:
        return None
    request = pending_request.args[0]
    return request if isinstance(request, Forwarded) else None

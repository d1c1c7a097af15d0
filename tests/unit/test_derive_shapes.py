"""Derivation pairs the client and engine records of every trace shape in one batch: direct
(traceparent), behind a gateway the collector never sees (the general matching, per trace), and
under an HTTP server span; traces of several requests mixed in, in shuffled order."""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from derive_shapes import batch

from collector.pipeline.derive import derive


def test_every_shape_pairs_each_request_with_its_own_peer():
    traces = batch(300, "proxy") + batch(200, "direct", first=300) + batch(100, "server", first=500)
    random.Random(7).shuffle(traces)
    records, _ = derive(traces)
    ids, peers, bounds = records.request_id, records.peer_request_id, records.boundary
    paired = records.paired.astype(bool)
    client = [j for j in range(len(records)) if bounds[j] == "client"]
    assert len(client) == 600
    assert all(paired[j] and peers[j] == ids[j] for j in client)


def test_one_trace_of_many_requests_pairs_each_with_its_own_peer():
    """The agent shapes of the benchmark: 400 requests in one trace, released at once (behind a
    gateway: by request id inside the trace) or call by call as the collector takes them."""
    from derive_shapes import assembled

    for traces in (batch(400, "agent-proxy"), batch(400, "agent-direct"), assembled(400, "agent-direct")[0]):
        records, _ = derive(traces)
        ids, peers = records.request_id, records.peer_request_id
        assert len(records) == 800 and records.paired.all() and all(p == i for p, i in zip(peers, ids))
        assert len(set(records.trace_id)) == 1
    assert len(assembled(400, "agent-direct")[0]) == 400  # each call released on its own

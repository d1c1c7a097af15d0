"""--forward-max-array-bytes: the forwarded copy of a long request carries its token arrays' summary
instead of arrays a trace back end would cut (Tempo: 2,048 bytes an attribute), while the collector
itself derives from the whole arrays; short arrays and every other attribute pass unchanged."""

from __future__ import annotations

import json
from itertools import pairwise

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from support.otlp_helpers import Req, http_exporter, sample_request, send, wait_for

from collector.exporters.array_summary import summarise, text_bytes
from otel_llm import semconv as sc

TEMPO = 2048


def _long_req(rid: str, n: int = 600) -> Req:
    ev = [(100 + 7.5 * i, 1) for i in range(n)]
    return Req(rid, client_events=ev, client_end=100 + 7.5 * n + 5, engine_events=ev, engine_end=100 + 7.5 * n + 4)


def _attrs(req: ExportTraceServiceRequest) -> dict[str, dict]:
    out = {}
    for rs in req.resource_spans:
        for ss in rs.scope_spans:
            for s in ss.spans:
                out[s.name] = {kv.key: kv.value for kv in s.attributes}
    return out


def _value_text_bytes(v) -> int:
    which = v.WhichOneof("value")
    if which == "array_value":
        return len(json.dumps([getattr(x, x.WhichOneof("value")) for x in v.array_value.values], separators=(",", ":")))
    return len(str(getattr(v, which)))


def test_long_arrays_are_summarised_short_ones_kept():
    req = sample_request([_long_req("long")])
    body = req.SerializeToString()
    before = _attrs(req)
    offs = [x.int_value for x in before[sc.SPAN_CLIENT_REQUEST][sc.TOKEN_EVENT_OFFSETS].array_value.values]
    assert text_bytes(offs) > TEMPO and text_bytes(offs) == _value_text_bytes(
        before[sc.SPAN_CLIENT_REQUEST][sc.TOKEN_EVENT_OFFSETS]
    )
    out = ExportTraceServiceRequest()
    out.ParseFromString(summarise(body, TEMPO))
    after = _attrs(out)
    for name, attrs in after.items():
        for key, v in attrs.items():
            assert _value_text_bytes(v) <= TEMPO, (name, key)
    c = after[sc.SPAN_CLIENT_REQUEST]
    k = sc.TOKEN_EVENT_OFFSETS
    assert k not in c and sc.TOKEN_EVENT_TOKENS not in c
    assert c[f"{k}.count"].int_value == 600 and c[f"{k}.first"].int_value == offs[0]
    assert c[f"{k}.last"].int_value == offs[-1]
    assert c[f"{k}.max_gap"].int_value == max(b - a for a, b in pairwise(offs))
    assert c[f"{sc.TOKEN_EVENT_TOKENS}.sum"].int_value == 600
    assert c[sc.REQUEST_ID].string_value == "long" and c[sc.OUTPUT_TOKENS].int_value == 600  # the rest as it came
    # ids, times and names unchanged
    assert [
        (s.trace_id, s.span_id, s.start_time_unix_nano, s.name) for s in out.resource_spans[0].scope_spans[0].spans
    ] == [(s.trace_id, s.span_id, s.start_time_unix_nano, s.name) for s in req.resource_spans[0].scope_spans[0].spans]
    short = sample_request([Req("short")]).SerializeToString()
    assert summarise(short, TEMPO) is short  # nothing over the limit: the same bytes


def test_the_forwarded_copy_is_summarised_the_collector_derives_from_the_whole(make_collector):
    target = make_collector()
    front = make_collector(
        forward_traces=f"http://127.0.0.1:{target.receivers[1].address[1]}", forward_max_array_bytes=TEMPO
    )
    send(http_exporter(front.receivers[1].address[1]), [_long_req("L"), Req("S")])
    wait_for(lambda: front.store.count() >= 4 and target.store.count() >= 4, what="records on both")
    mine = {(r.boundary, r.request_id): r for r in front.store.records()}
    theirs = {(r.boundary, r.request_id): r for r in target.store.records()}
    assert mine[("client", "L")].output_tokens == 600 and mine[("client", "L")].itl_max is not None
    assert len(mine[("client", "L")].event_times) == 600
    # the target got the summary: no token events for L (so no TTFT there), S whole
    assert theirs[("client", "L")].event_times == [] and theirs[("client", "L")].ttft is None
    assert theirs[("client", "S")].event_times == mine[("client", "S")].event_times

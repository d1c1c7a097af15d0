"""The readers of load tools' per-request results (``compare --client-results``), on files shaped
by hand the way each tool writes them, and on files that are not theirs."""

from __future__ import annotations

import json

import pytest

from collector.analysis.client_results import read_results


def _guidellm_request(rid: str, start: float, first: float, last: float, end: float, tokens: int) -> dict:
    timings = {"request_start": start, "first_token_iteration": first, "last_token_iteration": last}
    return {
        "request_id": rid,
        "response_id": f"cmpl-{rid}",
        "info": {"timings": {**timings, "request_end": end}, "error": None},
        "output_metrics": {"text_tokens": tokens},
    }


def test_guidellm_requests_keep_the_tools_times_and_the_servers_response_id(tmp_path):
    ok = _guidellm_request("a", 100.0, 100.02, 100.3, 100.31, 32)
    failed = {"request_id": "b", "response_id": None, "info": {"timings": {"request_start": 101.0}, "error": "boom"}}
    one_chunk = _guidellm_request("c", 102.0, 102.01, 102.01, 102.02, 1)
    path = tmp_path / "g.json"
    requests = {"successful": [ok, one_chunk], "errored": [failed], "incomplete": []}
    path.write_text(json.dumps({"benchmarks": [{"requests": requests}]}))
    res = read_results(str(path), "guidellm")
    assert (res.tool, res.clock, res.by_response_id) == ("guidellm", "unix", True)
    a, c, b = res.requests
    assert (a.tool_id, a.response_id, a.output_tokens) == ("a", "cmpl-a", 32)
    assert a.ttft_s == pytest.approx(0.02) and a.latency_s == pytest.approx(0.31)
    assert a.gaps_s == [pytest.approx(0.28)]  # only the first and the last chunk's times are saved
    assert c.gaps_s == [] and c.ttft_s == pytest.approx(0.01)
    assert (b.ttft_s, b.error) == (None, "boom")


@pytest.mark.parametrize(
    "text, fmt, says",
    [
        ("not json", "guidellm", "not JSON"),
        ('{"benchmarks": [{"no": 1}]}', "guidellm", "--output kind=json"),
        ('{"ttfts": []}', "vllm-bench", "--save-detailed"),
        ('{"benchmarks": []}', "vllm-bench", "--save-detailed"),
        ("[1, 2]", "vllm-bench", "--save-detailed"),
    ],
)
def test_a_file_that_is_not_the_tools_is_refused_with_what_to_run(tmp_path, text, fmt, says):
    path = tmp_path / "r.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=says):
        read_results(str(path), fmt)


def test_an_unknown_format_lists_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="vllm-bench, guidellm"):
        read_results(str(tmp_path / "x.json"), "aiperf")


def _engine_records(prefix: str, n: int, t0_ns: int) -> list:
    """Engine records of n requests vLLM got as ``<prefix><i>``, the i-th arriving at t0 + i ms."""
    from collector.pipeline.records import COLUMN_NAMES, RequestRecord

    base = {name: None for name in COLUMN_NAMES}
    return [
        RequestRecord(
            **{
                **base,
                "trace_id": f"{prefix}{i:031x}"[-32:],
                "boundary": "engine",
                "request_id": f"cmpl-{prefix}{i}-0",
                "status": "ok",
                "submit_ns": t0_ns + i * 1_000_000,
                "end_ns": t0_ns + i * 1_000_000 + 50_000_000,
                "output_tokens": 2,
                "ttft": 0.01,
                "sample_weight": 1.0,
                "paired": False,
                "warmup": False,
                "estimated_tokens": False,
                "events_summarised": False,
                "events_rejected": 0,
            },
            event_offsets_ns=[10_000_000, 50_000_000],
            event_tokens=[1, 1],
        )
        for i in range(n)
    ]


def test_two_runs_in_one_store_are_told_apart_by_when_they_ran():
    """vllm bench serve does not save its request id prefix: with two runs of the same size in the
    store (prefixes A and B, 100 s apart), the results join the run whose arrivals match their own
    send times; a file whose times decide nothing is refused, naming the option that decides."""
    from collector.analysis.client_results import ToolRequest, ToolResults, join_client
    from collector.pipeline.records import RecordBatch

    n, t0 = 5, 1_800_000_000 * 10**9
    batch = RecordBatch.from_records(_engine_records("A", n, t0) + _engine_records("B", n, t0 + 100 * 10**9))

    def tool(at_ns: int) -> ToolResults:
        reqs = [ToolRequest(i, (at_ns + i * 1_000_000 - 300_000) / 1e9, 0.011, [0.04], 0.06, 2) for i in range(n)]
        return ToolResults("vllm bench serve", reqs, "unix")

    for at, prefix in ((t0, "A"), (t0 + 100 * 10**9, "B")):
        joined, how, missing = join_client(tool(at), batch)
        assert (how, missing) == (f"request id {prefix}<i>", 0)
        clients = [r for r in joined.records() if r.boundary == "client"]
        assert sorted(r.peer_request_id for r in clients) == [f"cmpl-{prefix}{i}-0" for i in range(n)]
    with pytest.raises(ValueError, match=r"several prefixes \(A, B\): say which with --client-id-prefix"):
        join_client(tool(t0 + 50 * 10**9), batch)  # halfway between the two runs
    joined, how, _ = join_client(tool(t0 + 50 * 10**9), batch, prefix="B")  # said: no question
    assert how == "request id B<i>"

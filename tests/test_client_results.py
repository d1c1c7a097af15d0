"""The readers of load tools' per-request results (``compare --client-results``), on files shaped
by hand the way each tool writes them, and on files that are not theirs."""

from __future__ import annotations

import json

import pytest

from collector.client_results import read_results


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

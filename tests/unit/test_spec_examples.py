"""The worked examples of docs/metrics/spec.md (figures 1 to 5), reproduced through the CLI."""

import pytest
from conftest import analyze_json, run_cli


def approx(x):
    return pytest.approx(x, abs=1e-9)


def test_figure1_single_request(jsonl):
    path = jsonl(
        [{"id": "a", "submit": 0.0, "end": 0.18, "status": "ok", "events": [[0.17, 1], [0.1, 1], [0.13, 1]]}]
    )  # any order
    out = analyze_json(path)
    lat = out["latency"]
    assert lat["ttft"]["n"] == 1 and lat["ttft"]["p50"] == approx(0.100)
    assert lat["itl"]["n"] == 2
    assert sorted([lat["itl"]["min"], lat["itl"]["max"]]) == [approx(0.030), approx(0.040)]
    assert lat["tpot"]["p50"] == approx(0.035)
    assert lat["e2e"]["p50"] == approx(0.180)
    assert out["window"] == {
        "start": 0.0,
        "end": 0.18,
        "seconds": approx(0.18),
        "source": "earliest submit to latest end",
    }


def test_figure3_same_tpot_hides_a_stall(jsonl):
    path = jsonl(
        [
            {"id": "steady", "submit": 0.0, "end": 0.07, "status": "ok", "events": [[0.0, 1], [0.035, 1], [0.07, 1]]},
            {"id": "stall", "submit": 0.0, "end": 0.07, "status": "ok", "events": [[0.0, 1], [0.005, 1], [0.07, 1]]},
        ]
    )
    out = analyze_json(path)
    lat = out["latency"]
    assert lat["tpot"]["n"] == 2
    assert lat["tpot"]["min"] == approx(0.035) and lat["tpot"]["max"] == approx(0.035)
    assert lat["itl_max"]["max"] == approx(0.065)  # the stall shows in the per-request max ITL
    assert lat["itl"]["max"] == approx(0.065) and lat["itl"]["n"] == 4


def test_figure2_window_throughput(jsonl):
    rows = [
        {"id": "A", "submit": 1.0, "end": 4.0, "status": "ok", "events": [[2, 1], [3, 1], [3.5, 1]]},
        {"id": "B", "submit": 2.0, "end": 8.0, "status": "ok", "events": [[3, 1], [4, 1], [5, 1], [6, 1], [7, 1]]},
        {"id": "C", "submit": 5.0, "end": 9.5, "status": "ok", "events": [[6, 1], [9, 1]]},
    ]
    out = analyze_json(jsonl(rows), "--window", "0,10")
    assert out["window"]["seconds"] == 10
    assert out["throughput"]["requests_per_s"] == approx(0.3)
    assert out["throughput"]["output_tokens_per_s"] == approx(1.0)
    assert out["counts"]["completed"] == 3


def test_figure4_percentiles_nearest_rank_and_linear(jsonl):
    ttft_ms = [50, 60, 70, 80, 90, 100, 120, 150, 170, 190, 200, 220, 250, 280, 300, 350, 420, 500, 600, 1000]
    rows = [
        {"id": str(i), "submit": 0.0, "end": ms / 1000 + 0.01, "status": "ok", "events": [[ms / 1000, 1]]}
        for i, ms in enumerate(reversed(ttft_ms))
    ]
    out = analyze_json(jsonl(rows), "--percentiles", "50,95")
    t = out["latency"]["ttft"]
    assert out["percentile_method"] == "nearest-rank"
    assert t["n"] == 20
    assert t["p50"] == approx(0.190) and t["p95"] == approx(0.600) and t["max"] == approx(1.0)
    lin = analyze_json(jsonl(rows), "--percentiles", "95", "--percentile-method", "linear")
    assert lin["latency"]["ttft"]["p95"] == approx(0.620)
    assert lin["percentile_method"] == "linear"


def test_figure4_table_names_method_and_count(jsonl):
    ttft_ms = [50, 60, 70, 80, 90, 100, 120, 150, 170, 190, 200, 220, 250, 280, 300, 350, 420, 500, 600, 1000]
    rows = [
        {"id": str(i), "submit": 0.0, "end": 1.01, "status": "ok", "events": [[ms / 1000, 1]]}
        for i, ms in enumerate(ttft_ms)
    ]
    text = run_cli("analyze", jsonl(rows), "--percentiles", "50,95").stdout
    assert "nearest-rank" in text
    ttft_line = next(line for line in text.splitlines() if line.startswith("TTFT"))
    assert "190.00" in ttft_line and "600.00" in ttft_line and " 20 " in ttft_line
    assert "per-request TTFT" in ttft_line


def test_figure5_goodput(jsonl):
    rows = []
    for i in range(10):
        ttft, tpot = 0.5, 0.03
        if i == 3:
            ttft = 1.5
        if i == 7:
            tpot = 0.07
        first = i * 0.5 + ttft
        rows.append(
            {
                "id": f"r{i}",
                "submit": i * 0.5,
                "end": first + 4 * tpot + 0.01,
                "status": "ok",
                "events": [[first + j * tpot, 1] for j in range(5)],
            }
        )
    out = analyze_json(jsonl(rows), "--window", "0,10", "--slo", "ttft=1,tpot=0.05")
    assert out["throughput"]["requests_per_s"] == approx(1.0)
    g = out["goodput"]
    assert g["good"] == 8
    assert g["requests_per_s"] == approx(0.8)
    assert g["attainment"] == approx(0.8)
    assert g["attainment_by_bound"] == {"ttft": approx(0.9), "tpot": approx(0.9)}
    assert g["slo"] == {"ttft": 1.0, "tpot": 0.05}


def test_tpot_undefined_never_zero_and_policy(jsonl):
    rows = [
        {"id": "one", "submit": 0, "end": 1, "status": "ok", "events": [[0.5, 1]]},
        {"id": "none", "submit": 0, "end": 1, "status": "ok", "events": []},
        {"id": "two", "submit": 0, "end": 1, "status": "ok", "events": [[0.2, 1], [0.3, 1]]},
    ]
    out = analyze_json(jsonl(rows), "--slo", "tpot=0.05")
    assert out["latency"]["tpot"]["n"] == 1  # only "two" has a TPOT; the others are undefined, not 0
    assert out["latency"]["tpot"]["min"] == approx(0.1)
    assert out["counts"]["tpot_undefined"] == 2
    assert out["counts"]["no_token"] == 1
    assert out["goodput"]["good"] == 2  # "one" and "none" pass vacuously, "two" fails (0.1 > 0.05)
    fail = analyze_json(jsonl(rows), "--slo", "tpot=0.05", "--tpot-undefined", "fail")
    assert fail["goodput"]["good"] == 0


def test_no_token_fails_ttft_and_itl_bounds(jsonl):
    rows = [
        {"id": "none", "submit": 0, "end": 1, "status": "ok", "events": []},
        {"id": "single", "submit": 0, "end": 1, "status": "ok", "events": [[0.2, 1]]},
    ]
    out = analyze_json(jsonl(rows), "--slo", "itl_max=0.01")
    # "single" has no ITL sample: the bound is vacuous. "none" has no token: it fails.
    assert out["goodput"]["good"] == 1
    out = analyze_json(jsonl(rows), "--slo", "ttft=5")
    assert out["goodput"]["good"] == 1
    assert out["latency"]["ttft"]["n"] == 1


def test_statuses_counted_next_to_throughput(jsonl):
    rows = [
        {"id": "ok", "submit": 0, "end": 2, "status": "ok", "events": [[1, 2], [1.5, 1]]},
        {"id": "err", "submit": 0, "end": 1, "status": "error", "events": [[0.5, 4]]},
        {"id": "can", "submit": 0.5, "end": 1.5, "status": "cancelled", "events": [[1, 1]]},
        {"id": "rej", "submit": 1, "end": 1, "status": "rejected"},
    ]
    out = analyze_json(jsonl(rows))
    c = out["counts"]
    assert (c["completed"], c["failed"], c["cancelled"], c["rejected"]) == (1, 1, 1, 1)
    assert c["multi_token_events"] == 1
    # output tokens from every request whatever its status: 3 + 4 + 1 over 2 s
    assert out["throughput"]["output_tokens_per_s"] == approx(4.0)
    assert out["throughput"]["requests_per_s"] == approx(0.5)
    assert out["latency"]["e2e"]["n"] == 1
    table = run_cli("analyze", jsonl(rows)).stdout
    assert "failed 1, cancelled 1, rejected 1" in table


def test_empty_distribution_is_null(jsonl):
    rows = [{"id": "e", "submit": 0, "end": 1, "status": "error", "events": [[0.5, 1]]}]
    out = analyze_json(jsonl(rows), "--percentiles", "50,99.9,7")
    t = out["latency"]["ttft"]
    assert t["n"] == 0 and t["mean"] is None and t["p50"] is None and t["p99.9"] is None and t["p7"] is None

"""The client TTFT's parts, declared once (collector/pipeline/ttft_parts.py): the finest-level rule on one
request and over columns agree, and docs/metrics/breakdown.md's and the TTFT page's tables say what the table says."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import numpy as np
import pytest

from collector.pipeline.ttft_parts import BY_NAME, NAMES, PARTS, finest, shown

ROOT = Path(__file__).resolve().parents[2]
DISAGG = [p.name for p in PARTS if p.disagg]  # a disaggregated request's to_engine
# what a request with every boundary has (not disaggregated)
FINE = [p.name for p in PARTS if p.name not in {q.coarse for q in PARTS} and not p.disagg]
COARSE = {
    c: [p.name for p in PARTS if p.coarse == c and not p.disagg]
    for c in dict.fromkeys(p.coarse for p in PARTS if p.coarse)
}


def test_every_boundary_known_gives_the_fine_parts_in_order():
    values = {n: None if n in DISAGG else 0.001 * (i + 1) for i, n in enumerate(NAMES)}
    assert list(finest(values)) == FINE


def test_a_disaggregated_request_splits_to_engine_at_its_prefill_leg():
    """Its way to the decode engine: the proxy, the whole prefill leg and the hop, not network."""
    assert DISAGG == ["to_prefill", "prefill_leg", "pd_hop"]
    assert all(BY_NAME[n].coarse == "to_engine" for n in DISAGG)
    # the clock shifts add up to to_engine's: the client's clock to the decode engine's
    assert sum(BY_NAME[n].clock_shift for n in DISAGG) == BY_NAME["to_engine"].clock_shift
    values = {n: 0.001 for n in NAMES} | {"network_in": None, "api_in": None}
    got = finest(values)
    assert list(got) == [*DISAGG, *FINE[FINE.index("front_end") :]]
    # the split wins over the usual parts where both are known (the decode server's api_in is known)
    assert list(finest({n: 0.001 for n in NAMES})) == list(got)
    # a leg not known: to_engine whole, never a partial split
    assert list(finest(values | {"pd_hop": None})) == ["to_engine", *FINE[FINE.index("front_end") :]]


@pytest.mark.parametrize(
    "unknown, expect",
    [
        ({"client_send"}, [n for n in FINE if n != "client_send"]),  # network_in holds it: left out
        ({"front_end"}, FINE),  # kept, as None: the queue holds it
        ({"network_in"}, ["to_engine", *FINE[3:]]),  # no server span on the way in: to_engine, client_send in it
        ({"api_out", "network_out"}, [*FINE[: FINE.index("api_out")], "delivery"]),
        ({"kv_transfer", "kv_ready"}, [n for n in FINE if not n.startswith("kv_")]),  # not P/D: left out
        ({"queue", "front_end_queue"}, None),  # the engine's side unknown: no decomposition
        ({"front_end_queue"}, [n for n in FINE if n != "front_end_queue"]),  # the hooks: they say them apart
        # vLLM's own span: front end and queue not separable, one part holds both
        ({"front_end", "queue"}, [n for n in FINE if n not in ("front_end", "queue")]),
        ({"network_in", "to_engine"}, None),
    ],
)
def test_a_missing_boundary_gives_way_to_the_part_that_holds_it(unknown, expect):
    values = {n: None if n in unknown or n in DISAGG else 0.001 for n in NAMES}
    got = finest(values)
    assert (None if got is None else list(got)) == expect
    if got is not None and "front_end" in unknown and "front_end" in expect:
        assert got["front_end"] is None


def test_parts_shown_together_have_colours_of_their_own():
    colours = [BY_NAME[n].color for n in FINE]
    assert len(set(colours)) == len(colours)


def test_the_column_rule_is_the_request_rule():
    """shown() over columns says, for every request, what finest() says for it alone."""
    combos = list(itertools.product([False, True], repeat=len(NAMES)))
    cols = {n: np.array([0.001 if c[i] else np.nan for c in combos]) for i, n in enumerate(NAMES)}
    masks = shown(cols)
    for j, c in enumerate(combos):
        one = finest({n: 0.001 if c[i] else None for i, n in enumerate(NAMES)})
        if one is None:
            continue
        assert {n for n in NAMES if masks[n][j]} == {n for n, v in one.items() if v is not None}


def test_the_breakdown_table_lists_the_parts_and_how_they_merge():
    text = (ROOT / "docs" / "metrics" / "breakdown.md").read_text()
    section = text[text.index("## Where the first token's time went") :]
    rows = re.findall(
        r"^\| `(\w+)` \| (.+?) \| (.+?) \|$", section[: section.index("\n\n", section.index("| part |"))], re.M
    )
    assert [r[0] for r in rows] == FINE
    assert f"`to_engine` (= {' + '.join(DISAGG)})" in section  # a disaggregated request's
    for coarse, fine in COARSE.items():  # "`to_engine` (= client_send + network_in + api_in)"
        assert f"`{coarse}` (= {' + '.join(fine)})" in section


def test_the_ttft_page_names_the_decomposition():
    text = (ROOT / "docs" / "metrics" / "ttft.md").read_text()
    fine = [n for n in FINE if BY_NAME[n].held_by != "network_in" and not BY_NAME[n].optional]
    optional = " + ".join(n for n in FINE if BY_NAME[n].optional)
    said = "[client_send +] " + " + ".join(fine)
    assert said.replace("queue + ", f"queue + [{optional} +] ") in text
    assert all(f"`{c}`" in text for c in COARSE)

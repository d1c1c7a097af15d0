"""Reading an OTLP JSON-lines trace file while its writer still appends to it (a server's
``OTEL_LLM_TRACES_FILE`` read by a test, a report or ``analyze``): a line is whole when its
newline is written, and a reader can catch the last one half written."""

import json

import pytest
from opentelemetry.sdk.resources import Resource
from support.tests_support_spans import one_span

from otel_llm.otlp import otlp_encode
from otel_llm.otlp.trace_file import TraceFileError, read_trace_requests


def lines(n: int) -> list[bytes]:
    span = one_span(Resource.create({"service.name": "ünï"}))  # not ASCII: a cut may fall inside a character
    text = otlp_encode.spans_to_json([span])
    return [json.dumps(json.loads(text), ensure_ascii=False).encode() + b"\n" for _ in range(n)]


@pytest.mark.parametrize("cut", [1, 7, 20, -20, -2])
def test_a_last_line_still_being_written_is_left_out(tmp_path, cut):
    whole = lines(3)
    assert "ü".encode() in whole[0]
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"".join(whole[:2]) + whole[2][:cut])
    assert [n for n, _ in read_trace_requests(path)] == [1, 2]


def test_a_whole_last_line_without_its_newline_is_read(tmp_path):
    whole = lines(2)
    path = tmp_path / "t.jsonl"
    path.write_bytes(whole[0] + b"\n" + whole[1].rstrip(b"\n"))
    assert [n for n, _ in read_trace_requests(path)] == [1, 3]


def test_a_broken_line_with_its_newline_is_an_error_naming_it(tmp_path):
    whole = lines(3)
    path = tmp_path / "t.jsonl"
    path.write_bytes(whole[0] + whole[1][:30] + b"\n" + whole[2])
    with pytest.raises(TraceFileError) as err:
        list(read_trace_requests(path))
    assert err.value.line == 2 and "t.jsonl:2" in str(err.value)

"""Reading and writing timelines as JSON lines (the ``otel-llm analyze`` input format).

One object per line, times in seconds on one clock::

    {"id": "a", "submit": 0.0, "end": 0.18, "status": "ok",
     "events": [[0.1, 1], [0.13, 1], [0.17, 1]], "input_tokens": 12}

``events`` are ``[time_s, tokens]`` pairs in any order; events with 0 tokens are not token events
and are skipped. Blank lines are ignored.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable

from .timeline import STATUS_CODE, STATUSES, Timeline, TimelineBatch


class TimelineFormatError(ValueError):
    """Bad input: names the file, the 1-based line and the problem."""

    def __init__(self, path: str, line: int | None, problem: str):
        self.path, self.line, self.problem = path, line, problem
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {problem}")


def _num(v, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{what} must be a finite number of seconds, got {json.dumps(v)}")
    return float(v)


def _parse_object(obj, cols: list, index: int) -> None:
    ids, sub, end, st, er, et, ek, it = cols
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object")
    for key in ("id", "submit", "end", "status"):
        if key not in obj:
            raise ValueError(f"missing key {key!r}")
    rid = obj["id"]
    if not isinstance(rid, (str, int)) or isinstance(rid, bool):
        raise ValueError("id must be a string")
    s = _num(obj["submit"], "submit")
    e = _num(obj["end"], "end")
    status = obj["status"]
    code = STATUS_CODE.get(status) if isinstance(status, str) else None
    if code is None:
        raise ValueError(f"unknown status {json.dumps(status)} (expected one of {', '.join(STATUSES)})")
    if e < s:
        raise ValueError(f"end {e} is before submit {s}")
    events = obj.get("events", [])
    if not isinstance(events, list):
        raise ValueError("events must be a list of [time, tokens] pairs")
    for j, ev in enumerate(events):
        if not isinstance(ev, list) or len(ev) != 2:
            raise ValueError(f"event {j} must be a [time, tokens] pair, got {json.dumps(ev)}")
        t = _num(ev[0], f"event {j} time")
        k = ev[1]
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"event {j} tokens must be a non-negative integer, got {json.dumps(k)}")
        if t < s:
            raise ValueError(f"event {j} at {t} is before submit {s}")
        if t > e:
            raise ValueError(f"event {j} at {t} is after end {e}")
        if k:
            er.append(index)
            et.append(t)
            ek.append(k)
    inp = obj.get("input_tokens")
    if inp is not None and (isinstance(inp, bool) or not isinstance(inp, int) or inp < 0):
        raise ValueError("input_tokens must be a non-negative integer")
    ids.append(str(rid))
    sub.append(s)
    end.append(e)
    st.append(code)
    it.append(-1 if inp is None else inp)


def parse_lines(lines: Iterable[str], path: str = "<input>") -> TimelineBatch:
    """Parse JSON lines into a batch; raises :class:`TimelineFormatError` at the first bad line."""
    cols: list[list] = [[] for _ in range(8)]
    loads = json.loads
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = loads(line)
        except json.JSONDecodeError as exc:
            raise TimelineFormatError(path, lineno, f"malformed JSON: {exc.msg} (column {exc.colno})") from None
        try:
            _parse_object(obj, cols, len(cols[0]))
        except ValueError as exc:
            raise TimelineFormatError(path, lineno, str(exc)) from None
    if not cols[0]:
        raise TimelineFormatError(path, None, "no timelines: the input is empty")
    ids, sub, end, st, er, et, ek, it = cols
    return TimelineBatch.from_columns(ids, sub, end, st, er, et, ek, it)


def read_timelines(path: str | os.PathLike) -> TimelineBatch:
    """Read a timelines JSONL file (``-`` reads standard input)."""
    import sys

    p = os.fspath(path)
    if p == "-":
        return parse_lines(sys.stdin, "<stdin>")
    try:
        with open(p, encoding="utf-8") as fh:
            return parse_lines(fh, p)
    except OSError as exc:
        raise TimelineFormatError(p, None, f"cannot read: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise TimelineFormatError(p, None, "not UTF-8 text") from None


def timeline_to_json(tl: Timeline) -> dict:
    d = {"id": tl.id, "submit": tl.submit, "end": tl.end, "status": tl.status, "events": [[t, k] for t, k in tl.events]}
    if tl.input_tokens is not None:
        d["input_tokens"] = tl.input_tokens
    return d

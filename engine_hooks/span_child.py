"""The span process itself (:mod:`engine_hooks.span_process.parent` has the engine process's end and the
wire): a pipeline of its own, fed the engine process's events, that builds and exports their
spans; it ends when its stdin does, after exporting what it holds."""

from __future__ import annotations

import logging
import marshal
import os
import pickle
import select
import sys
import time

from .pipeline import TracingPipeline, exit_timeout_s
from .span_process.parent import _COUNTERS, _HEAD, _LEN, BATCH, END, FLUSH, MAX_FRAME, SPAN_PROCESS_ARG

log = logging.getLogger("engine_hooks")

#: after a SIGTERM, the child goes on this long for what its parent still sends (a process group
#: stopped whole: the parent's last flush comes after the signal), then exports what it has
TERM_GRACE_S = 10.0
_term_at: list[float] = []


def _on_term(signum, frame) -> None:
    if not _term_at:
        _term_at.append(time.monotonic() + TERM_GRACE_S)


def _read_exact(fd: int, n: int) -> bytes | None:
    """``n`` bytes, or None at EOF (or once the grace after a SIGTERM is over)."""
    parts, got = [], 0
    while got < n:
        if _term_at:
            left = _term_at[0] - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
        try:
            chunk = os.read(fd, min(n - got, 1 << 20))
        except InterruptedError:
            continue
        if not chunk:
            return None
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def serve(in_fd: int, reply_fd: int) -> int:
    """The child's loop: settings, then batches and flushes until EOF; between them, a round every
    ``interval_s`` (aborted requests whose grace has passed are released, as the parent's thread
    would)."""
    from opentelemetry.sdk.resources import Resource

    head = _read_exact(in_fd, _HEAD.size)
    if head is None:
        return 0
    settings = pickle.loads(_read_exact(in_fd, _HEAD.unpack(head)[0]) or b"")
    p = TracingPipeline(
        None,
        boundary=settings["boundary"],
        engine=settings["engine"],
        model=settings["model"],
        detail=settings["detail"],
        max_in_flight=settings["max_in_flight"],
        interval_s=settings["interval_s"],
    )
    p.use_env_exporter()  # an OTLP exporter sends on a thread of its own: this loop keeps reading
    p.factory.resource = Resource(settings["resource"])
    p.anchor.offset_ns = settings["offset_ns"]  # the tracker places the parent's times as it would
    p.tracker.abort_grace_ns = settings["abort_grace_ns"]
    tracker, c = p.tracker, p.counters

    done = [0]  # the last batch built

    def reply(seq: int) -> None:
        c.span_process_cpu_ns = time.process_time_ns()
        body = marshal.dumps((done[0], seq, *(getattr(c, name) for name in _COUNTERS)), 2)
        try:
            os.write(reply_fd, _LEN.pack(len(body)) + body)
        except OSError:
            pass  # the parent is not reading (or gone): counters are cumulative, the next one says it

    os.set_blocking(reply_fd, False)
    deadline = None  # the parent's exit deadline, when it sends one
    while True:
        if not select.select([in_fd], [], [], p.interval_s)[0] and not _term_at:
            p.process()  # a round without news: grace periods run out here too
            continue
        head = _read_exact(in_fd, _HEAD.size)
        if head is None:
            break
        n, kind = _HEAD.unpack(head)
        if n > MAX_FRAME:
            log.warning("engine_hooks span process: a frame of %d bytes; stopping", n)
            break
        body = _read_exact(in_fd, n)
        if body is None:
            break  # the parent ended mid-frame: what came whole is exported below
        seq = 0
        try:
            obj = pickle.loads(body)
            if kind == BATCH:
                number, items, http, final, everything = obj
                done[0] = number
                for it in items:
                    if type(it[0]) is int:
                        tracker.feed((it,))
                    else:
                        getattr(tracker, it[0])(*it[1:])  # a CallRecorder call: (name, *args)
                tracker.http_done.extend(http)
                p.deliver_round(final, everything)
            elif kind == FLUSH:
                seq = obj
                if p.exporter is not None:
                    p.exporter.force_flush()
            elif kind == END:
                deadline = obj
                break
        except Exception as exc:  # one bad batch: counted and said once, the next ones go on
            p._builder_failed(exc)
        reply(seq)
    # the end of the stream: after the parent's last round, or without it (the parent is gone:
    # what is still in flight ends here, incomplete), and the exporter flushed and closed by the
    # parent's deadline (else the exit timeout from here); the last counts go back to the parent
    p.shutdown(deadline if deadline is not None else time.monotonic() + exit_timeout_s())
    reply(0)
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="otel-llm's span process (started by engine_hooks; not for direct use)")
    ap.add_argument(SPAN_PROCESS_ARG, action="store_true", help="names this process (ps, pgrep)")
    ap.add_argument("--reply-fd", type=int, required=True)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    import signal

    # it runs in a process group of its own (the parent's Ctrl-C and process-group signals stay
    # the parent's); a SIGTERM sent to it anyway (a container or cgroup stopped whole) leaves it
    # TERM_GRACE_S for what the parent still sends on its way out
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_term)
    return serve(sys.stdin.fileno(), a.reply_fd)


if __name__ == "__main__":
    sys.exit(main())

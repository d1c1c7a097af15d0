"""Span building and export in a process of its own, beside the traced engine's process.

The engine's process keeps what must see the engine: the hooks and the recorder they write to.
Everything after (the tracker that turns events into requests, building the OpenTelemetry spans,
encoding and sending them) runs in a child process, the span process: ``python -c ...
--otel-llm-span-process``, started as the pipeline's thread starts (vLLM's front end: as the
engine is hooked), so that the first request's spans do not wait for it to import. This is the pipeline's
default for the exporter the environment configures (``OTEL_LLM_SPAN_PROCESS=0``: all of it on
the pipeline's thread instead); it takes over 90% of what tracing costs off the engine's process.

Each round, the pipeline's thread drains the recorder and hands the span process the events as
they are, and for each event the engine left by reference (``EngineHooks.raw``) either its
payload made plain data here by its expander's ``to_plain`` (:func:`engine_hooks.api.plain_payload`;
the span process runs the expander) or else the calls its expander makes on the tracker
(:class:`CallRecorder`: the expander runs here, where the engine's objects are, and tells a
stand-in what it would tell the tracker). The span process feeds them to
a pipeline of its own (the same tracker, span factory and exporter) with this process's
wall-clock anchor, and builds what finished.

The wire, parent to child on the child's stdin: frames of ``<uint32 length><kind byte><pickle>``:

* ``s``: the settings (the parent's resource attributes, boundary, engine, model, detail, anchor);
* ``b``: a batch: ``(number, items, http records, final, everything)``, each HTTP record as the
  tuple of its fields with its chunk times as bytes, as the middleware built it
  (``engine_hooks.spans.tracker.HttpRecord``: pickled as a dataclass, it took three times the
  instructions);
* ``f``: flush (with a sequence number): build and export what came before, then answer;
* ``e``: the end (with the deadline, ``time.monotonic()``: one clock for every process of the
  host): the parent exits; what the span process has not sent by then is dropped and counted,
  and it answers a last time and exits. Its stdin closes after it.

Child to parent, on a pipe of its own (its stdout stays the console exporter's): after each batch
and each flush, ``<uint32 length><marshal (last batch done, last flush done, spans exported, spans
dropped, requests unsampled, CPU ns, requests, steps, evicted)>``; the parent reads them when it
delivers and waits for a flush's. A span process that dies loses what it had not answered for:
those events are counted dropped (``otel_llm.tracer.events.dropped``).

Bounds: the child's OTLP exporter sends on a thread of its own behind a bounded queue
(:mod:`engine_hooks.span_process.export_queue`), so a slow or hung endpoint drops spans (counted), never the
reading of its pipe. A write that cannot go through within ``OTEL_BSP_EXPORT_TIMEOUT`` ms (a stuck
child: stopped, starved) is given up and its events counted dropped; a frame cut short retires the
child, and at most one retired child lives on (an older one is killed: counted, said once). A
child that died is started again on the next delivery, at most once a second. The child ends when
its stdin closes (the parent exited, or was killed: nothing it was sent is lost; requests still in
flight are exported as incomplete), after exporting what it holds, by the parent's exit deadline
(``OTEL_LLM_EXIT_TIMEOUT`` from its stdin's end when the parent sent none).
"""

from __future__ import annotations

import collections
import logging
import marshal
import os
import pickle
import select
import struct
import subprocess
import sys
import time
from collections.abc import Callable

from otel_llm import environment

from ..hot_path.hook_events import RAW, STEP, STEP_GPU, plain_raw
from ..spans.tracker import expand, expansion_failed

log = logging.getLogger("engine_hooks")

_HEAD = struct.Struct("<IB")  # frame length (after the kind byte), kind
_LEN = struct.Struct("<I")
SETTINGS, BATCH, FLUSH, END = ord("s"), ord("b"), ord("f"), ord("e")
#: how much sooner than the parent's exit deadline its span process stops sending (to answer and exit)
CHILD_MARGIN_S = 0.3
MAX_FRAME = 1 << 30
PIPE_BYTES = 1 << 20  # the pipe to the span process, where the system lets it be that large
#: how the child is started (``-m`` would import this module twice: the package imports it), and
#: the argument that names it among a machine's processes
_CHILD = "import sys; from engine_hooks.span_child import main; sys.exit(main())"
SPAN_PROCESS_ARG = "--otel-llm-span-process"


def _frame(kind: int, obj) -> bytes:
    body = pickle.dumps(obj, 5)
    return _HEAD.pack(len(body), kind) + body


class CallRecorder:
    """The tracker as an engine's expander sees it in the engine's process, in span-process mode:
    its wall-clock ``anchor``, and its recording methods, each call kept as one flat tuple (the
    method's name, then its arguments: one tracked object to allocate and pickle a call, not two)
    to be made on the span process's tracker, in order with the recorder's own events."""

    def __init__(self, anchor):
        self.anchor = anchor
        self.items: list = []
        self.http_done: list[tuple] = []  # HTTP records as the middleware hands them on (tuples)
        self._gpu: list[tuple] = []  # step events whose GPU time is not read back yet
        self.failed_expansions = 0
        self._to_plain: dict = {}  # expander -> its to_plain where the span process can run it, else None

    def translate(self, events: list[tuple], gpu_elapsed=None, force: bool = False) -> list:
        """This round's events for the span process: each plain event as it is, each raw one as
        its plain payload (its expander's ``to_plain``, :func:`engine_hooks.api.plain_payload`:
        the span process expands it) or else as the calls its expander made here; a step timed on
        the GPU once its time is read back (here: CUDA events belong to this process), as an int
        where its handle was."""
        items = self.items = []
        for ev in events:
            kind = ev[0]
            if kind == RAW:
                self._translate_raw(items, *ev[1:])
            elif kind == STEP and ev[STEP_GPU] is not None:
                self._gpu.append(ev)
            else:
                items.append(ev)
        if self._gpu:
            waiting = []
            for ev in self._gpu:
                h = ev[STEP_GPU]
                try:
                    ns = h[0].elapsed_ns(h[1]) if type(h) is tuple else gpu_elapsed(h) if gpu_elapsed else None
                except Exception:  # a GPU error reading it back: the step goes without its GPU time
                    ns = _NO_GPU_TIME
                if ns is None and not force:
                    waiting.append(ev)
                else:
                    items.append(ev[:STEP_GPU] + (ns if ns is not None else _NO_GPU_TIME,) + ev[STEP_GPU + 1 :])
            self._gpu = waiting
        self.items = []
        return items

    def _translate_raw(self, items: list, mono: int, expander: Callable, payload) -> None:
        """A RAW event (its fields by name, :mod:`engine_hooks.hot_path.hook_events`) for the span process:
        its payload made plain there (the span process expands it), else its expander's calls here."""
        try:
            to_plain = self._to_plain.get(expander, _UNSEEN)
            if to_plain is _UNSEEN:
                to_plain = self._to_plain[expander] = _sendable_to_plain(expander)
            if to_plain is not None:  # plain data: the span process runs the expander
                items.append(plain_raw(mono, expander, to_plain(payload)))
                return
        except Exception as exc:  # one engine object its to_plain could not read: the rest go on
            expansion_failed(self, exc)
            return
        expand(self, mono, expander, payload, True)  # here, on this stand-in

    def take_http(self) -> list:
        h, self.http_done = self.http_done, []
        return h

    # the tracker's recording methods (engine_hooks.spans.tracker.RequestTracker), each call kept
    def arrival(self, *args) -> None:
        self.items.append(("arrival",) + args)

    def queued(self, *args) -> None:
        self.items.append(("queued",) + args)

    def scheduled(self, *args) -> None:
        self.items.append(("scheduled",) + args)

    def preempted(self, *args) -> None:
        self.items.append(("preempted",) + args)

    def annotate(self, *args) -> None:
        self.items.append(("annotate",) + args)

    def generated(self, *args) -> None:
        self.items.append(("generated",) + args)

    def token_out(self, *args) -> None:
        self.items.append(("token_out",) + args)

    def emitted(self, *args) -> None:
        self.items.append(("emitted",) + args)

    def finish(self, *args) -> None:
        self.items.append(("finish",) + args)


_UNSEEN = object()


def _sendable_to_plain(expander: Callable):
    """``expander.to_plain`` where the span process can run ``expander`` (pickle sends a function
    as its module and name: it must be a module-level function of a module other than
    ``__main__``, which the span process, started with this interpreter and environment, imports),
    else None: its calls are then made here."""
    to_plain = getattr(expander, "to_plain", None)
    if to_plain is None or getattr(expander, "__module__", "__main__") == "__main__":
        return None
    try:
        pickle.dumps(expander, 5)
    except Exception:  # a lambda, a closure: not importable by name
        log.warning("engine_hooks: expander %r cannot be sent to the span process; it runs here", expander)
        return None
    return to_plain


#: a GPU step time that could not be read back (given up on): no time, and not a handle
_NO_GPU_TIME = -1


class SpanProcessSink:
    """The parent's side: delivers the pipeline's records to the child (started lazily, started
    again when it died) and reads back what it exported. Used under the pipeline's lock."""

    restart_interval_s = 1.0  # a span process is started at most this often

    def __init__(self, settings: dict, counters, timeout_s: float | None = None):
        self.settings = settings
        self.env = dict(os.environ)  # every span process the pipeline starts exports as configured now
        self.counters = counters  # the pipeline's PipelineCounters: spans_* and the child's CPU
        self.timeout_s = timeout_s if timeout_s is not None else _export_timeout_s()
        self._proc: subprocess.Popen | None = None
        self._retired: list[subprocess.Popen] = []  # span processes finishing what they hold
        self._fd: int | None = None  # the child's stdin, non-blocking
        self._reply_fd: int | None = None
        self._reply_buf = b""
        self._seq = 0  # flushes asked for
        self._acked = 0  # the last flush answered
        self._batches = 0  # batches sent
        self._sent: collections.deque[tuple[int, int]] = collections.deque()  # (batch, events) not yet answered
        self._next_start = 0.0
        self._child = _ZERO  # the child's last counters (_COUNTERS)
        self._base = _ZERO  # the same, of the children before it
        self.lost_events = 0  # hook events of batches that could not be written
        self.starts = 0
        self.failed = False  # the child cannot be started here: the pipeline builds in-process
        self._pickle_warned = False
        self._started_at = 0.0
        self._quick_deaths = 0
        self.deadline: float | None = None  # the exit's (time.monotonic()): no write waits past it
        self.killed = 0  # span processes killed unfinished: a second retired one, or at the exit deadline
        self._kill_warned = False

    # -- the child's life ---------------------------------------------------------------------------
    def start(self) -> bool:
        """Start the span process now (else on the first delivery); False when it cannot be."""
        return not self.failed and self._start()

    def _start(self) -> bool:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            return True
        if proc is not None:  # it died: what it had not answered for is lost; started again, unless
            self._read_replies()  # it keeps dying at once
            self.lost_events += sum(n for _, n in self._sent)
            self._sent.clear()
            self._close_fds()
            self._proc = None
            self._quick_deaths = self._quick_deaths + 1 if time.monotonic() - self._started_at < 2.0 else 0
            if self._quick_deaths >= 3:
                self._give_up(f"it exited {self._quick_deaths} times within 2 s of starting (code {proc.returncode})")
                return False
        now = time.monotonic()
        if now < self._next_start:
            return False
        self._next_start = now + self.restart_interval_s
        if not sys.executable:
            self._give_up("no Python interpreter to start it with (sys.executable is empty)")
            return False
        read_fd, write_fd = os.pipe()
        env = dict(self.env)
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # engine_hooks importable there
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")]))
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD, SPAN_PROCESS_ARG, "--reply-fd", str(write_fd)],
                stdin=subprocess.PIPE,
                pass_fds=(write_fd,),
                env=env,
                **_OWN_GROUP,
            )
        except OSError as exc:
            os.close(read_fd)
            self._give_up(str(exc))
            return False
        finally:
            os.close(write_fd)  # the child's end
        self._proc, self._started_at = proc, time.monotonic()
        self.starts += 1
        self._fd = proc.stdin.fileno()
        os.set_blocking(self._fd, False)
        try:  # room for a burst's rounds while the span process catches up (Linux: 64 KiB by default)
            import fcntl

            fcntl.fcntl(self._fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
        except (ImportError, OSError):
            pass
        os.set_blocking(read_fd, False)
        self._reply_fd, self._reply_buf = read_fd, b""
        self._base = self._child_totals()  # a new child counts from zero: keep what the last one did
        self._child = _ZERO
        return self._write(_frame(SETTINGS, self.settings))

    def _give_up(self, why: str) -> None:
        """No span process here: the pipeline builds and exports on its own thread from now on."""
        self.failed = True
        log.warning("engine_hooks: no span process (%s); building and exporting spans in this process", why)

    def _child_totals(self) -> tuple:
        return tuple(a + b for a, b in zip(self._base, self._child))

    def _close_fds(self) -> None:
        if self._proc is not None and self._proc.stdin is not None:
            try:
                self._proc.stdin.close()
            except OSError:
                pass
        if self._reply_fd is not None:
            try:
                os.close(self._reply_fd)
            except OSError:
                pass
        self._fd = self._reply_fd = None

    # -- writing ----------------------------------------------------------------------------------
    def _write(self, frame: bytes) -> bool:
        """Write a whole frame within the timeout. False when it could not: nothing of it went
        (the stream goes on), or the child is gone; a frame cut short by the timeout retires the
        child (its stream cannot go on: it exports the frames it got whole, and ends)."""
        view = memoryview(frame)
        deadline = time.monotonic() + self.timeout_s
        if self.deadline is not None:
            deadline = min(deadline, self.deadline)
        fd = self._fd
        while view:
            try:
                n = os.write(fd, view)
                view = view[n:]
                continue
            except BlockingIOError:
                pass
            except OSError:  # the child has gone (BrokenPipeError)
                return False
            left = deadline - time.monotonic()
            if left <= 0:
                if len(view) < len(frame):
                    self._retire()
                return False
            self._read_replies()  # the child may be waiting for us to read its answers
            select.select([], [fd], [], min(left, 0.1))
        return True

    def _retire(self) -> None:
        """Leave the current child to finish what it holds (its stdin closed) and start another
        on the next delivery; at most one retired child lives on: an older one is killed."""
        if self._proc is not None:
            self._base = self._child_totals()
            self._child = _ZERO
            live = [p for p in self._retired if p.poll() is None]
            if self.deadline is None:  # not exiting (shutdown waits for them all, then kills)
                for old in live[:-1]:
                    self._kill(old, "a second span process was retired while it still worked")
                live = live[-1:]
            self._retired = [*live, self._proc]
            self._sent.clear()  # it may still export them: not counted either way
        self._close_fds()
        self._proc = None

    def _kill(self, proc: subprocess.Popen, why: str) -> None:
        """Kill a span process that has not finished (what it still held is lost), count and say it once."""
        try:
            proc.kill()
            proc.wait(5)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.killed += 1
        if not self._kill_warned:
            self._kill_warned = True
            log.warning("engine_hooks: span process %d killed unfinished (%s); counted", proc.pid, why)

    def deliver(self, batch: tuple, events: int) -> None:
        """Send one batch (``events``: how many hook events it holds, counted lost when it cannot
        be sent)."""
        if self._retired:
            self._retired = [p for p in self._retired if p.poll() is None]
        try:
            items, http, final, everything = batch
            frame = _frame(BATCH, (self._batches + 1, items, http, final, everything))
        except Exception as exc:  # something an expander passed on that pickle cannot take
            self.lost_events += events
            if not self._pickle_warned:
                self._pickle_warned = True
                log.warning("engine_hooks: a batch for the span process could not be written (%s); dropped", exc)
            return
        if self._start() and self._write(frame):
            self._batches += 1
            self._sent.append((self._batches, events))
        else:
            self.lost_events += events
        self._read_replies()
        self._update()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until the child has exported everything it was sent (True), or the timeout."""
        if self._proc is None or self._fd is None or self._proc.poll() is not None:
            return self._proc is None
        self._seq += 1
        seq = self._seq
        if not self._write(_frame(FLUSH, seq)):
            return False
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while self._acked < seq:
            left = deadline - time.monotonic()
            if left <= 0 or self._reply_fd is None:
                return False
            select.select([self._reply_fd], [], [], left)
            if not self._read_replies():
                return False
        self._update()
        return True

    def _read_replies(self) -> bool:
        """Read what the child answered (non-blocking); False when its end is closed."""
        fd = self._reply_fd
        if fd is None:
            return False
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                break
            except OSError:
                return False
            if not chunk:
                return False
            self._reply_buf += chunk
        buf = self._reply_buf
        while len(buf) >= 4:
            (n,) = _LEN.unpack_from(buf)
            if len(buf) < 4 + n:
                break
            batch, flush, *counts = marshal.loads(buf[4 : 4 + n])
            self._acked = max(self._acked, flush)
            sent = self._sent
            while sent and sent[0][0] <= batch:
                sent.popleft()
            self._child = tuple(counts)[: len(_COUNTERS)]
            buf = buf[4 + n :]
        self._reply_buf = buf
        return True

    def _update(self) -> None:
        c = self.counters
        for name, value in zip(_COUNTERS, self._child_totals(), strict=True):
            setattr(c, name, value)

    def shutdown(self, deadline: float | None = None) -> None:
        """End the children by ``deadline`` (``time.monotonic()``; default: the export timeout
        from now): the current one is told the deadline and its stdin closed, then exports what
        it holds, answers with its last counts and exits; any still running at the deadline is
        killed (counted in :attr:`killed`)."""
        if deadline is None:
            deadline = time.monotonic() + self.timeout_s
        self.deadline = deadline
        proc = self._proc
        if proc is not None and self._fd is not None and proc.poll() is None:
            if self._write(_frame(END, deadline - CHILD_MARGIN_S)):
                try:
                    proc.stdin.close()  # EOF after the end: it exports, answers and exits
                except OSError:
                    pass
                self._fd = None
                while self._reply_fd is not None and (left := deadline - time.monotonic()) > 0:
                    select.select([self._reply_fd], [], [], left)
                    if not self._read_replies():
                        break  # its end closed: it has exited
            self._update()
        self._retire()
        for proc in self._retired:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._kill(proc, f"still exporting at the exit deadline ({environment.EXIT_TIMEOUT})")
        self._retired = []

    def forget_after_fork(self, settings: dict) -> None:
        """In a forked child of the parent: the span processes are the parent's; this process
        starts its own (with ``settings``: its own anchor) when it first delivers (the inherited
        descriptors are closed, not written)."""
        self._close_fds()
        self.settings = settings
        self._proc, self._retired, self._next_start, self.starts = None, [], 0.0, 0
        self._base, self._child, self.lost_events, self._acked, self._seq = _ZERO, _ZERO, 0, 0, 0
        self._batches = 0
        self._sent.clear()
        self.deadline, self.killed = None, 0


#: the span process's counters, as it sends them and as they land on the pipeline's PipelineCounters
_COUNTERS = (
    "spans_exported",
    "spans_dropped",
    "requests_unsampled",
    "span_process_cpu_ns",
    "requests_traced",
    "steps_traced",
    "requests_evicted",
)
_ZERO = (0,) * len(_COUNTERS)


#: a process group of its own: the terminal's Ctrl-C and a signal to the parent's group stay the
#: parent's (it ends when its stdin does); in the parent's session, where the kernel's autogroup
#: shares CPU among sessions: a session of its own would compete with the engine as an equal
_OWN_GROUP = {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}


def _export_timeout_s() -> float:
    return environment.env_int(environment.BSP_EXPORT_TIMEOUT, 30000, minimum=1) / 1000

"""A small OpenAI-compatible streaming server for client tests (loopback only).

Request body extensions: ``fake_usage``: ``continuous`` (usage on every chunk), ``final`` (a
usage-only chunk at the end, sent only when the request asks for ``stream_options.include_usage``
as a real server does), ``none``; ``fake_gap_ms``: time between chunks; ``fake_status``: answer
with this HTTP status instead; ``fake_multi``: tokens per chunk; ``n``: choices, a chunk each per
step. ``stream`` false: one JSON response. It records each request's headers and when its head was
read (``read_ns``), and each stream the client hung up on.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeOpenAI:
    def __init__(self):
        self.requests: list[dict] = []
        self.disconnects: list[str] = []  # paths of streams the client closed before their end
        outer = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_POST(self):
                read_ns = time.time_ns()  # the request's head is read (Unix ns)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(
                    {"path": self.path, "headers": dict(self.headers), "body": body, "read_ns": read_ns}
                )
                status = body.get("fake_status")
                if status:
                    msg = json.dumps({"error": {"message": "busy"}}).encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                n, gap = body.get("max_tokens", 4), body.get("fake_gap_ms", 5) / 1000
                prompt_tokens = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 7
                if not body.get("stream"):
                    time.sleep(gap * n)
                    chat = self.path.endswith("/chat/completions")
                    choice = (
                        {"index": 0, "message": {"role": "assistant", "content": "x" * n}, "finish_reason": "length"}
                        if chat
                        else {"index": 0, "text": "x" * n, "finish_reason": "length"}
                    )
                    msg = json.dumps(
                        {
                            "id": "cmpl-whole",
                            "object": "chat.completion" if chat else "text_completion",
                            "created": 0,
                            "model": body.get("model", "m"),
                            "choices": [choice],
                            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": n + 7},
                        }
                    ).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                chat = self.path.endswith("/chat/completions")
                multi = body.get("fake_multi", 1)
                usage = body.get("fake_usage", "continuous")
                asked = (body.get("stream_options") or {}).get("include_usage")

                def send(obj):
                    data = f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()
                    self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                    self.wfile.flush()

                try:
                    if chat:
                        send({"id": "chat-1", "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
                    done = 0
                    choices = body.get("n", 1)  # n > 1: each step sends one chunk per choice, as vLLM does
                    sent = 0  # tokens over all choices
                    while done < n:
                        time.sleep(gap)
                        k = min(multi, n - done)
                        done += k
                        # fake_empty_every=K: every K-th chunk's token decodes to no text (as vLLM sends it)
                        empty = body.get("fake_empty_every") and done % body["fake_empty_every"] == 0
                        text = "" if empty else "x" * k
                        for i in range(choices):
                            choice = {"index": i, "delta": {"content": text}} if chat else {"index": i, "text": text}
                            obj = {"id": "cmpl-fake", "choices": [choice]}
                            sent += k
                            if usage == "continuous":
                                obj["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": sent}
                            send(obj)
                    if usage in ("final", "continuous") and asked:
                        send(
                            {
                                "id": "cmpl-fake",
                                "choices": [],
                                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n * choices},
                            }
                        )
                    send("[DONE]")
                    self.wfile.write(b"0\r\n\r\n")
                except (BrokenPipeError, ConnectionResetError):
                    outer.disconnects.append(self.path)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()

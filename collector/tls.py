"""TLS for the collector's HTTP listeners (the OTLP/HTTP receiver and ``/metrics``): one
certificate and key for all of them, the handshake run in each connection's own thread (with a
timeout) so that a client that never sends its ClientHello holds one connection, not the accept
loop."""

from __future__ import annotations

import ssl


def wrap_listener(server, cert: str, key: str) -> None:
    """Make ``server`` (a socketserver) accept TLS connections; the handshake is left to
    :class:`HandshakeInThread`."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    server.socket = ctx.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)


class HandshakeInThread:
    """A request-handler mixin: finishes the TLS handshake in the connection's thread, within
    ``timeout`` seconds (raises ``ssl.SSLError`` / ``TimeoutError`` on failure: the server's
    ``handle_error`` sees it)."""

    timeout: float | None = 10.0

    def setup(self):
        if isinstance(self.request, ssl.SSLSocket):
            self.request.settimeout(self.timeout)
            self.request.do_handshake()
        super().setup()


def is_handshake_failure(exc: BaseException | None) -> bool:
    return isinstance(exc, (ssl.SSLError, TimeoutError, ConnectionError))

"""A small HTTP server that runs beside the coordinator: a table of routes, an optional bearer token.

It serves GET requests from its own daemon threads (`ThreadingHTTPServer`), so a scrape never
waits for a round and a round never waits for a scrape. What it serves is a route table: path ->
handler; `/metrics` is the Prometheus exporter's, and a live view or a JSON state endpoint is
one more `route(...)`. With a token, every route answers 401 unless the request carries it
(`Authorization: Bearer TOKEN` or `?token=TOKEN`); a path without a route answers 404.
"""

from __future__ import annotations

import hmac
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Request:
    """What a route sees of a GET request: its path and its query parameters (first value of each)."""

    path: str
    query: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Response:
    """What a route answers."""

    body: bytes
    content_type: str = "text/plain; charset=utf-8"
    status: int = 200


Route = Callable[[Request], Response]


class ObserveServer:
    """Serves `routes` on `host:port` (port 0: a free one, see `port`) from `start()` to `stop()`."""

    def __init__(self, host: str, port: int, *, token: str | None = None) -> None:
        self.host = host
        self.requested_port = port
        self.token = token
        self.routes: dict[str, Route] = {}
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def route(self, path: str, handler: Route) -> None:
        """Serve `handler` at `path` (before or after `start`)."""
        self.routes[path] = handler

    @property
    def port(self) -> int:
        """The port listened on (the one picked when asked for 0)."""
        if self._server is None:
            return self.requested_port
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> None:
        """Bind and serve in a daemon thread; an OSError (port taken, address unknown) propagates."""
        handler = type("ObserveHandler", (_Handler,), {"observed": self})
        server_class = type("ObserveHTTPServer", (ThreadingHTTPServer,),
                            {"address_family": _family(self.host), "daemon_threads": True})
        self._server = server_class((self.host, self.requested_port), handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="edgepfl-http", daemon=True)
        self._thread.start()
        log.info("serving %s at %s", ", ".join(sorted(self.routes)) or "nothing", self.url)

    def stop(self) -> None:
        """Stop serving and close the socket (a no-op when not started)."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join()
        self._server = self._thread = None

    def __enter__(self) -> ObserveServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def answer(self, target: str, authorization: str | None) -> Response:
        """The response to a GET of `target` (path and query) with the given Authorization header."""
        parts = urlsplit(target)
        query = {key: values[0] for key, values in parse_qs(parts.query).items()}
        if self.token is not None and not self._authorized(authorization, query.get("token")):
            return Response(b"unauthorized: give the token (Authorization: Bearer TOKEN or ?token=TOKEN)\n",
                            status=401)
        route = self.routes.get(parts.path)
        if route is None:
            return Response(f"no such path: {parts.path}\n".encode(), status=404)
        query.pop("token", None)
        return route(Request(parts.path, query))

    def _authorized(self, authorization: str | None, query_token: str | None) -> bool:
        scheme, _, given = (authorization or "").partition(" ")
        candidate = given.strip() if scheme.lower() == "bearer" else query_token
        return candidate is not None and hmac.compare_digest(candidate.encode(), str(self.token).encode())


def _family(host: str) -> int:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


class _Handler(BaseHTTPRequestHandler):
    """Hands each GET to its `ObserveServer` (the `observed` class attribute)."""

    observed: ObserveServer
    server_version = "edgepfl"

    def do_GET(self) -> None:  # noqa: N802 (the name http.server calls)
        try:
            response = self.observed.answer(self.path, self.headers.get("Authorization"))
        except Exception:
            log.exception("GET %s failed", self.path)
            response = Response(b"internal error\n", status=500)
        self.send_response(response.status)
        self.send_header("Content-Type", response.content_type)
        self.send_header("Content-Length", str(len(response.body)))
        if response.status == 401:
            self.send_header("WWW-Authenticate", 'Bearer realm="edgepfl"')
        self.end_headers()
        self.wfile.write(response.body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (http.server's signature)
        log.debug("%s %s", self.address_string(), format % args)

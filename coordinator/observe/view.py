"""The live view's routes on an `ObserveServer`: the page at `/` and the state at `/state.json`.

The page is one HTML document shipped in the package (static/: index.html with live.css and
live.js put inline, so one request under the token gives the whole page; no build step). It
polls `/state.json` every second with the token it was opened with. During a run the state is
a `LiveState` fed the coordinator's events; `edgepfl view RUN_DIR` serves the state of a run
folder instead, read again at each request, so a run still going in that folder shows its new
rounds (`serve_folder`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from importlib.resources import files

from ..run.folder import RunFolder
from .http import ObserveServer, Request, Response
from .live import LiveState

log = logging.getLogger(__name__)

PAGE_PATHS = ("/", "/index.html")
STATE_PATH = "/state.json"


def page() -> bytes:
    """The page: static/index.html with its style and script inline."""
    static = files(__package__).joinpath("static")
    html = static.joinpath("index.html").read_text(encoding="utf-8")
    html = html.replace("/*STYLE*/", static.joinpath("live.css").read_text(encoding="utf-8"))
    return html.replace("/*SCRIPT*/", static.joinpath("live.js").read_text(encoding="utf-8")).encode()


def add_view_routes(server: ObserveServer, state: Callable[[], LiveState]) -> None:
    """Serve the page and `state()` as JSON (a new state per request, or always the same one)."""
    html = page()

    def serve_page(request: Request) -> Response:
        return Response(html, "text/html; charset=utf-8")

    def serve_state(request: Request) -> Response:
        return Response(state().to_bytes(), "application/json")

    for path in PAGE_PATHS:
        server.route(path, serve_page)
    server.route(STATE_PATH, serve_state)


def page_url(server: ObserveServer) -> str:
    """The address to open the page at (with `?token=` when the server has a token)."""
    return f"{server.url}/" + (f"?token={server.token}" if server.token else "")


def serve_folder(run_dir: str, host: str, port: int, *, token: str | None = None,
                 stop: threading.Event | None = None, on_start: Callable[[str], None] | None = None) -> None:
    """Serve the view of the run in `run_dir` until `stop` is set (or forever); `on_start` gets
    the page's URL once the server listens. A folder without metrics.jsonl is a FileNotFoundError."""
    folder = RunFolder(run_dir)
    if not folder.metrics.is_file():
        raise FileNotFoundError(f"{run_dir}: no run here (no {folder.metrics.name}); give a run's --out folder")
    server = ObserveServer(host, port, token=token)
    add_view_routes(server, lambda: LiveState.from_folder(folder))
    with server:
        if on_start is not None:
            on_start(page_url(server))
        (stop or threading.Event()).wait()

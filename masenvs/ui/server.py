"""`masenvs ui [RUN_DIR ...]`: a local web app over what the trainer and `masenvs eval` wrote.

Server-rendered pages (Starlette + Jinja2, autoescaped: model output is shown as text, never
run as HTML) with two vendored scripts: htmx, which re-fetches the page of a live run and
swaps in what changed, and uPlot for the curves. Loopback by default; any other address
needs an API key (the same rule as `masenvs serve`), from $MASENVS_API_KEY or
`--api-key-file`, never the command line, and `key=` never reaches the access log. Every
route is a GET: a request with a body is refused (413) before any of it is read.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from jinja2 import Undefined
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from masenvs.listeners import (
    API_KEY_ENV,
    ListenerError,
    add_listener_arguments,
    head_timeout_protocol,
    is_loopback,
    key_from,
    scrub_keys,
)
from masenvs.ui import charts, evals, workflows
from masenvs.ui.calls import Tokens, conversation
from masenvs.ui.diagnosis import diagnose, flat_groups, latest
from masenvs.ui.runs import EvalReport, Run, RunError, discover, step_stats, step_summary
from masenvs.ui.steps import step_view

log = logging.getLogger(__name__)
HERE = Path(__file__).parent
COOKIE = "masenvs_ui_key"
POLL_SECONDS = 2  # how often a live page asks whether its run changed
TASKS_PER_PAGE = 10  # tasks drawn on a step's page at once
LOOPBACK_HOSTS = ["127.0.0.1", "localhost", "[::1]", "::1"]


class Catalog:
    """The runs and eval reports being shown, found again when a new run directory appears."""

    def __init__(self, paths: list[str | Path]) -> None:
        self.paths = list(paths)
        self.runs: dict[str, Run] = {}
        self.reports: dict[str, EvalReport] = {}
        self.rescan()
        # Indexes every run in the background, so that a large run's first build does not
        # hold a request and a live run's new lines are indexed before anyone asks.
        threading.Thread(target=self._index_forever, daemon=True, name="ui-indexer").start()

    def _index_forever(self) -> None:
        while True:
            for run in list(self.runs.values()):
                try:
                    if run.open_index().refresh(min_interval=0.0, wait=0.0):
                        step_stats(run)  # pages then find the per-step stats ready
                except Exception:  # noqa: BLE001 (a bad file must not stop the indexer)
                    log.exception("indexing %s failed", run.path)
            time.sleep(1.0)

    def rescan(self) -> None:
        runs, reports = discover(self.paths)
        for run in runs:  # keep the open indexes of runs seen before
            known = next((r for r in self.runs.values() if r.path == run.path), None)
            if known is None:
                Tokens.warm(run.model)  # token pieces need the tokenizer: load it now
            self.runs.setdefault(known.id if known else run.id, known or run)
        self.reports = {r.id: r for r in reports}
        for report in reports:
            for policy in report.policies:
                self.runs.setdefault(policy.id, policy)

    def run(self, rid: str) -> Run:
        if rid not in self.runs:
            self.rescan()
        if rid not in self.runs:
            raise NotFound(f"no run {rid!r}")
        return self.runs[rid]

    def training_runs(self) -> list[Run]:
        return [r for r in self.runs.values() if r.kind in ("train", "rollout")]


class NotFound(Exception):
    pass


def create_app(
    paths: list[str | Path], api_key: str | None = None, host: str = "127.0.0.1"
) -> Starlette:
    """The app over `paths`; with `api_key`, every request must carry it (header, cookie or
    `?key=` once, which sets the cookie)."""
    pages = Pages(Catalog(paths))
    routes = [
        Route("/", pages.index),
        Route("/run/{rid}", pages.run_page),
        Route("/run/{rid}/step/{step:int}", pages.step_page),
        Route("/run/{rid}/call/{cid:path}", pages.call_page),
        Route("/run/{rid}/design/{did}", pages.design_page),
        Route("/run/{rid}/rollout/{rollout:path}", pages.rollout_page),
        Route("/eval/{eid}", pages.eval_page),
        Mount("/static", _CachedStatic(directory=str(HERE / "static")), name="static"),
    ]
    middleware = []
    if _is_loopback(host):  # a page on another site cannot reach us by DNS rebinding
        middleware.append(Middleware(TrustedHostMiddleware, allowed_hosts=LOOPBACK_HOSTS))
    app = Starlette(
        routes=routes, middleware=middleware, exception_handlers={NotFound: pages.not_found}
    )
    app.state.catalog = pages.catalog
    if api_key:
        return _NoBodies(_KeyGate(app, api_key))  # type: ignore[return-value]
    return _NoBodies(app)  # type: ignore[return-value]


class Pages:
    """The app's pages over one catalog of runs. Handlers are plain functions: Starlette runs
    them in its thread pool, so a slow query of one page never holds another (sqlite and file
    reads block)."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self.templates = Jinja2Templates(directory=str(HERE / "templates"))
        self.templates.env.globals["poll_seconds"] = POLL_SECONDS
        self.templates.env.globals["tasks_per_page"] = TASKS_PER_PAGE
        self.templates.env.globals["v"] = _asset_version()
        self.templates.env.filters["num"] = _num

    def page(
        self,
        request: Request,
        name: str,
        context: dict[str, Any],
        live: Any = None,
        poll: bool = False,
    ) -> Response:
        indexing = live.open_index().progress() if isinstance(live, Run) else 1.0
        version = live.version() if live is not None else ""
        if indexing < 1.0:
            version += f".{indexing:.2f}"
        is_live = live is not None and (poll or indexing < 1.0 or live.status() == "running")
        since = request.headers.get("x-since")
        if request.headers.get("hx-request") and since is not None and since == version:
            return Response(status_code=204)  # nothing new: htmx keeps the page as it is
        running = live is not None and live.status() == "running"
        context = {
            "request": request,
            "version": version,
            "live": is_live,
            "running": running,
            "indexing": indexing,
            **context,
        }
        return self.templates.TemplateResponse(request, name, context)

    def index(self, request: Request) -> Response:
        self.catalog.rescan()
        runs = self.catalog.training_runs()
        chosen = request.query_params.getlist("run") or [r.id for r in runs]
        shown = [r for r in runs if r.id in chosen]
        live = _Combined(shown, [r.id for r in runs] + list(self.catalog.reports))
        return self.page(
            request,
            "runs.html",
            {
                "runs": runs,
                "headline": {r.id: _headline(r) for r in runs},
                "chosen": chosen,
                "reports": list(self.catalog.reports.values()),
                "charts": charts.curves(shown, several=len(shown) > 1),
            },
            live,
            poll=True,  # a new run directory shows up by itself
        )

    def run_page(self, request: Request) -> Response:
        run = self.catalog.run(request.path_params["rid"])
        metrics = run.metrics()
        index = run.index
        steps = run.steps()
        by_step = {r["step"]: r for r in metrics}
        summary = step_summary(run)
        designs = index.query("SELECT COUNT(*) AS n FROM designs")[0]["n"]
        return self.page(
            request,
            "run.html",
            {
                "run": run,
                "agents": run.agents(),
                "steps": steps,
                "by_step": by_step,
                "summary": summary,
                "charts": charts.curves([run], several=False),
                "behaviour": charts.behaviour(run),
                "designs": designs,
                "workflow_runs": workflows.workflow_runs(run)
                if run.workflow or run.kind == "rollout"
                else [],
                "counts": index.counts(),
                "diagnosis": diagnose(run),
                "flat": flat_groups(run),
                "val": latest(run, "val/success"),
            },
            run,
        )

    def step_page(self, request: Request) -> Response:
        run = self.catalog.run(request.path_params["rid"])
        step = request.path_params["step"]
        view = step_view(run, step)
        # a step of many tasks opens on TASKS_PER_PAGE of them; the index links every one
        tasks = view["tasks"]
        wanted = request.query_params.get("task")
        try:
            first = max(0, int(request.query_params.get("from", "0")))
        except ValueError:
            first = 0
        view["all_tasks"] = [t["task_id"] for t in tasks]
        if wanted is not None:
            view["tasks"] = [t for t in tasks if t["task_id"] == wanted]
        else:
            view["tasks"] = tasks[first : first + TASKS_PER_PAGE]
        view["first"] = first
        steps = run.steps()
        designs = run.index.query(
            "SELECT design_id, task_id, round, reward, error, structure, executions "
            "FROM designs WHERE step = ? ORDER BY rowid",
            (step,),
        )
        live = run if not tasks else None  # a step still running fills in by itself
        return self.page(
            request,
            "step.html",
            {
                "run": run,
                "step": step,
                "view": view,
                "steps": steps,
                "designs": designs,
                "workflow_runs": workflows.workflow_runs(run, step) if run.workflow else [],
            },
            live,
        )

    def call_page(self, request: Request) -> Response:
        run = self.catalog.run(request.path_params["rid"])
        try:
            tolerance = float(request.query_params.get("tol", "0.05"))
        except ValueError:
            tolerance = 0.05
        view = conversation(run, request.path_params["cid"], tolerance)
        if view is None:
            progress = run.open_index().progress()
            later = f" yet (indexing: {progress:.0%})" if progress < 1 else ""
            raise NotFound(f"no call {request.path_params['cid']!r} in run {run.id!r}{later}")
        return self.page(request, "call.html", {"run": run, "view": view})

    def design_page(self, request: Request) -> Response:
        run = self.catalog.run(request.path_params["rid"])
        view = workflows.design_view(run, request.path_params["did"])
        if view is None:
            raise NotFound(f"no design {request.path_params['did']!r} in run {run.id!r}")
        return self.page(request, "design.html", {"run": run, "view": view})

    def rollout_page(self, request: Request) -> Response:
        run = self.catalog.run(request.path_params["rid"])
        rollout = request.path_params["rollout"]
        view = workflows.rollout_view(run, rollout)
        if not view["calls"] and view["episode"] is None:
            raise NotFound(f"no rollout {rollout!r} in run {run.id!r}")
        return self.page(request, "rollout.html", {"run": run, "rollout": rollout, "view": view})

    def eval_page(self, request: Request) -> Response:
        self.catalog.rescan()
        report = self.catalog.reports.get(request.path_params["eid"])
        if report is None:
            raise NotFound(f"no eval report {request.path_params['eid']!r}")
        view = evals.eval_task_view(report, request.query_params.get("task"))
        swaps = evals.swap_results(report, list(self.catalog.reports.values()))
        return self.page(request, "eval.html", {"report": report, "view": view, "swaps": swaps})

    async def not_found(self, request: Request, exc: Exception) -> Response:
        return self.templates.TemplateResponse(
            request, "error.html", {"request": request, "message": str(exc)}, status_code=404
        )


def _headline(run: Run) -> dict[str, Any]:
    """The runs list's row: validation success first (the last batch's training success is
    noisy and not what the run reached), then training success, and the run's verdict."""
    val, train = latest(run, "val/success"), latest(run, "train/success")
    return {"val": val, "train": train, "diagnosis": diagnose(run)}


class _CachedStatic(StaticFiles):
    """The vendored scripts and styles, cached by the browser: their URLs carry `?v=` of the
    files' state, so a new version is fetched and an unchanged one is not even revalidated."""

    async def get_response(self, path: str, scope: Any) -> Response:
        response = await super().get_response(path, scope)
        if response.status_code == 200:
            response.headers["Cache-Control"] = "public, max-age=86400, immutable"
        return response


def _asset_version() -> str:
    stamp = "".join(
        f"{p.name}{p.stat().st_mtime_ns}{p.stat().st_size}"
        for p in sorted((HERE / "static").iterdir())
    )
    return hashlib.sha1(stamp.encode()).hexdigest()[:10]


class _Combined:
    """Several runs polled as one (the runs page)."""

    def __init__(self, runs: list[Run], names: list[str]) -> None:
        self.runs, self.names = runs, names

    def version(self) -> str:
        return "|".join([*self.names, *(r.version() for r in self.runs)])

    def status(self) -> str:
        return "running" if any(r.status() == "running" for r in self.runs) else "finished"


class _NoBodies:
    """Answers 413 to a request that announces a body, before reading any of it: every page
    is a GET, so a body can only be an attempt to make the server hold one."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.state = getattr(app, "state", None)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            length = headers.get(b"content-length", b"0").strip()
            if b"transfer-encoding" in headers or length not in (b"", b"0"):
                response = HTMLResponse(
                    "the ui takes no request bodies",
                    status_code=413,
                    headers={"Connection": "close"},
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _KeyGate:
    """Lets a request through with the key as 'Authorization: Bearer KEY', the cookie, or
    `?key=KEY` (which sets the cookie and redirects to the address without it)."""

    def __init__(self, app: Any, key: str) -> None:
        self.app, self.key = app, key.encode()

    def _ok(self, given: str | None) -> bool:
        return bool(given) and hmac.compare_digest(given.strip().encode(), self.key)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        scheme, _, bearer = request.headers.get("authorization", "").partition(" ")
        if (scheme.lower() == "bearer" and self._ok(bearer)) or self._ok(
            request.cookies.get(COOKIE)
        ):
            await self.app(scope, receive, send)
            return
        given = request.query_params.get("key")
        if given is not None and self._ok(given):
            rest = [(k, v) for k, v in request.query_params.multi_items() if k != "key"]
            target = request.url.path + (f"?{urlencode(rest)}" if rest else "")
            response: Response = RedirectResponse(target, status_code=303)
            response.set_cookie(COOKIE, given, httponly=True, samesite="strict")
        else:
            response = HTMLResponse(_KEY_FORM, status_code=401)
        await response(scope, receive, send)


_KEY_FORM = """<!doctype html><html><head><meta charset="utf-8"><title>masenvs ui: key</title>
<link rel="stylesheet" href="/static/app.css"></head><body><main class="narrow">
<h1>masenvs ui</h1><p>This server needs its API key (the one in the server's
MASENVS_API_KEY or --api-key-file).</p><form method="get"><input type="password" name="key" autofocus
aria-label="API key"> <button>Open</button></form></main></body></html>"""


def _num(value: Any, digits: int = 3) -> str:
    if value is None or isinstance(value, Undefined):
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    try:
        return f"{float(value):.{digits}g}"
    except (TypeError, ValueError):
        return str(value)


def _is_loopback(host: str) -> bool:
    return is_loopback(host)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="masenvs ui",
        description="Browse training runs, their steps, trees and conversations, auto-MAS "
        "designs, workflow runs and eval reports in a web browser; live while a run trains.",
    )
    parser.add_argument(
        "paths",
        nargs="*",
        metavar="RUN_DIR",
        help="run directories, eval reports (eval-*.json) or folders of them (default: runs)",
    )
    # --api-key-file PATH or $MASENVS_API_KEY; beyond loopback the UI always needs a key
    add_listener_arguments(parser, API_KEY_ENV, port=8765, no_auth=False)
    parser.add_argument("--log-level", default="warning")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        args.api_key = key_from(args, API_KEY_ENV)
    except ListenerError as exc:
        print(f"masenvs ui: {exc}", file=sys.stderr)
        return 2
    if not _is_loopback(args.host) and not args.api_key:
        print(
            f"masenvs ui: refusing to listen on {args.host} without an API key; anyone who can "
            "reach this machine could read your runs. Set MASENVS_API_KEY or give "
            "--api-key-file PATH, or bind to 127.0.0.1 and use an SSH port forward.",
            file=sys.stderr,
        )
        return 2
    paths = args.paths or ["runs"]
    try:
        app = create_app(paths, api_key=args.api_key, host=args.host)
    except RunError as exc:
        print(f"masenvs ui: {exc}", file=sys.stderr)
        return 2
    import socket

    import uvicorn

    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        print(f"masenvs ui: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    sock.listen(128)  # connections queue from now on: the printed address answers at once
    port = sock.getsockname()[1]
    shown = "localhost" if _is_loopback(args.host) else args.host
    url = f"http://{shown}:{port}/"
    if args.api_key:
        url += "?key=<your key>"  # a placeholder: the key itself is never printed
    key = "key: set" if args.api_key else "no key"
    print(f"masenvs ui: {url}  ({', '.join(str(p) for p in paths)}; {key})", flush=True)
    config = uvicorn.Config(
        app,
        log_level=args.log_level,
        http=head_timeout_protocol(),  # a connection that sends no request is closed
    )
    scrub_keys()  # `?key=` opens the ui once: the access log shows `key=***`
    uvicorn.Server(config).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

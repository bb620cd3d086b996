"""The metrics port: /metrics for Prometheus, /status (a self-refreshing page), /status.json."""

from __future__ import annotations

import asyncio
import contextlib
import html
import json
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from coordinator.contract.errors import CoordinatorError, PermissionDenied, Unavailable
from coordinator.edge.auth import Auth
from coordinator.service.core import Coordinator
from coordinator.state.base import VerdictRow

# How often the page reloads itself; dashboards need no faster.
REFRESH_S = 2


def snapshot(coordinator: Coordinator, recent: int = 20) -> dict[str, Any]:
    """Everything the page shows, as JSON-ready data (runs on the coordinator's loop)."""
    summaries = coordinator.summaries()
    history = coordinator.observer.history
    problem = coordinator.observer.history_problem()
    verdicts = None
    if history is not None:
        with contextlib.suppress(Unavailable):  # an unreadable file: the live verdicts
            verdicts = _stored(history.recent(recent))
    if verdicts is None:
        verdicts = [
            {
                "job_id": s.job_id,
                "round": s.round,
                "outcome": s.state,
                "cause": "",
                "reason": s.reason,
                "report": "",
                "decided_at": s.decided_at,
                "cohort_id": s.cohort_id,
            }
            for s in sorted(summaries, key=lambda s: -s.decided_at)
            if s.state != "waiting"
        ][:recent]
    return {
        "generated_at": time.time(),
        "degraded": {"history": problem} if problem else {},
        "waiting": [s.to_dict() for s in summaries if s.state == "waiting"],
        "recent_verdicts": verdicts,
    }


def _stored(rows: list[VerdictRow]) -> list[dict[str, Any]]:
    return [
        {
            "job_id": r.job_id,
            "round": r.round,
            "outcome": r.outcome,
            "cause": r.cause,
            "reason": r.reason,
            "report": r.report,
            "decided_at": r.decided_at,
            "cohort_id": r.cohort_id,
        }
        for r in rows
    ]


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts)) + "Z" if ts else ""


def render_page(data: dict[str, Any]) -> str:
    esc = html.escape
    rows = []
    for c in data["waiting"]:
        pct = 100.0 * c["joined"] / max(c["expected"], 1)
        rows.append(
            f"<tr><td>{esc(c['job_id'])}</td><td>{c['round']}</td>"
            f"<td><div class=bar><div style='width:{pct:.1f}%'></div></div>"
            f"{c['joined']}/{c['expected']}</td>"
            f"<td class=missing>{esc(c['missing_ranks']) or '&mdash;'}</td>"
            f"<td>{c['age_s']:.0f}s</td><td>{c['deadline_in_s']:.0f}s</td>"
            f"<td>{esc(c['reason'])}</td></tr>"
        )
    waiting = "".join(rows) or "<tr><td colspan=7>no cohort is waiting</td></tr>"
    verdict_rows = []
    for v in data["recent_verdicts"]:
        cls = "formed" if v["outcome"] == "formed" else "refused"
        report = (
            f"<details><summary>report</summary><pre>{esc(v['report'])}</pre></details>"
            if v["report"]
            else ""
        )
        verdict_rows.append(
            f"<tr class={cls}><td>{esc(v['job_id'])}</td><td>{v['round']}</td>"
            f"<td>{esc(v['outcome'])}</td><td>{esc(v['reason'])}{report}</td>"
            f"<td>{_when(v['decided_at'])}</td></tr>"
        )
    verdicts = "".join(verdict_rows) or "<tr><td colspan=5>no verdict yet</td></tr>"
    degraded = "".join(
        f"<p class=missing>degraded: {esc(what)}: {esc(why)}</p>"
        for what, why in data.get("degraded", {}).items()
    )
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><meta http-equiv="refresh" content="{REFRESH_S}">
<title>cohortgate status</title>
<style>
body{{font:14px system-ui,sans-serif;margin:1.5em;color:#222}}
table{{border-collapse:collapse;width:100%;margin-bottom:2em}}
th,td{{border-bottom:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}}
th{{background:#f4f4f4}} .missing{{color:#b00;font-weight:600}}
.bar{{display:inline-block;width:120px;height:10px;background:#eee;margin-right:6px}}
.bar div{{height:10px;background:#3a7}} tr.refused td{{background:#fff0f0}}
tr.formed td{{background:#f0fff4}} pre{{white-space:pre-wrap;font-size:12px}}
</style></head><body>
<h1>cohortgate</h1>
<p>updated {_when(data["generated_at"])}, refreshes every {REFRESH_S}s &middot;
<a href="status.json">JSON</a> &middot; <a href="metrics">metrics</a></p>
{degraded}
<h2>Waiting cohorts</h2>
<table><tr><th>job</th><th>round</th><th>joined</th><th>missing ranks</th><th>age</th>
<th>deadline in</th><th>reason</th></tr>{waiting}</table>
<h2>Recent verdicts</h2>
<table><tr><th>job</th><th>round</th><th>outcome</th><th>reason</th><th>decided</th></tr>
{verdicts}</table>
</body></html>"""


class MetricsServer:
    """A small threaded HTTP server; it reads coordinator state by hopping onto its loop."""

    def __init__(
        self,
        coordinator: Coordinator,
        loop: asyncio.AbstractEventLoop,
        addr: str,
        auth: Auth | None = None,
        tls: ssl.SSLContext | None = None,
    ):
        self.coordinator = coordinator
        self.loop = loop
        host, _, port = addr.rpartition(":")
        handler = _handler(self._snapshot, self._refresh_gauges, coordinator, auth or Auth(None))
        self.httpd = ThreadingHTTPServer((host.strip("[]"), int(port)), handler)
        if tls is not None:
            # The handshake runs in each connection's own thread, not in accept().
            self.httpd.socket = tls.wrap_socket(
                self.httpd.socket, server_side=True, do_handshake_on_connect=False
            )
        self.httpd.daemon_threads = True
        self.port = int(self.httpd.server_address[1])
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _on_loop(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the coordinator's event loop (its state belongs to that loop alone)."""

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=10)

    def _snapshot(self) -> dict[str, Any]:
        result: dict[str, Any] = self._on_loop(lambda: snapshot(self.coordinator))
        return result

    def _refresh_gauges(self) -> None:
        # A scrape needs only the gauges derived from the cohorts, not the page's snapshot
        # (which also reads the history database).
        self._on_loop(self.coordinator.summaries)


@dataclass(frozen=True)
class _Sources:
    """What the HTTP threads read: each call hops onto the coordinator's loop."""

    take: Callable[[], dict[str, Any]]
    refresh_gauges: Callable[[], None]
    coordinator: Coordinator
    auth: Auth


class _StatusHandler(BaseHTTPRequestHandler):
    sources: ClassVar[_Sources]

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path in ("/", "/status", "/status.json") and not self._admin():
            return
        src = self.sources
        if path == "/metrics":
            src.refresh_gauges()
            registry = src.coordinator.observer.metrics.registry
            self._send(200, CONTENT_TYPE_LATEST, generate_latest(registry))
        elif path in ("/", "/status"):
            self._send(200, "text/html; charset=utf-8", render_page(src.take()).encode())
        elif path == "/status.json":
            self._send(200, "application/json", json.dumps(src.take(), indent=1).encode())
        elif path == "/healthz":
            problem = src.coordinator.observer.history_problem()  # thread-safe reads
            said = f"degraded: history: {problem}\n" if problem else "ok\n"
            self._send(200, "text/plain", said.encode())
        else:
            self._send(404, "text/plain", b"not found: try /status, /status.json, /metrics\n")

    def _admin(self) -> bool:
        """Job names and refusal reports: only for an admin token once tokens are on."""
        auth = self.sources.auth
        if not auth.enabled:
            return True
        try:
            header = self.headers.get("Authorization", "")
            if not auth.grant([("authorization", header)] if header else []).admin:
                raise PermissionDenied("the status page needs an admin token")
        except CoordinatorError as exc:
            self._send(401, "text/plain", f"{exc}\n".encode())
            return False
        return True

    def _send(self, code: int, kind: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # scrapes every 15 s would drown the decision log


def _handler(
    take: Callable[[], dict[str, Any]],
    refresh_gauges: Callable[[], None],
    coordinator: Coordinator,
    auth: Auth,
) -> type[BaseHTTPRequestHandler]:
    sources = _Sources(take, refresh_gauges, coordinator, auth)
    return type("Handler", (_StatusHandler,), {"sources": sources})

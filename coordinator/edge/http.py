"""The metrics port: /metrics for Prometheus, /status (a self-refreshing page), /status.json."""

from __future__ import annotations

import contextlib
import html
import json
import ssl
import time
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from cohortgate.coordinator.contract.errors import CoordinatorError, PermissionDenied, Unavailable
from cohortgate.coordinator.edge.auth import Auth
from cohortgate.coordinator.service.core import Coordinator
from cohortgate.coordinator.state.base import VerdictRow

# How often the page reloads itself; dashboards need no faster.
REFRESH_S = 2


def snapshot(coordinator: Coordinator, recent: int = 20) -> dict[str, Any]:
    """Everything the page shows, as JSON-ready data (runs on the coordinator's loop)."""
    summaries = coordinator.summaries()
    problem = coordinator.history_problem()
    verdicts = None
    with contextlib.suppress(Unavailable):  # an unreadable file: the live verdicts
        verdicts = _stored(coordinator.history.recent(recent))
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
    replica = coordinator.observer.replica() if coordinator.observer.replica else None
    degraded = {"history": problem} if problem else {}
    if replica is not None and replica["role"] != "leader":
        leader = replica["leader"]
        degraded["standby"] = (
            f"this replica stands by; the leader is at {leader}"
            if leader
            else "this replica stands by and no replica leads now"
        )
    if replica is not None and replica["etcd"]:
        degraded["etcd"] = replica["etcd"]
    return {
        "generated_at": time.time(),
        "degraded": degraded,
        "replica": replica,
        "waiting": [s.to_dict() for s in summaries if s.state == "waiting"],
        "recent_verdicts": verdicts,
        "audits": coordinator.audits.status(),
        "stalls": coordinator.stalls.status(),
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
    audits = _audit_rows(data.get("audits", []))
    stalls = _stall_rows(data.get("stalls", []))
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
<h2>Audits during training</h2>
<table><tr><th>job</th><th>ranks</th><th>policy</th><th>last step</th><th>compared to</th>
<th>state</th></tr>{audits}</table>
<h2>Progress during training</h2>
<table><tr><th>job</th><th>ranks</th><th>policy</th><th>step</th><th>median step</th>
<th>stall after</th><th>state</th></tr>{stalls}</table>
</body></html>"""


def _audit_rows(audits: list[dict[str, Any]]) -> str:
    esc = html.escape
    rows = []
    for a in audits:
        cls, state = "formed", "replicas agree"
        if a["diverged_step"]:
            cls, state = "refused", a["headline"]
            if a["stop_step"]:
                state += f" (stops at step {a['stop_step']})"
        elif a["missing"]:
            cls, state = "refused", f"no audit in time from ranks {a['missing']}"
        rows.append(
            f"<tr class={cls}><td>{esc(a['job_id'])}</td><td>{a['ranks']}</td>"
            f"<td>{esc(a['level'])}</td><td>{a['last_step']}</td><td>{a['last_compared']}</td>"
            f"<td>{esc(state)}</td></tr>"
        )
    return "".join(rows) or "<tr><td colspan=6>no job audits (cohort.audit)</td></tr>"


def _stall_rows(lines: list[dict[str, Any]]) -> str:
    esc = html.escape
    rows = []
    for c in lines:
        stall = c["stall"]
        if stall:
            cls = "refused"
            state = (
                f"{esc(stall['headline'])}<details><summary>report</summary>"
                f"<pre>{esc(stall['report'])}</pre></details>"
            )
        else:
            cls, state = "formed", f"last new step {c['since_progress_s']:.0f}s ago"
        if c.get("stragglers"):
            state += "<br>stragglers: " + "; ".join(esc(s) for s in c["stragglers"])
        median = "" if c["median_step_s"] is None else f"{c['median_step_s']:.3g}s"
        bound = (
            "auto (no step time yet)"
            if c["stall_after_s"] is None
            else (f"{c['stall_after_s']:.0f}s")
        )
        rows.append(
            f"<tr class={cls}><td>{esc(c['job_id'])}</td><td>{c['ranks']}</td>"
            f"<td>{esc(c['level'])}</td><td>{c['step']}</td><td>{median}</td><td>{bound}</td>"
            f"<td>{state}</td></tr>"
        )
    return "".join(rows) or "<tr><td colspan=7>no job marks steps (cohort.step)</td></tr>"


class MetricsServer:
    """The HTTP port on the coordinator's own event loop (aiohttp): no thread per request,
    no hop between threads, keep-alive and backpressure from aiohttp, HTTPS when given a
    TLS context. /metrics stays prometheus-client's exposition."""

    def __init__(
        self,
        coordinator: Coordinator,
        addr: str,
        auth: Auth | None = None,
        tls: ssl.SSLContext | None = None,
    ):
        self.coordinator = coordinator
        self.auth = auth or Auth(None)
        self.tls = tls
        host, _, port = addr.rpartition(":")
        self.host, self.port = host.strip("[]"), int(port)
        app = web.Application()
        app.router.add_get("/", self._page)
        app.router.add_get("/status", self._page)
        app.router.add_get("/status.json", self._json)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        self.runner = web.AppRunner(app, access_log=None)  # scrapes would drown the log

    async def start(self) -> None:
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.host, self.port, ssl_context=self.tls)
        await site.start()
        self.port = int(self.runner.addresses[0][1])

    async def stop(self) -> None:
        await self.runner.cleanup()

    def _denied(self, request: web.Request) -> web.Response | None:
        """Job names and refusal reports: only for an admin token once tokens are on."""
        if not self.auth.enabled:
            return None
        header = request.headers.get("Authorization", "")
        try:
            if not self.auth.grant([("authorization", header)] if header else []).admin:
                raise PermissionDenied("the status page needs an admin token")
        except CoordinatorError as exc:
            return _text(401, f"{exc}\n")
        return None

    async def _page(self, request: web.Request) -> web.Response:
        denied = self._denied(request)
        if denied is not None:
            return denied
        body = render_page(snapshot(self.coordinator))
        return web.Response(text=body, content_type="text/html", charset="utf-8", headers=_NO_STORE)

    async def _json(self, request: web.Request) -> web.Response:
        denied = self._denied(request)
        if denied is not None:
            return denied
        body = json.dumps(snapshot(self.coordinator), indent=1)
        return web.Response(text=body, content_type="application/json", headers=_NO_STORE)

    async def _metrics(self, request: web.Request) -> web.Response:
        self.coordinator.summaries()  # the gauges derived from the cohorts, fresh
        body = generate_latest(self.coordinator.observer.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST, **_NO_STORE})

    async def _healthz(self, request: web.Request) -> web.Response:
        problem = self.coordinator.history_problem()
        return _text(200, f"degraded: history: {problem}\n" if problem else "ok\n")


_NO_STORE = {"Cache-Control": "no-store"}


def _text(status: int, body: str) -> web.Response:
    return web.Response(status=status, text=body, headers=_NO_STORE)

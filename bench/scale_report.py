"""bench_scale.py's tables: the median of repeated runs, cohortgate against its peers and
the floor (ratios in one run), and the active/standby rows."""

from __future__ import annotations

import statistics
from typing import Any


def medians(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's row: the first run's fields, timings as the median over the runs."""
    row = dict(results[0])
    for key in (
        "first_join_to_done_s",
        "last_join_to_done_s",
        "decided_to_done_s",
        "coordinator_cpu_s",
        "coordinator_peak_rss_mib",
    ):
        if key in row:
            row[key] = statistics.median(r[key] for r in results)
    row["runs"] = results
    return row


def print_table(rows: list[dict[str, Any]], hop: dict[str, float] | None) -> None:
    print(
        f"{'system':<20} {'ranks':>7} {'first->done':>12} {'last->done':>11} {'decided->done':>14} "
        f"{'server CPU':>10} {'peak RSS':>9} {'bytes':>12} {'uploads':>8}  outcomes"
    )
    for r in rows:
        line = (
            f"{r['system']:<20} {r['ranks']:>7} {r['first_join_to_done_s']:>11.3f}s "
            f"{r['last_join_to_done_s']:>10.3f}s "
            + (f"{r['decided_to_done_s']:>13.3f}s " if "decided_to_done_s" in r else f"{'':>15}")
        )
        if "coordinator_cpu_s" in r:
            line += f"{r['coordinator_cpu_s']:>9.2f}s {r['coordinator_peak_rss_mib']:>6.0f}MiB "
        if "payload_bytes" in r:
            line += f"{r['payload_bytes']:>12} {r['manifests_uploaded']:>8}  {r['outcomes']}"
        print(line)
    if hop:
        print(
            f"relay hop, measured: {hop['ranks']} ranks form in "
            f"{hop['relayed_s_median'] * 1e3:.1f} ms through a real relay"
            + (f" over node relays of {hop['node_relays_of']}" if hop["node_relays_of"] else "")
            + ", "
            f"{hop['direct_s_median'] * 1e3:.1f} ms directly: +{hop['hop_s'] * 1e3:.1f} ms, "
            "added to cohortgate's times in the ratios below (+hop)"
        )
    ours = {
        r["ranks"]: r
        for r in rows
        if r["system"].startswith("cohortgate")
        and not r["system"].endswith("/bare")
        and "+etcd" not in r["system"]
    }
    print_ha(rows, ours)
    extra = hop["hop_s"] if hop else 0.0
    floors = {r["ranks"]: r for r in rows if r["system"].startswith("floor")}
    for n, floor in floors.items():
        mine, base = ours[n], floor
        print(
            f"{n} ranks: cohortgate / floor (same transport, loop and clients, no hop) = "
            f"{mine['first_join_to_done_s'] / base['first_join_to_done_s']:.2f} first join "
            f"to done, {mine['coordinator_cpu_s'] / base['coordinator_cpu_s']:.2f} server CPU"
        )
    for r in rows:
        if r["system"].split("/")[0] in ("tcpstore", "lighthouse"):
            mine = ours[r["ranks"]]["first_join_to_done_s"] + extra
            print(
                f"{r['ranks']} ranks: cohortgate{'+hop' if hop else ''} / {r['system']} "
                f"(first join to done, medians, same grouping) = "
                f"{mine / r['first_join_to_done_s']:.2f}"
            )
            if r["ranks"] in floors:
                floor_s = floors[r["ranks"]]["first_join_to_done_s"]
                print(
                    f"{r['ranks']} ranks: floor / {r['system']} (what the stack alone costs) = "
                    f"{floor_s / r['first_join_to_done_s']:.2f}"
                )


def print_ha(rows: list[dict[str, Any]], ours: dict[int, dict[str, Any]]) -> None:
    for r in rows:
        if "+etcd" in r["system"] and r["ranks"] in ours:
            base = ours[r["ranks"]]
            print(
                f"{r['ranks']} ranks: cohortgate on etcd / on SQLite (the cost of HA) = "
                f"{r['first_join_to_done_s'] / base['first_join_to_done_s']:.2f} first join "
                f"to done, {r['coordinator_cpu_s'] / base['coordinator_cpu_s']:.2f} server CPU"
            )

"""The table of cohorts watched during training (service/watched.py), shared by the audits
and the stalls: taken once, checked against the round it claims, bounded, forgotten idle."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from cohortgate.coordinator.contract.errors import FailedPrecondition, LimitExceeded
from cohortgate.coordinator.service.watched import EVICT_EVERY_S, Watched

pytestmark = pytest.mark.timeout(30)


@dataclass
class Tracked:
    cohort_id: str
    hosts: dict[int, str]
    last_seen: float


def table(limit: int = 2) -> tuple[Watched[Tracked], list[int], list[list[str]]]:
    sizes: list[int] = []
    gone: list[list[str]] = []
    formed = {("j", 1): ("j/1/aaaa", {0: "node0", 1: "node1"})}
    watched = Watched[Tracked](
        limit=limit,
        room_idle_s=100.0,
        formed=lambda job, round_: formed.get((job, round_)),
        noun="audit",
        participle="audited",
        sized=sizes.append,
        evicted=lambda out: gone.append([t.cohort_id for t in out]),
    )
    return watched, sizes, gone


def test_a_cohort_is_made_once_with_its_hosts_and_named_by_its_round() -> None:
    watched, sizes, _ = table(limit=3)
    made = watched.take("j/1/aaaa", "j", 1, 0.0, lambda hosts: Tracked("j/1/aaaa", hosts, 0.0))
    again = watched.take("j/1/aaaa", "j", 1, 5.0, lambda hosts: Tracked("other", hosts, 5.0))
    assert again is made and made.hosts == {0: "node0", 1: "node1"} and sizes == [1]
    unknown = watched.take("k/1/bbbb", "k", 1, 0.0, lambda hosts: Tracked("k", hosts, 0.0))
    assert unknown.hosts == {}, "a round the store no longer holds: no hosts, still taken"
    with pytest.raises(FailedPrecondition) as raised:
        watched.take("j/1/ffff", "j", 1, 0.0, lambda hosts: Tracked("x", hosts, 0.0))
    assert str(raised.value) == (
        "job 'j' round 1 formed as cohort j/1/aaaa; this audit names cohort j/1/ffff (a rank "
        "of another launch?): not taken"
    )


def test_past_the_limit_idle_cohorts_make_room_and_busy_ones_refuse_the_next() -> None:
    watched, sizes, gone = table(limit=2)
    watched.take("c0", "c0", 1, 0.0, lambda h: Tracked("c0", h, 0.0))
    watched.take("c1", "c1", 1, 150.0, lambda h: Tracked("c1", h, 150.0))
    third = watched.take("c2", "c2", 1, 200.0, lambda h: Tracked("c2", h, 200.0))
    assert sorted(watched.cohorts) == ["c1", "c2"] and gone == [["c0"]], "c0 idle 200 s > 100"
    assert third.cohort_id == "c2" and sizes[-1] == 2
    with pytest.raises(LimitExceeded) as raised:
        watched.take("c3", "c3", 1, 210.0, lambda h: Tracked("c3", h, 210.0))
    assert str(raised.value) == "2 cohorts are audited at once; no more are taken now"
    assert watched.evict(400.0, 100.0) and watched.cohorts == {} and sizes[-1] == 0


def test_a_sweep_looks_at_the_cohorts_due_and_forgets_the_idle_ones_every_evict_every_s() -> None:
    watched, _, gone = table(limit=3)
    watched.take("c0", "c0", 1, 0.0, lambda h: Tracked("c0", h, 0.0))
    watched.due.set("c0", 5.0)
    looked: list[tuple[str, float]] = []

    def look(c: Tracked) -> float | None:
        looked.append((c.cohort_id, now))
        return None

    for now in (1.0, 5.0, 1.0 + EVICT_EVERY_S - 0.5):
        watched.sweep(now, look, idle_s=2.0)
    assert looked == [("c0", 5.0)], "looked at once, when due"
    assert gone == [] and "c0" in watched.cohorts, "idle, but not yet EVICT_EVERY_S on"
    watched.sweep(1.0 + EVICT_EVERY_S, look, idle_s=2.0)
    assert gone == [["c0"]] and watched.cohorts == {}

"""Audits during training: do the replicas of a formed cohort still hold the same weights?

Each rank sends its weights' digest at a step (`cohort.audit(model, step)`). A step is
compared once every rank sent it, or once the audit bound has passed (the ranks that did not
send are named, not waited for). Ranks of one replica class (all ranks of a DDP job; under a
layout, the ranks of one replica group) must hold the same digest. When they do not, one rank
of each digest class is asked for its per-tensor digests of that step, the first differing
tensors are named, and the divergence is reported once, the same text for every rank; under
the strict policy with a stop step a little ahead of the fastest rank, at which every rank's
audit raises.

Pure: no clock but the one passed in, no I/O. `service/audits.py` drives it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from cohortgate.coordinator.contract import ranges
from cohortgate.coordinator.decision.stall import StallAnswer
from cohortgate.coordinator.decision.verdict import AuditFinding, Level
from cohortgate.coordinator.decision.words import all_ranks, plural
from cohortgate.coordinator.decision.words import differ as verb
from cohortgate.coordinator.decision.words import hosts as host_list

# A strict stop lands this far ahead of the fastest rank, and at least MARGIN_STEPS: every
# rank hears of it (in the answer to one of its next audits, a relay's batch window and a
# round trip later) before it reaches it. Kept short, so that a job about to end still
# reaches it; one that ends sooner hears the divergence when it closes (agent/audit.py).
MARGIN_S = 0.25
MARGIN_STEPS = 2
MAX_MARGIN_STEPS = 100
# How long the ranks asked for per-tensor digests have before the report goes out without.
TENSORS_WAIT_S = 10.0
# Steps held open at once per cohort (ranks ahead of a stalled one): beyond it the oldest
# step is compared with the ranks it has.
MAX_OPEN_STEPS = 64
SHOWN_TENSORS = 8
# Records kept in memory per cohort (the history keeps every one).
KEPT_FINDINGS = 32


@dataclass(frozen=True)
class RankAudit:
    cohort_id: str
    job_id: str
    round: int
    rank: int
    world_size: int
    host: str
    incarnation: str
    step: int
    digest: bytes
    group: str = ""
    tensors: tuple[tuple[str, bytes], ...] | None = None  # only when asked
    truncated: bool = False


@dataclass(frozen=True)
class Answer:
    """What every rank of the cohort is told after its audit."""

    cohort_id: str
    level: str
    tensors_for: tuple[tuple[int, int], ...] = ()  # (rank, step)
    stop_step: int = 0
    headline: str = ""
    report: str = ""
    diverged_step: int = 0
    compared_until: int = 0  # one past the highest step compared
    stall: StallAnswer = field(
        default_factory=StallAnswer
    )  # the cohort's stall, if any (decision/stall.py)


@dataclass
class _Step:
    first_at: float
    digests: dict[int, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class _Class:
    digest: bytes
    ranks: tuple[int, ...]
    hosts: tuple[str, ...]


@dataclass
class _Pending:
    """A divergence found, its report waiting for the per-tensor digests it asked for."""

    step: int
    found_at: float
    groups: dict[str, list[_Class]]  # only the groups that differ; reference class first
    asked: dict[int, int]  # rank -> step


class CohortAudits:
    """The audit state of one formed cohort, kept by its id for the life of the job."""

    def __init__(self, cohort_id: str, job_id: str, world_size: int, level: Level) -> None:
        self.cohort_id, self.job_id, self.world_size = cohort_id, job_id, world_size
        self.level = level
        self.hosts: dict[int, str] = {}
        self.groups: dict[int, str] = {}
        self.steps: dict[int, _Step] = {}
        self.tensors: dict[tuple[int, int], tuple[tuple[tuple[str, bytes], ...], bool]] = {}
        self.pending: _Pending | None = None
        self.partition: tuple[tuple[int, ...], ...] = ()  # of the last divergence reported
        self.findings: list[AuditFinding] = []  # kept in memory
        self.new: list[AuditFinding] = []  # not yet handed to the service
        self.missing: tuple[int, ...] = ()  # of the last missing finding
        self.stop_step = 0
        self.headline = self.report = ""
        self.diverged_step = 0  # the step the last divergence was found at
        self.last_step = -1  # the highest step any rank sent
        self.compared = 0  # steps compared
        self.last_compared = -1
        self._pace: list[tuple[int, float]] = []  # (step, first_at) of recent steps
        self.last_seen = 0.0

    # -- input -----------------------------------------------------------------------------
    def add(self, audit: RankAudit, now: float) -> None:
        self.last_seen = now
        self.hosts[audit.rank] = audit.host
        self.groups[audit.rank] = audit.group
        if audit.tensors is not None:
            self.tensors[(audit.rank, audit.step)] = (audit.tensors, audit.truncated)
            self._maybe_report(now)
        if audit.step <= self.last_compared - MAX_OPEN_STEPS or not audit.digest:
            return  # a tensors-only message, or a step long compared
        step = self.steps.get(audit.step)
        if step is None:
            if audit.step <= self.last_compared:
                return  # compared already (a rank that came back late)
            step = self.steps[audit.step] = _Step(now)
            self._paced(audit.step, now)
            while len(self.steps) > MAX_OPEN_STEPS:
                self._compare(min(self.steps), now)
        self.last_step = max(self.last_step, audit.step)
        step.digests[audit.rank] = audit.digest
        if len(step.digests) >= self.world_size:
            self._compare(audit.step, now)

    def sweep(self, now: float, bound_s: float) -> None:
        """Compare the steps older than the bound with the ranks they have; report a
        divergence whose asked-for tensors did not come."""
        for s in sorted(self.steps):
            if now - self.steps[s].first_at >= bound_s:
                self._compare(s, now)
        if self.pending is not None and now - self.pending.found_at >= TENSORS_WAIT_S:
            self._report(now)

    def due(self, bound_s: float) -> float | None:
        """When a sweep could next change something if no audit comes before (None: only
        an audit can)."""
        times = [min(s.first_at for s in self.steps.values()) + bound_s] if self.steps else []
        if self.pending is not None:
            times.append(self.pending.found_at + TENSORS_WAIT_S)
        return min(times) if times else None

    # -- output ----------------------------------------------------------------------------
    def answer(self) -> Answer:
        asked = tuple(sorted(self.pending.asked.items())) if self.pending else ()
        return Answer(
            self.cohort_id,
            str(self.level),
            tuple((r, s) for r, s in asked if (r, s) not in self.tensors),
            self.stop_step,
            self.headline,
            self.report,
            self.diverged_step,
            self.last_compared + 1,
        )

    def restore(self, finding: AuditFinding) -> None:
        """A divergence recorded before a restart: told again, its stop step kept."""
        self.findings.append(finding)
        if finding.kind == "diverged":
            self.diverged_step, self.headline, self.report = (
                finding.step,
                finding.headline,
                finding.report,
            )
            self.stop_step = max(self.stop_step, finding.stop_step)
            self.last_compared = max(self.last_compared, finding.step)

    # -- comparing -------------------------------------------------------------------------
    def _paced(self, step: int, now: float) -> None:
        self._pace.append((step, now))
        del self._pace[:-8]

    def _margin(self) -> int:
        """Steps in MARGIN_S at the pace the steps have arrived (at least MARGIN_STEPS),
        plus two gaps between audited steps (COHORTGATE_AUDIT_EVERY): a rank hears of the
        stop in the answer to its next audit."""
        if len(self._pace) < 2:
            return MARGIN_STEPS
        (s0, t0), (s1, t1) = self._pace[0], self._pace[-1]
        gap = math.ceil((s1 - s0) / (len(self._pace) - 1))
        per_step = (t1 - t0) / max(1, s1 - s0)
        if per_step <= 0:
            return MAX_MARGIN_STEPS + 2 * gap
        paced = max(MARGIN_STEPS, min(MAX_MARGIN_STEPS, math.ceil(MARGIN_S / per_step)))
        return paced + 2 * gap

    def _compare(self, s: int, now: float) -> None:
        step = self.steps.pop(s)
        self.compared += 1
        self.last_compared = max(self.last_compared, s)
        absent = tuple(r for r in range(self.world_size) if r not in step.digests)
        if absent and absent != self.missing:
            self._missing(s, absent, now)
        self.missing = absent
        groups = self._differing(step.digests)
        if not groups:
            if self.pending is None:
                self.partition = ()
            return
        partition = tuple(c.ranks for cs in groups.values() for c in cs)
        if partition == self.partition or self.pending is not None:
            return  # the same divergence, still standing (or its report is on its way)
        self.partition = partition
        asked = {cs[i].ranks[0]: s for cs in groups.values() for i in range(len(cs))}
        self.pending = _Pending(s, now, groups, asked)
        self._maybe_report(now)

    def _differing(self, digests: dict[int, bytes]) -> dict[str, list[_Class]]:
        """Per replica class with more than one digest: its digest classes, the largest
        first (ties: the one holding the lowest rank)."""
        by: dict[str, dict[bytes, list[int]]] = {}
        for rank in sorted(digests):
            by.setdefault(self.groups.get(rank, ""), {}).setdefault(digests[rank], []).append(rank)
        out: dict[str, list[_Class]] = {}
        for group, classes in by.items():
            if len(classes) < 2:
                continue
            built = [
                _Class(d, tuple(rs), tuple(sorted({self.hosts.get(r, "?") for r in rs})))
                for d, rs in classes.items()
            ]
            built.sort(key=lambda c: (-len(c.ranks), c.ranks[0]))
            out[group] = built
        return out

    def _missing(self, s: int, absent: tuple[int, ...], now: float) -> None:
        named = _ranks_on(absent, self.hosts)
        headline = f"step {s}: {named} sent no audit in time"
        report = (
            f"cohortgate audit of job '{self.job_id}' (cohort {self.cohort_id}): {headline}; "
            f"the step was compared across the {self.world_size - len(absent)} ranks that did.\n"
            "What to do: a rank that stops auditing is hung, dead or no longer calls "
            "cohort.audit(); look at those ranks' hosts."
        )
        level = str(self.level)
        self._found(
            AuditFinding(self.job_id, self.cohort_id, s, "missing", level, headline, report, now)
        )

    def _maybe_report(self, now: float) -> None:
        p = self.pending
        if p is not None and all((r, s) in self.tensors for r, s in p.asked.items()):
            self._report(now)

    def _report(self, now: float) -> None:
        p = self.pending
        assert p is not None
        self.pending = None
        lines, first = [], ""
        for group, classes in p.groups.items():
            lines.append(
                f"replica group {group} (ranks that must hold the same values):"
                if group
                else f"{all_ranks(self.world_size)} must hold the same values (no layout):"
            )
            ref = classes[0]
            lines.append(f"  reference: {_class_text(ref)}")
            for c in classes[1:]:
                lines.append(f"  differs:   {_class_text(c)}")
                named, text = self._tensor_diff(ref, c, p.step)
                lines.append(f"    {text}")
                first = first or _culprit(ref, c, group, named)
        self.diverged_step, self.stop_step = p.step, 0
        if self.level is Level.STRICT:
            self.stop_step = self.last_step + self._margin()
        stop = (
            f"The strict policy stops the job at step {self.stop_step}: every rank's "
            "cohort.audit() raises ReplicasDiverged there, before a checkpoint holds the "
            "corrupted weights."
            if self.stop_step
            else "The job goes on (audit policy warn); --policy audit=strict stops it."
        )
        self.headline = f"replicas diverged at step {p.step}: {first}"
        self.report = "\n".join(
            [
                f"cohortgate audit of job '{self.job_id}' (cohort {self.cohort_id}): replicas "
                f"that must hold the same weights differ at step {p.step}.",
                *lines,
                stop,
                "What to do: a rank's weights changed without the others' (a bit flip or silent "
                "data corruption on its GPU, an update applied on one rank only). Take the "
                "named host out of service, and resume from a checkpoint saved before step "
                f"{p.step}.",
            ]
        )
        self.tensors.clear()
        self._found(
            AuditFinding(
                self.job_id,
                self.cohort_id,
                p.step,
                "diverged",
                str(self.level),
                self.headline,
                self.report,
                now,
                self.stop_step,
            )
        )

    def _tensor_diff(self, ref: _Class, other: _Class, step: int) -> tuple[str, str]:
        """The first differing tensors' names, and a line saying them."""
        a = self.tensors.get((ref.ranks[0], step))
        b = self.tensors.get((other.ranks[0], step))
        if a is None or b is None:
            who = ref.ranks[0] if a is None else other.ranks[0]
            return "", f"(rank {who} did not send its per-tensor digests: tensors not named)"
        mine, theirs = dict(b[0]), dict(a[0])
        names = [n for n, _ in a[0]] + [n for n, _ in b[0] if n not in theirs]
        differ = [n for n in names if mine.get(n) != theirs.get(n)]
        if not differ:
            return "", "(their per-tensor digests agree: the difference is past the tensors sent)"
        shown = ", ".join(differ[:SHOWN_TENSORS])
        more = f" and {len(differ) - SHOWN_TENSORS} more" if len(differ) > SHOWN_TENSORS else ""
        cut = " (of the tensors sent; the list was cut)" if a[1] or b[1] else ""
        return differ[0], (
            f"{plural(len(differ), 'tensor')} of {len(names)} {verb(len(differ))}{cut}: "
            f"{shown}{more} "
            f"(rank {other.ranks[0]} against rank {ref.ranks[0]})"
        )

    def _found(self, finding: AuditFinding) -> None:
        self.findings.append(finding)
        del self.findings[:-KEPT_FINDINGS]
        self.new.append(finding)


def _ranks_on(ranks: tuple[int, ...], hosts: dict[int, str]) -> str:
    on = tuple(sorted({hosts.get(r, "?") for r in ranks}))
    word = "rank" if len(ranks) == 1 else "ranks"
    return f"{word} {ranges.compress_capped(ranks)} on {host_list(on)}"


def _class_text(c: _Class) -> str:
    return f"{_side(c)}, digest {c.digest.hex()[:12]}"


def _side(c: _Class) -> str:
    word = "rank" if len(c.ranks) == 1 else "ranks"
    return f"{word} {ranges.compress_capped(c.ranks)} on {host_list(c.hosts)}"


def _culprit(ref: _Class, other: _Class, group: str, tensor: str) -> str:
    where = f" in replica group {group}" if group else ""
    what = f" in {tensor}" if tensor else ""
    if len(ref.ranks) <= len(other.ranks):
        return f"no majority{where}: {_side(ref)} and {_side(other)} hold different weights{what}"
    return f"{_side(other)} differs from ranks {ranges.compress_capped(ref.ranks)}{where}{what}"

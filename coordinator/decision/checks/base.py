"""What a check is: a name, a default level, a cause, findings over the cohort, and the
words of its refusal (headline, report head, advice)."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from cohortgate.coordinator.contract import ranges
from cohortgate.coordinator.contract.diff import ManifestDiff
from cohortgate.coordinator.contract.layout import Layout
from cohortgate.coordinator.contract.ranges import by_value
from cohortgate.coordinator.decision.cohort import CohortState
from cohortgate.coordinator.decision.verdict import (
    Cause,
    Decision,
    DiffKey,
    Finding,
    Level,
    SignatureClass,
)
from cohortgate.coordinator.decision.words import all_ranks, class_lines, culprits_headline, refused


@dataclass
class Context:
    """What a check reads: the cohort, the time, and what the checks before it found."""

    cohort: CohortState
    now: float
    # when the uploads asked for stop being waited for (every rank in + the upload timeout)
    uploads_due: float
    levels: Mapping[str, Level]
    # rank -> layout, for the ranks that declared one (none: the job is not sharded)
    layouts: dict[int, Layout] = field(default_factory=dict)
    found: list[Finding] = field(default_factory=list)
    _runtimes: list[Mapping[str, str]] | None = field(default=None, repr=False)  # runtimes()

    def found_by(self, check: str, level: Level | None = None) -> bool:
        return any(f.check == check and level in (None, f.level) for f in self.found)

    def runtimes(self) -> list[Mapping[str, str]]:
        """The distinct runtimes the members reported: one look at each member for every
        runtime check together (the ranks of one call share one validated dict)."""
        if self._runtimes is None:
            by_object = {id(m.runtime): m.runtime for m in self.cohort.members.values()}
            by_value = {tuple(sorted(rt.items())): rt for rt in by_object.values()}
            self._runtimes = list(by_value.values())
        return self._runtimes


@dataclass(frozen=True)
class Result:
    findings: tuple[Finding, ...] = ()
    # the signature classes the refusal report shows (the model check's)
    classes: tuple[SignatureClass, ...] = ()
    refuse: bool = False  # refuses even without a strict finding (a plain signature mismatch)
    cause: Cause | None = None  # overrides the check's cause for this result
    reason: str = ""  # the refusal's bracketed reason, where the check words its own
    waiting: str = ""  # not decided yet: the reason to wait (uploads asked from ranks)
    awaiting_digests: tuple[bytes, ...] = ()
    awaiting_files: tuple[bytes, ...] = ()
    weights: str = ""  # which weights refusal: values | unsent | buffers | sharded

    @property
    def refuses(self) -> bool:
        return self.refuse or any(f.level is Level.STRICT for f in self.findings)


@dataclass(frozen=True)
class Refused:
    """What a refusal's words are made from: the cohort as decided, the decision, the diffs
    of each class that differs, and the join deadline in seconds."""

    cohort: CohortState
    decision: Decision
    diffs: dict[DiffKey, ManifestDiff | None] = field(default_factory=dict)
    deadline_s: float = 0.0


class Words:
    """What a refusal says, owned by what refused (a check, or one of formation's own gates):
    its one-line headline and its report. `report.py` assembles a verdict from these and
    never switches on the cause."""

    name: ClassVar[str]
    cause: ClassVar[Cause]

    def headline(self, r: Refused) -> str:
        """The refusal in one line, culprit ranks first."""
        raise NotImplementedError

    def report(self, r: Refused) -> str:
        """The full refusal report every rank prints."""
        raise NotImplementedError


class Check(Words):
    """One check. Subclasses set the class attributes and implement `run`; the decision
    runs every check in the registry's order and refuses for the first that refuses.
    Its report reads: "all N ranks joined, but <head>", its findings, the signature
    classes with their diffs, then "What to do: <advice>"."""

    name: ClassVar[str]
    default: ClassVar[Level]
    cause: ClassVar[Cause]
    help: ClassVar[str]  # a few words for --help and the README
    refusal: ClassVar[str]  # what a refusal says failed, in a user's words
    head: ClassVar[str]  # the report's first line: "all N ranks joined, but <head>."
    advice: ClassVar[str]  # the report's last line: "What to do: <advice>"
    # True: runs only when no check before it refuses (it asks ranks for uploads)
    needs_clean: ClassVar[bool] = False

    def run(self, ctx: Context, level: Level) -> Result:
        raise NotImplementedError

    def reason(self, ctx: Context, strict: list[Finding]) -> str:
        """The bracketed one-line reason of a refusal this check caused."""
        n = ctx.cohort.world_size
        names = ", ".join(dict.fromkeys(f.check for f in strict))
        return f"[{len(ctx.cohort.members)}/{n} ranks joined; {self.refusal}: {names}]"

    # -- its words ---------------------------------------------------------------------
    def heading(self, r: Refused) -> str:
        return f"{all_ranks(r.cohort.world_size)} joined, but {self.head}."

    def what_to_do(self, r: Refused) -> str:
        return self.advice

    def headline(self, r: Refused) -> str:
        culprits = culprits_headline(r.decision)
        if culprits:
            return culprits
        strict = [f for f in r.decision.findings if f.level is Level.STRICT]
        return self.strict_headline(strict) if strict else r.decision.reason.strip("[]")

    def strict_headline(self, strict: list[Finding]) -> str:
        """A refusal by findings (at least one strict): the first, in words."""
        f = strict[0]
        word = "rank" if len(f.ranks) == 1 else "ranks"
        said = f"{word} {ranges.compress_capped(f.ranks)}"
        # Not where the text names them already ("rank 5 declares position ..."); "rank 1"
        # is not named by "rank 12", nor "ranks 0-5" by "ranks 0-5,7".
        named = re.search(rf"(?<!\w){re.escape(said)}(?![\d-]|,\d)", f.text)
        ranks = f"{said}: " if f.ranks and named is None else ""
        return f"{f.check}: {ranks}{f.text}"

    def report(self, r: Refused) -> str:
        lines = [refused(r.cohort, self.heading(r))]
        for f in sorted(r.decision.findings, key=lambda f: f.level is not Level.STRICT):
            lines.append(f"{f.level} {f.check}: {f.text}")
        lines += class_lines(r.decision.classes, r.diffs)
        lines.append("What to do: " + self.what_to_do(r))
        return "\n".join(lines)


def minority(values: Mapping[int, Hashable]) -> tuple[int, ...]:
    """The ranks outside the largest group of equal values: the likely culprits."""
    common, _ = Counter(values.values()).most_common(1)[0]
    return tuple(sorted(r for r, v in values.items() if v != common))


def disagreement(name: str, values: Mapping[int, str]) -> str | None:
    return None if len(set(values.values())) <= 1 else f"{name}: {by_value(values)}"


def layout_findings(
    check: str,
    level: Level,
    layouts: Mapping[int, Layout],
    fields: Mapping[str, Callable[[Layout], str]],
) -> list[Finding]:
    """One finding per layout field the ranks disagree on, naming the odd ranks."""
    out = []
    for name, get in fields.items():
        values = {r: get(lay) for r, lay in layouts.items()}
        if (text := disagreement(name, values)) is not None:
            out.append(Finding(check, level, text, minority(values)))
    return out

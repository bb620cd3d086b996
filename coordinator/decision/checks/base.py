"""What a check is: a name, a default level, a cause, and findings over the cohort."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from coordinator.contract.layout import Layout
from coordinator.contract.ranges import by_value
from coordinator.decision.cohort import CohortState
from coordinator.decision.verdict import Cause, Finding, Level, SignatureClass


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

    def found_by(self, check: str, level: Level | None = None) -> bool:
        return any(f.check == check and level in (None, f.level) for f in self.found)


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
    weights: str = ""  # which weights refusal: values | unsent | buffers | sharded

    @property
    def refuses(self) -> bool:
        return self.refuse or any(f.level is Level.STRICT for f in self.findings)


class Check:
    """One check. Subclasses set the class attributes and implement `run`; the decision
    runs every check in the registry's order and refuses for the first that refuses."""

    name: ClassVar[str]
    default: ClassVar[Level]
    cause: ClassVar[Cause]
    help: ClassVar[str]  # a few words for --help and the README
    refusal: ClassVar[str]  # what a refusal says failed, in a user's words
    # True: runs only when no check before it refuses (it asks ranks for uploads)
    needs_clean: ClassVar[bool] = False

    def run(self, ctx: Context, level: Level) -> Result:
        raise NotImplementedError

    def reason(self, ctx: Context, strict: list[Finding]) -> str:
        """The bracketed one-line reason of a refusal this check caused."""
        n = ctx.cohort.world_size
        names = ", ".join(dict.fromkeys(f.check for f in strict))
        return f"[{len(ctx.cohort.members)}/{n} ranks joined; {self.refusal}: {names}]"


def disagreement(name: str, values: Mapping[int, str]) -> str | None:
    return None if len(set(values.values())) <= 1 else f"{name}: {by_value(values)}"

"""The `config`, `code` and `facts` checks: what every rank must agree on beyond its
parameters (contract.fingerprint), compared field by field across all ranks of the job,
under a layout too (a model config is global, never per replica group)."""

from __future__ import annotations

from cohortgate.coordinator.contract.fingerprint import AGREED, Fields, disagreements
from cohortgate.coordinator.decision.checks.base import Check, Context, Refused, Result, minority
from cohortgate.coordinator.decision.checks.code_files import files_lines, wanted_files
from cohortgate.coordinator.decision.verdict import Cause, Finding, Level
from cohortgate.coordinator.decision.words import all_ranks


class AgreementCheck(Check):
    """One fingerprint every rank must agree on. Ranks that sent none (an older agent, a
    model without a config) are compared too, but refused for only when `partial_strict`:
    otherwise a partial fingerprint warns at most."""

    def __init__(
        self, name: str, default: Level, cause: Cause, what: str, advice: str, partial_strict: bool
    ) -> None:
        self.name = name  # type: ignore[misc]  # one class, three checks
        self.default = default  # type: ignore[misc]
        self.cause = cause  # type: ignore[misc]
        self.what = what  # "disagree on the model config": the refusal says who (ranks, they)
        self.refusal = f"ranks {what}"  # type: ignore[misc]
        self.head = f"they {what}"  # type: ignore[misc]
        self.advice = advice  # type: ignore[misc]
        self.help = f"every rank sends the same {AGREED[name].removeprefix('the ')}"  # type: ignore[misc]
        self.partial_strict = partial_strict

    def run(self, ctx: Context, level: Level) -> Result:
        # The ranks of one call share one Fields object (edge.joins.Seen): the distinct
        # objects first, so that each is hashed once, not once per rank.
        sent_once = {
            id(f): f for f in (m.agreed.get(self.name) for m in ctx.cohort.members.values())
        }
        if len(sent_once) <= 1 or len(set(sent_once.values())) <= 1:
            return Result()  # every rank sent the same fields (or none did)
        sent: dict[int, Fields | None] = {
            r: m.agreed.get(self.name) for r, m in ctx.cohort.members.items()
        }
        if all(f is None for f in sent.values()):
            return Result()
        lines, count = disagreements(self.name, sent)
        if not lines:
            return Result()
        if self.name == "code":
            wanted = wanted_files(ctx)
            if wanted:  # one rank per class sends its file list, to name the files
                n = ctx.cohort.world_size
                return Result(
                    waiting=f"[{n}/{n} ranks joined, their code differs, waiting for "
                    f"{len(wanted)} code file list(s)]",
                    awaiting_files=wanted,
                )
            lines = _with_files(lines, files_lines(ctx.cohort))
        if level is Level.STRICT and not self.partial_strict and None in sent.values():
            level = Level.WARN
        if count > len(lines):
            lines.append(f"{self.name}: and {count - len(lines)} more differing field(s)")
        odd = minority(sent)
        return Result(tuple(Finding(self.name, level, line, odd) for line in lines))

    def reason(self, ctx: Context, strict: list[Finding]) -> str:
        n = ctx.cohort.world_size
        return f"[{n}/{n} ranks joined; {self.refusal}]"

    def strict_headline(self, strict: list[Finding]) -> str:
        more = f" (and {len(strict) - 1} more)" if len(strict) > 1 else ""
        return f"{self.refusal}: {strict[0].text}{more}"

    def headline(self, r: Refused) -> str:
        """Its own fields first, even where they made the ranks build different models
        (the culprit classes are the consequence, named in the report below)."""
        strict = [
            f for f in r.decision.findings if f.check == self.name and f.level is Level.STRICT
        ]
        return self.strict_headline(strict) if strict else super().headline(r)

    def heading(self, r: Refused) -> str:
        models = len(r.decision.classes)
        if models > 1 and not any(c.group for c in r.decision.classes):
            return (
                f"{all_ranks(r.cohort.world_size)} joined, but {self.head}, and so built "
                f"{models} different models (the shape differences below follow from it)."
            )
        return super().heading(r)


def _with_files(lines: list[str], named: list[str]) -> list[str]:
    """The modules field's line replaced by the lines naming the files that differ."""
    at = next((i for i, line in enumerate(lines) if line.startswith("code.modules:")), None)
    if at is None or not named:
        return lines
    return [*lines[:at], *named, *lines[at + 1 :]]


AGREEMENT_CHECKS = (
    AgreementCheck(
        "config",
        Level.STRICT,
        Cause.CONFIG,
        "disagree on the model config",
        "every rank must build its model from the same config; the fields above differ "
        "(a config file, a command-line override or an environment variable read on some "
        "nodes only). Fix the ranks named above and relaunch.",
        partial_strict=False,
    ),
    AgreementCheck(
        "code",
        Level.WARN,
        Cause.CODE,
        "run different training code",
        "every rank must run the same script at the same commit with the same numerics "
        "packages: update the stale checkout or environment on the ranks named above, or set "
        "--policy code=warn where the difference is deliberate.",
        partial_strict=False,
    ),
    AgreementCheck(
        "facts",
        Level.STRICT,
        Cause.FACTS,
        "disagree on declared facts",
        "the ranks declared different facts (cohortgate.join(facts=...)): make them load the same "
        "tokenizer, data and checkpoint, then relaunch.",
        partial_strict=True,
    ),
)

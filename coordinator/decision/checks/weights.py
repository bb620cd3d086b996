"""The `weights` check: replicas start from the same weights (cohortgate.join(verify_values=True)).

It runs last, once every other check passes: when replicas differ it asks one rank per
weights digest for its per-tensor digests, to name the tensors that differ.
"""

from __future__ import annotations

from cohortgate.coordinator.contract import ranges
from cohortgate.coordinator.contract.digests import differing
from cohortgate.coordinator.decision.checks.base import Check, Context, Refused, Result
from cohortgate.coordinator.decision.classes import weight_classes
from cohortgate.coordinator.decision.cohort import CohortState
from cohortgate.coordinator.decision.verdict import Cause, Finding, Level
from cohortgate.coordinator.decision.words import all_ranks

NAMES_SHOWN = 10
# A weights refusal's kind -> the words its reason uses
_WHAT = {
    "unsent": "weight digests missing",
    "sharded": "sharded weights compared without a layout",
    "buffers": "buffers differ (model config)",
    "values": "weights differ",
}


def _by_size(classes: dict[bytes, list[int]]) -> list[tuple[bytes, list[int]]]:
    """Reference first (the largest; ties to the lowest rank), then by lowest rank."""
    ordered = sorted(classes.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
    return [ordered[0], *sorted(ordered[1:], key=lambda kv: kv[1][0])]


# A weights refusal has four kinds; each has its own head and advice.
WEIGHT_HEADS = {
    "values": "replicas start from different weights.",
    "unsent": "some ranks sent no weight digest, which the weights check (strict) requires.",
    "buffers": "buffers computed from the model config differ (the weights themselves agree): "
    "the ranks' model configs differ, not their seeds.",
    "sharded": "their parameters are sharded DTensors (FSDP2 / tensor parallel) and no layout "
    "was declared, so every rank's shard was compared with every other rank's.",
}
WEIGHT_ADVICE = {
    "values": "every replica must start from the same weights: seed every rank alike, load "
    "the same checkpoint everywhere (look for a stale copy on the hosts named), or broadcast "
    "the weights from one rank before joining.",
    "unsent": "call cohortgate.join(model, verify_values=True) (or "
    "cohortgate.init_process_group(..., verify_values=True)) on every rank, or turn the check "
    "off for this job with --job-policy JOB:weights=off.",
    "buffers": "compare the model config on the ranks named (for example rope_theta, "
    "rope_scaling, max_position_embeddings): buffers such as rotary frequencies are computed "
    "from it. Load one config everywhere.",
    "sharded": "declare the layout (cohortgate.layout(...) passed as layout=) so that only the "
    "ranks holding the same shard are compared, or join without verify_values.",
}


class WeightsCheck(Check):
    name = "weights"
    # Off unless configured: the digest costs each rank a pass over its weights.
    default = Level.OFF
    cause = Cause.WEIGHTS
    help = "replicas start from the same weights (verify_values=True on every rank)"
    refusal = "weights differ"
    head = WEIGHT_HEADS["values"]
    advice = WEIGHT_ADVICE["values"]
    needs_clean = True

    def heading(self, r: Refused) -> str:
        return (
            f"{all_ranks(r.cohort.world_size)} joined with matching models, but "
            + WEIGHT_HEADS[r.decision.weights or "values"]
        )

    def what_to_do(self, r: Refused) -> str:
        return WEIGHT_ADVICE[r.decision.weights or "values"]

    def run(self, ctx: Context, level: Level) -> Result:
        cohort = ctx.cohort
        found: list[Finding] = []
        unsent = [r for r, m in cohort.members.items() if not m.weights_digest]
        if unsent:
            found.append(
                Finding(
                    self.name,
                    level,
                    f"{len(unsent)} rank(s) {ranges.compress_capped(unsent)} sent no weight "
                    "digest; call cohortgate.join(model, verify_values=True) on every rank",
                    tuple(unsent),
                )
            )
        pairs = self._pairs(cohort, level)
        found += [finding for finding, _ in pairs]
        wanted = tuple(
            dict.fromkeys(d for _, known in pairs if isinstance(known, tuple) for d in known)
        )
        n = cohort.world_size
        if wanted and ctx.now < ctx.uploads_due:
            return Result(
                waiting=f"[{n}/{n} ranks joined, weights differ, waiting for {len(wanted)} "
                "digest list(s)]",
                awaiting_digests=wanted,
            )
        if not found:
            return Result()
        kind = self._kind(cohort, [known for _, known in pairs])
        return Result(
            tuple(found),
            weights=kind,
            reason=f"[{n}/{n} ranks joined, models match, {_WHAT[kind]}]",
        )

    def _pairs(
        self, cohort: CohortState, level: Level
    ) -> list[tuple[Finding, bool | tuple[bytes, ...]]]:
        """Each class against its replica group's reference: the finding, and whether all
        the tensors that differ are buffers, or (while unknown) the digests still wanted."""
        out: list[tuple[Finding, bool | tuple[bytes, ...]]] = []
        for label, classes in weight_classes(cohort).items():
            if len(classes) < 2:
                continue
            ordered = _by_size(classes)
            ref_digest, ref_ranks = ordered[0]
            for digest, ranks in ordered[1:]:
                finding, names = self._pair(
                    cohort, level, label, ref_ranks, ref_digest, digest, ranks
                )
                if names is None:
                    wanted = tuple(
                        d for d in (ref_digest, digest) if d not in cohort.tensor_digests
                    )
                    out.append((finding, wanted))
                else:
                    out.append((finding, names[0] and names[1]))
        return out

    @staticmethod
    def _kind(cohort: CohortState, buffers: list[bool | tuple[bytes, ...]]) -> str:
        if not buffers:
            return "unsent"
        if any(m.sharded_without_layout and m.layout is None for m in cohort.members.values()):
            return "sharded"
        # Every pair's differing tensors are known and all are buffers: computed from the
        # model config (rotary frequencies), not initialised from a seed.
        if all(b is True for b in buffers):
            return "buffers"
        return "values"

    def _pair(
        self,
        cohort: CohortState,
        level: Level,
        label: str,
        ref_ranks: list[int],
        ref_digest: bytes,
        digest: bytes,
        ranks: list[int],
    ) -> tuple[Finding, tuple[bool, bool] | None]:
        """The finding for one class against its group's reference, and (some tensors
        differ, all of them buffers), or None while the per-tensor digests are unknown."""
        where = f"replica group {label}: " if label else ""
        hosts = sorted({cohort.members[r].host for r in ranks})
        who = (
            f"{where}{len(ranks)} rank(s) [{ranges.compress_capped(ranks)}] on "
            f"{', '.join(hosts[:4])}{' ...' if len(hosts) > 4 else ''} hold other weights "
            f"than ranks [{ranges.compress_capped(ref_ranks)}]"
        )
        reference = cohort.tensor_digests.get(ref_digest)
        other = cohort.tensor_digests.get(digest)
        manifest = cohort.manifests.get(cohort.members[ref_ranks[0]].signature)
        if reference is None or other is None or manifest is None:
            return Finding(self.name, level, who, tuple(ranks)), None
        names = [e.name for e in manifest.entries]
        buffers = {e.name for e in manifest.entries if e.kind.value == "buffer"}
        differ = differing(names, reference, other)
        shown = ", ".join(f"'{x}'" for x in differ[:NAMES_SHOWN])
        more = f" and {len(differ) - NAMES_SHOWN} more" if len(differ) > NAMES_SHOWN else ""
        text = f"{who}: {len(differ)} of {len(names)} tensors differ, first {shown}{more}"
        return Finding(self.name, level, text, tuple(ranks)), (bool(differ), set(differ) <= buffers)

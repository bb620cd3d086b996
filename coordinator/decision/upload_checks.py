"""What an upload must be to be taken: the rules, pure, over the member it comes from.

An upload (a manifest, per-tensor digests, code files) answers an ask (state/asks.py); the
store finds the member it claims to come from and asks these functions whether to take it.
A size or budget past its bound is refused before the payload is decoded; a payload that
does not hash to what its rank joined with is named in the report (`*_lie` returns the
words), the rest are errors to the sender.
"""

from __future__ import annotations

from cohortgate.coordinator.contract.digests import DIGEST_BYTES
from cohortgate.coordinator.contract.errors import (
    FailedPrecondition,
    InvalidArgument,
    LimitExceeded,
)
from cohortgate.coordinator.contract.limits import Limits
from cohortgate.coordinator.decision.cohort import Member, UploadKind

# The most one manifest entry takes on the wire (a 1,024-character name, 64 dimensions and
# strides, dtype, alias): an upload larger than its announced entries allow is refused
# before it is decoded.
MAX_ENTRY_WIRE_BYTES = 4096
UPLOAD_SLACK_BYTES = 64 * 1024


def check_size(kind: UploadKind, rank: int, member: Member, size: int) -> None:
    """No more bytes than `member`'s announced manifest entries can take."""
    per_entry = MAX_ENTRY_WIRE_BYTES if kind is UploadKind.MANIFEST else DIGEST_BYTES + 8
    most = member.manifest_entries * per_entry + UPLOAD_SLACK_BYTES
    if size > most:
        what = "a manifest" if kind is UploadKind.MANIFEST else "digests"
        raise LimitExceeded(
            f"the {what} upload of rank {rank} is {size} bytes, more than its "
            f"{member.manifest_entries}-entry manifest can take ({most} bytes at most)"
        )


def check_manifest_budget(
    job_id: str, round_: int, cohort_bytes: int, total_bytes: int, size: int, limits: Limits
) -> None:
    """The manifests one cohort and the whole coordinator hold, with this one."""
    if cohort_bytes + size > limits.max_cohort_manifest_bytes:
        raise LimitExceeded(
            f"job '{job_id}' round {round_} holds {cohort_bytes} bytes of manifests; this "
            f"{size}-byte upload would pass the limit max_cohort_manifest_bytes="
            f"{limits.max_cohort_manifest_bytes} (that many different models in one job is "
            "itself the problem: the cohort is refused with the manifests it has)"
        )
    if total_bytes + size > limits.max_manifest_bytes:
        raise LimitExceeded(
            f"this coordinator holds {total_bytes} bytes of manifests across all cohorts; "
            f"this {size}-byte upload would pass the limit "
            f"max_manifest_bytes={limits.max_manifest_bytes}"
        )


def check_claim(rank: int, member: Member, claimed: bytes) -> None:
    if claimed != member.signature:
        raise InvalidArgument(
            f"upload claims signature {claimed.hex()[:12]}, but rank {rank} joined with "
            f"{member.signature.hex()[:12]}"
        )


def check_digests_expected(rank: int, member: Member) -> None:
    if not member.weights_digest:
        raise FailedPrecondition(
            f"rank {rank} joined without a weights digest; there is nothing to explain"
        )


def check_entries(rank: int, member: Member, entries: int, what: str) -> None:
    """As many manifest entries (`what`: "manifest") or digests as the join announced."""
    if entries == member.manifest_entries:
        return
    if what == "manifest":
        raise InvalidArgument(
            f"the manifest uploaded by rank {rank} has {entries} entries, but the join "
            f"announced {member.manifest_entries}"
        )
    raise InvalidArgument(
        f"{entries} digests uploaded, but rank {rank}'s manifest has "
        f"{member.manifest_entries} entries: send one per entry, in manifest order"
    )


def manifest_lie(rank: int, member: Member, actual: bytes, claimed: bytes) -> str | None:
    """The report's words when the manifest does not hash to its signature; None if it does."""
    if actual == claimed:
        return None
    return (
        f"the manifest uploaded by rank {rank} (host {member.host}) hashes to "
        f"{actual.hex()[:12]}, not to the signature {claimed.hex()[:12]} it joined with: "
        "agent and coordinator disagree on the encoding, or the model changed between "
        "signing and uploading"
    )


def digests_lie(rank: int, member: Member, combined: bytes) -> str | None:
    if combined == member.weights_digest:
        return None
    return (
        f"the per-tensor digests uploaded by rank {rank} (host {member.host}) do not combine "
        "to the weights digest it joined with: the weights changed between digesting and "
        "uploading, or agent and coordinator versions differ"
    )


def files_lie(rank: int, member: Member, key: bytes, field: bytes) -> str | None:
    if field == key:
        return None
    return (
        f"the code files uploaded by rank {rank} (host {member.host}) do not combine to the "
        f"modules field it joined with ({key.decode()[:64]}): a file changed on disk since "
        "the join, or agent and coordinator versions differ"
    )

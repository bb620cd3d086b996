"""Requests validated at the edge (edge/rpc.py, edge/joins.py), each bound at its limit and
one past it, with the error the caller reads: its status (the exception type) and what it
names. Found by mutation: the code files' validation, the digests' count and a group's
fingerprints had no test that a changed bound, message or cache key would fail."""

from __future__ import annotations

import pytest

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.codec.wire import MAX_JOB_ID
from cohortgate.coordinator.contract.digests import DIGEST_FORMAT_VERSION, MAX_FILE_PATH, MAX_FILES
from cohortgate.coordinator.contract.errors import (
    CoordinatorError,
    FailedPrecondition,
    InvalidArgument,
    LimitExceeded,
)
from cohortgate.coordinator.contract.limits import Limits
from cohortgate.coordinator.edge import joins, rpc
from tests.helpers import join_request, manifest_of

pytestmark = pytest.mark.timeout(30)

DIGEST = bytes(range(32))


def files(n: int = 2, **fields: object) -> pb.UploadFilesRequest:
    base: dict[str, object] = {
        "job_id": "j",
        "round": 3,
        "rank": 5,
        "incarnation": "inc",
        "paths": [f"train/m{i}.py" for i in range(n)],
        "digests": [DIGEST] * n,
    }
    return pb.UploadFilesRequest(**{**base, **fields})  # type: ignore[arg-type]


def test_code_files_at_their_bounds_are_taken_whole() -> None:
    ref, got = rpc.files_of(files(MAX_FILES, incarnation="i" * 128, job_id="j" * MAX_JOB_ID))
    assert (ref.job_id, ref.round, ref.rank, ref.incarnation) == ("j" * MAX_JOB_ID, 3, 5, "i" * 128)
    assert len(got) == MAX_FILES and got[0] == ("train/m0.py", DIGEST)
    long_path = "p" * MAX_FILE_PATH
    assert rpc.files_of(files(1, paths=[long_path]))[1] == [(long_path, DIGEST)]


@pytest.mark.parametrize(
    ("request_", "error", "says"),
    [
        (
            files(MAX_FILES + 1),
            LimitExceeded,
            f"{MAX_FILES + 1} code files; the limit is {MAX_FILES}",
        ),
        (files(2, digests=[DIGEST]), InvalidArgument, "2 paths for 1 digests"),
        (
            files(1, paths=["p" * (MAX_FILE_PATH + 1)]),
            InvalidArgument,
            f"paths is {MAX_FILE_PATH + 1} characters long; the limit is {MAX_FILE_PATH}",
        ),
        (files(1, paths=[""]), InvalidArgument, "paths is empty; it is required"),
        (files(1, digests=[DIGEST[:31]]), InvalidArgument, "digests is 31 bytes; a SHA-256"),
        (
            files(2, paths=["a.py", "a.py"]),
            InvalidArgument,
            "a path is named twice in the code files",
        ),
        (files(job_id=""), InvalidArgument, "job_id is empty; it is required"),
        (
            files(job_id="j" * (MAX_JOB_ID + 1)),
            InvalidArgument,
            f"job_id is {MAX_JOB_ID + 1} characters long; the limit is {MAX_JOB_ID}",
        ),
        (files(incarnation=""), InvalidArgument, "incarnation is empty; it is required"),
        (
            files(incarnation="i" * 129),
            InvalidArgument,
            "incarnation is 129 characters long; the limit is 128",
        ),
    ],
)
def test_code_files_past_a_bound_are_refused_naming_it(
    request_: pb.UploadFilesRequest, error: type[CoordinatorError], says: str
) -> None:
    with pytest.raises(error) as raised:
        rpc.files_of(request_)
    assert type(raised.value) is error and says in str(raised.value), str(raised.value)


def test_digests_are_taken_up_to_the_manifest_entry_limit_and_refused_past_it() -> None:
    limits = Limits(max_manifest_entries=3)

    def upload(n: int) -> bytes:
        return pb.UploadDigestsRequest(job_id="j", digests=[DIGEST] * n).SerializeToString()

    assert rpc.digests_of(upload(3), limits) == [DIGEST] * 3
    with pytest.raises(LimitExceeded, match=r"^4 digests; the limit is max_manifest_entries=3$"):
        rpc.digests_of(upload(4), limits)


def test_a_groups_members_keep_their_own_fingerprints() -> None:
    """Members of one call share their validation (joins.Seen) only where their values are
    the same: a rank of another config in a relay's group is judged by its own."""
    m = manifest_of()
    members = [join_request("g", r, 3, m) for r in range(3)]
    members[0].config.fields.update({"n_layer": "12"})
    members[1].config.fields.update({"n_layer": "13"})
    members[2].config.fields.update({"n_layer": "12"})
    members[2].code.fields.update({"n_layer": "12", "train.py": "sha256:ab"})
    intents = joins.group_intents(pb.JoinGroupRequest(members=members))
    configs = [dict(i.member.agreed["config"]) for i in intents]
    assert configs == [{"n_layer": "12"}, {"n_layer": "13"}, {"n_layer": "12"}]
    assert dict(intents[2].member.agreed["code"]) == {"n_layer": "12", "train.py": "sha256:ab"}
    assert "code" not in intents[0].member.agreed


def test_a_bad_fingerprint_field_is_refused_naming_the_member_and_the_field() -> None:
    m = manifest_of()
    good, bad = join_request("g", 0, 2, m), join_request("g", 1, 2, m)
    good.config.fields.update({"n_layer": "12"})
    bad.config.fields.update({"": "12"})
    with pytest.raises(InvalidArgument) as raised:
        joins.group_intents(pb.JoinGroupRequest(members=[good, bad]))
    said = str(raised.value)
    assert said.startswith("members[1] (rank 1): config field name '' must be 1-"), said


def test_a_group_is_one_job_and_round_of_one_to_max_group_ranks() -> None:
    m = manifest_of()
    with pytest.raises(InvalidArgument) as raised:
        joins.group_intents(pb.JoinGroupRequest())
    assert str(raised.value) == "the group has no members; a JoinGroup call needs at least one"
    biggest = [join_request("g", r, joins.MAX_GROUP + 1, m) for r in range(joins.MAX_GROUP + 1)]
    assert len(joins.group_intents(pb.JoinGroupRequest(members=biggest[:-1]))) == joins.MAX_GROUP
    with pytest.raises(LimitExceeded) as over:
        joins.group_intents(pb.JoinGroupRequest(members=biggest))
    assert str(over.value) == (
        f"the group has {joins.MAX_GROUP + 1} members; the limit is {joins.MAX_GROUP} per call"
    )
    for other in (
        join_request("other-job", 1, 4, m),
        join_request("g", 1, 5, m),
        join_request("g", 1, 4, m, round=2),
    ):
        with pytest.raises(InvalidArgument) as mixed:
            joins.group_intents(pb.JoinGroupRequest(members=[join_request("g", 0, 4, m), other]))
        said = str(mixed.value)
        assert said.startswith("members[1] (rank 1) is of job") and said.endswith(
            "one group holds ranks of one job and round"
        ), said
    twice = [join_request("g", 0, 4, m), join_request("g", 0, 4, m)]
    with pytest.raises(InvalidArgument, match=r"^members\[1\]: rank 0 appears twice"):
        joins.group_intents(pb.JoinGroupRequest(members=twice))


def audit(**fields: object) -> pb.AuditRequest:
    base: dict[str, object] = {
        "cohort_id": "j/1/abcd",
        "job_id": "j",
        "round": 1,
        "rank": 0,
        "world_size": 4,
        "host": "node0",
        "incarnation": "i0",
        "step": 7,
        "digest": DIGEST,
        "digest_format": DIGEST_FORMAT_VERSION,
    }
    return pb.AuditRequest(audits=[pb.RankAudit(**{**base, **fields})])  # type: ignore[arg-type]


def test_an_audit_at_its_bounds_is_taken() -> None:
    limits = Limits(max_world_size=8)
    for fields in (
        {"world_size": 1},  # a one-rank job audits too
        {"world_size": 8, "rank": 7},
        {"step": (1 << 62) - 1},
    ):
        audits, beats = rpc.audits_of(audit(**fields), limits)
        assert len(audits) == 1 and len(beats) == 1, fields
        assert (audits[0].world_size, audits[0].rank, audits[0].step) == (
            fields.get("world_size", 4),
            fields.get("rank", 0),
            fields.get("step", 7),
        )


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"world_size": 0}, "world_size 0 is outside 1..8 (--max-world-size)"),
        ({"world_size": 9}, "world_size 9 is outside 1..8 (--max-world-size)"),
        ({"rank": 4}, "rank 4 is outside the world size 4"),
        ({"step": 1 << 62}, f"step {1 << 62} is past 2^62"),
        ({"cohort_id": "k/1/abcd"}, "cohort_id 'k/1/abcd' is not a cohort of job 'j' round 1"),
        ({"cohort_id": "j/2/abcd"}, "cohort_id 'j/2/abcd' is not a cohort of job 'j' round 1"),
        ({"cohort_id": ""}, "cohort_id is empty; it is required"),
        ({"cohort_id": "j/1/" + "x" * 125}, "cohort_id is 129 characters long; the limit is 128"),
        ({"job_id": "", "cohort_id": "/1/x"}, "job_id is empty; it is required"),
    ],
)
def test_an_audit_past_a_bound_is_refused_naming_it(fields: dict[str, object], says: str) -> None:
    with pytest.raises(InvalidArgument) as raised:
        rpc.audits_of(audit(**fields), Limits(max_world_size=8))
    assert type(raised.value) is InvalidArgument and str(raised.value).startswith(says), str(
        raised.value
    )


def test_an_audit_in_another_digest_format_says_to_upgrade() -> None:
    with pytest.raises(FailedPrecondition) as raised:
        rpc.audits_of(audit(digest_format=DIGEST_FORMAT_VERSION + 1))
    assert str(raised.value) == (
        f"digest_format {DIGEST_FORMAT_VERSION + 1} is not {DIGEST_FORMAT_VERSION} "
        f"(cohortgate.digest.v{DIGEST_FORMAT_VERSION}): upgrade the agent or the coordinator so "
        "that both agree"
    )
    mark = rpc.audits_of(audit(digest=b"", digest_format=0, step_only=True))
    assert mark == ([], mark[1]) and len(mark[1]) == 1, "a step mark: no digest, a beat"


def test_an_audit_carries_every_field_it_is_judged_by() -> None:
    """Who sent it (host, incarnation), its replica group (ranks are compared within their
    group only), whether its job is done or paused: each reaches the audit and the beat."""
    names, digests = ["fc.weight"], [DIGEST]
    request = audit(
        rank=2,
        host="node7",
        incarnation="i" * 128,
        group="dp0",
        done=True,
        paused="checkpoint",
        paused_s=3.5,
        tensor_names=names,
        tensor_digests=digests,
        tensors_truncated=True,
    )
    (got,), (beat,) = rpc.audits_of(request)
    assert (got.host, got.incarnation, got.group) == ("node7", "i" * 128, "dp0")
    assert got.tensors == (("fc.weight", DIGEST),) and got.truncated
    assert (beat.host, beat.incarnation, beat.rank, beat.step) == ("node7", "i" * 128, 2, 7)
    assert beat.done and (beat.paused, beat.paused_s) == ("checkpoint", 3.5)
    longest = "p" * rpc.MAX_FRAME_TEXT  # a pause's reason may be as long as a stack frame
    assert rpc.audits_of(audit(paused=longest))[1][0].paused == longest
    for fields, says in (
        ({"incarnation": "i" * 129}, "incarnation is 129 characters long; the limit is 128"),
        ({"host": "x" * 5000}, "host is 5000 characters long"),
        (
            {"paused": "p" * (rpc.MAX_FRAME_TEXT + 1)},
            f"paused is {rpc.MAX_FRAME_TEXT + 1} characters",
        ),
    ):
        with pytest.raises(InvalidArgument) as raised:
            rpc.audits_of(audit(**fields))
        assert str(raised.value).startswith(says), str(raised.value)

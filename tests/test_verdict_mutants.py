"""Tests a wrong verdict cannot pass: each one kills a realistic mutation of the verdict,
security or digest code that the rest of the suite let through (see `make mutation`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.codec import wire
from cohortgate.coordinator.contract.errors import InvalidArgument, PermissionDenied
from cohortgate.coordinator.contract.fingerprint import MAX_VALUE, canonical, config_fields
from cohortgate.coordinator.contract.layout import Layout, ShardPiece
from cohortgate.coordinator.contract.manifest import Manifest
from cohortgate.coordinator.decision import coverage
from cohortgate.coordinator.decision.cohort import CohortState, Member
from cohortgate.coordinator.decision.formation import FormationOptions, decide
from cohortgate.coordinator.decision.verdict import Outcome
from cohortgate.coordinator.edge.auth import Auth, TokenStore
from cohortgate.coordinator.edge.joins import join_intent
from tests.helpers import join_request, manifest_of
from tests.test_parity import arrays
from tests.test_pieces import findings, named

OPTS = FormationOptions(join_deadline_s=60)


def member(rank: int, signature: bytes, m: Manifest, **kw: object) -> Member:
    return Member(
        rank=rank,
        host=f"node{rank}",
        pid=rank,
        incarnation=f"i{rank}",
        signature=signature,
        manifest_entries=len(m),
        init_method="tcp://h:1" if rank == 0 else "",
        **kw,  # type: ignore[arg-type]
    )


# -- the model check -------------------------------------------------------------------
def test_signatures_that_differ_only_in_their_last_byte_are_two_models() -> None:
    m = manifest_of()
    sig = bytearray(m.signature())
    other = bytes(sig[:-1]) + bytes([sig[-1] ^ 1])
    state = CohortState("last-byte", 1, 2, first_join_at=0.0)
    state.add(member(0, bytes(sig), m), 0.0)
    state.add(member(1, other, m), 0.0)
    decision = decide(state, 1.0, OPTS)
    # two models: the decision waits for both manifests, to say how they differ
    assert decision.outcome is Outcome.WAITING
    assert (
        decision.reason == "[2/2 ranks joined, 2 different signatures, waiting for 2 manifest(s)]"
    )
    assert set(decision.awaiting_manifests) == {bytes(sig), other}
    assert len(state.classes) == 2, "one class per signature, every byte of it"


# -- tokens ------------------------------------------------------------------------------
def test_a_job_token_does_not_reach_a_job_whose_id_it_prefixes(tmp_path: object) -> None:
    from pathlib import Path

    tokens = Path(str(tmp_path)) / "tokens"
    tokens.write_text("token-for-job-a-0123456789 job-a\n")
    auth = Auth(TokenStore.load(tokens))
    bearer = [("authorization", "Bearer token-for-job-a-0123456789")]
    assert auth.check_job(bearer, "job-a").scope == "job-a"
    for other in ("job-a2", "job-", "job-a ", "JOB-A"):
        with pytest.raises(PermissionDenied):
            auth.check_job(bearer, other)


# -- the weight digest covers every byte ------------------------------------------------
@pytest.mark.parametrize("kernel", [True, False])
def test_a_change_past_the_first_64_kib_changes_the_digest(kernel: bool) -> None:
    from cohortgate.agent.digest import tensor_digest

    t = torch.arange(300_000, dtype=torch.float32)  # 1.2 MB: 73 chunks of 16 KiB
    base = tensor_digest("w", t, kernel=kernel)
    for index in (16_384, 150_000, 299_999):  # just past 64 KiB, the middle, the last
        other = t.clone()
        other[index] += 1
        assert tensor_digest("w", other, kernel=kernel) != base, index


# -- agreement: a field some ranks lack --------------------------------------------------
def test_a_config_key_present_on_some_ranks_only_is_named_with_absent() -> None:
    from cohortgate.coordinator.contract.fingerprint import disagreements, fields_of

    full = fields_of(config_fields({"hidden": 64, "rope_theta": 10000.0}))
    short = fields_of(config_fields({"hidden": 64}))
    lines, count = disagreements("config", {0: full, 1: full, 2: short})
    assert count == 1
    assert lines == ["config.rope_theta: 10000.0 on ranks 0-1, (absent) on rank 2"]


def test_long_values_are_hashed_not_truncated() -> None:
    head = "x" * (MAX_VALUE + 10)
    a, b = canonical(head + "a"), canonical(head + "b")
    assert a.startswith("sha256:") and b.startswith("sha256:")
    assert a != b, "values that differ past the limit must still differ"


# -- coverage: the parity path's exact volume ---------------------------------------------
def test_an_element_held_three_times_by_a_non_grid_layout_is_refused() -> None:
    """A brick wall (not a grid) plus three pieces whose corners cancel: parity alone sees
    the wall, the volume (8 + 4) does not; cells (0,1) and (0,2) are held three times."""
    wall = [((0, 0), (1, 2)), ((0, 2), (1, 2)), ((1, 0), (1, 1)), ((1, 1), (1, 2))]
    wall += [((1, 3), (1, 1))]
    extra = [((0, 1), (1, 2)), ((0, 1), (1, 1)), ((0, 2), (1, 1))]
    pieces = tuple(ShardPiece("t0", (2, 4), off, ln) for off, ln in wall + extra)
    layouts = {0: Layout({"tp": 1}, {"tp": 0}, pieces=pieces)}
    texts = findings(layouts)
    assert named(texts) == {"t0"}, texts
    alone = findings(layouts, large=1)
    assert named(alone) == {"t0"}, alone
    ok = {0: Layout({"tp": 1}, {"tp": 0}, pieces=pieces[: len(wall)])}
    assert findings(ok) == []
    # The tensor examined alone, as the report names it: the volume says what parity cannot.
    objects = [coverage.Piece(i, off, ln) for i, (off, ln) in enumerate(wall + extra)]
    assert {p.kind for p in coverage.check("t0", (2, 4), objects)} == {"overlap"}
    offsets, lengths = arrays(wall + extra, 2)
    ranks = np.arange(len(wall + extra), dtype=np.int64)
    problems = coverage._check_parity("t0", (2, 4), ranks, offsets, lengths)
    assert [p.kind for p in problems] == ["overlap"], problems


# -- the job id's own limit ----------------------------------------------------------------
def test_a_job_id_is_capped_at_256_characters_naming_the_limit() -> None:
    m = manifest_of()
    join_intent(join_request("j" * 256, 0, 1, m))
    with pytest.raises(InvalidArgument, match=r"job_id is 257 characters long; the limit is 256"):
        join_intent(join_request("j" * 257, 0, 1, m))


# -- completion is reset when a rank leaves ----------------------------------------------
def test_a_cohort_completes_again_when_a_rank_that_left_comes_back() -> None:
    """The manifest wait runs from the last completion: a rank that leaves and re-joins
    later must not find the timeout counted from the first."""
    m = manifest_of()
    state = CohortState("again", 1, 2, first_join_at=0.0)
    zero, one = member(0, m.signature(), m), member(1, m.signature(), m)
    state.add(zero, 0.0)
    state.add(one, 1.0)
    assert state.complete_at == 1.0
    state.remove(one, 2.0)
    assert state.complete_at is None
    state.add(member(1, m.signature(), m), 50.0)
    assert state.complete_at == 50.0


def test_wire_job_id_limit_is_its_own() -> None:
    assert wire.MAX_JOB_ID == 256 < wire.MAX_TEXT
    request = join_request("k" * 300, 0, 1, manifest_of())
    with pytest.raises(InvalidArgument, match="256"):
        join_intent(pb.JoinRequest.FromString(request.SerializeToString()))


def test_tokens_shorter_than_16_characters_are_refused(tmp_path: object) -> None:
    from pathlib import Path

    tokens = Path(str(tmp_path)) / "tokens"
    tokens.write_text("a" * 15 + " job-a\n")
    with pytest.raises(ValueError, match="at least 16 characters"):
        TokenStore.load(tokens)
    tokens.write_text("a" * 16 + " job-a\n")
    assert TokenStore.load(tokens).grant([("authorization", "Bearer " + "a" * 16)]).scope == "job-a"


def test_grants_name_what_is_wrong_with_a_call(tmp_path: object) -> None:
    from pathlib import Path

    from cohortgate.coordinator.contract.errors import Unauthenticated

    tokens = Path(str(tmp_path)) / "tokens"
    tokens.write_text("# ops\nadmin-token-0123456789 *  # every job\njob-token-0123456789 job-b\n")
    tokens.chmod(0o600)
    store = TokenStore.load(tokens)
    assert TokenStore.exposure(tokens) is None
    tokens.chmod(0o640)
    assert "has mode 640" in (TokenStore.exposure(tokens) or "")
    auth = Auth(store)
    admin = auth.check_job([("authorization", b"Bearer admin-token-0123456789")], "any-job")
    assert admin.admin
    assert not auth.check_job([("authorization", "bearer job-token-0123456789")], "job-b").admin
    for metadata, said in (
        ([], "no token: send 'authorization: Bearer TOKEN'"),
        ([("authorization", "Basic abc")], "must be 'Bearer TOKEN'"),
        ([("authorization", "Bearer ")], "must be 'Bearer TOKEN'"),
        ([("authorization", "Bearer not-a-token-at-all")], "not valid on this coordinator"),
    ):
        with pytest.raises(Unauthenticated, match=said):
            auth.check_job(metadata, "job-b")
    with pytest.raises(PermissionDenied, match="cannot reach job 'job-c'"):
        auth.check_job([("authorization", "Bearer job-token-0123456789")], "job-c")
    tokens.write_text("one two three\n")
    with pytest.raises(ValueError, match=":1: expected 'TOKEN JOB_ID'"):
        TokenStore.load(tokens)
    tokens.write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no tokens"):
        TokenStore.load(tokens)

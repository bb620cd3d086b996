"""A flapping network (every connection reset every 0.7 s for 6 s: a switch port that flaps, a
NAT table flush, a load balancer draining) must never turn into a rank's error: the job forms
once the network is steady, one cohort, every rank FORMED."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cohortgate.agent.client import JoinOptions
from cohortgate.agent.torchrun import CohortgateError
from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.contract.errors import FailedPrecondition
from cohortgate.coordinator.decision.admit import ROUNDS_KEPT
from cohortgate.coordinator.decision.verdict import Outcome
from cohortgate.coordinator.service.cohorts import Cohorts
from cohortgate.coordinator.state.base import JoinIntent
from tests.helpers import InProcessCoordinator, decide_in, manifest_of, member_of, wait_joined
from tests.launches import agent_rank
from tests.netfault import FaultProxy
from tests.test_relay_faults import relay_process

FLAP_PERIOD_S = 0.7
FLAP_FOR_S = 6.0
WORLD = 6


M = manifest_of()


def _abandon_rounds(store: Cohorts, job: str, count: int) -> None:
    """`count` rounds that rank 0 opens and leaves (a reset of every connection each)."""
    for _ in range(count):
        result = store.join(JoinIntent(job, 0, member_of(0, M), 2))
        store.leave(result.cohort, result.member)
        assert store.abandon(result.cohort)


@pytest.mark.parametrize("abandoned", [1, ROUNDS_KEPT, 3 * ROUNDS_KEPT])
def test_a_rank_naming_an_abandoned_round_joins_the_open_one(abandoned: int) -> None:
    """However many rounds were abandoned since (and forgotten), a rank that re-joins naming
    one that was never decided takes part in the open round."""
    store = Cohorts(lambda: 0.0)
    _abandon_rounds(store, "flap", abandoned)
    opened = store.join(JoinIntent("flap", 0, member_of(0, M), 2))
    late = store.join(JoinIntent("flap", 1, member_of(1, M), 2))
    assert opened.cohort.round == abandoned + 1
    assert late.cohort is opened.cohort and not late.replayed


def test_a_rank_naming_a_round_decided_without_it_is_told_it_is_over() -> None:
    """A round decided while the rank was away (here refused at its deadline, naming it
    missing): its ranks have their verdict, and the rank must not start a round alone."""
    now = [0.0]
    store = Cohorts(lambda: now[0])
    _abandon_rounds(store, "away", 2)
    first = store.join(JoinIntent("away", 0, member_of(0, M), 2))
    now[0] += 3600.0  # past the join deadline: refused, rank 1 missing
    decide_in(store, first.cohort, now[0])
    assert first.cohort.verdict is not None
    assert first.cohort.verdict.outcome is Outcome.REFUSED
    now[0] += 60.0  # later rounds come past the successor window (a restart's replay)
    _abandon_rounds(store, "away", 3 * ROUNDS_KEPT)
    for named in (2, 3):
        with pytest.raises(FailedPrecondition, match=f"round {named} of job 'away' is over"):
            store.join(JoinIntent("away", named, member_of(1, M), 2))


def test_a_decided_round_is_kept_however_many_rounds_are_abandoned_after_it() -> None:
    """Abandoned rounds never push a decided one out: its ranks' re-joins replay it."""
    now = [0.0]
    store = Cohorts(lambda: now[0])
    ranks = [member_of(r, M) for r in (0, 1)]
    for m in ranks:
        result = store.join(JoinIntent("kept", 0, m, 2))
    result.cohort.state.manifests[M.signature()] = M
    decide_in(store, result.cohort, now[0])
    assert result.cohort.verdict is not None
    now[0] += 60.0  # past the successor window
    _abandon_rounds(store, "kept", 3 * ROUNDS_KEPT)
    again = store.join(JoinIntent("kept", 1, ranks[1], 2))
    assert again.replayed and again.cohort is result.cohort


def _rank(addr: str, job: str, rank: int) -> pb.Verdict | str:
    """The rank's verdict, or its error's text (what the rank would exit with)."""
    try:
        # The agent's own backoff (up to 5 s): a rank that lags a few rounds behind.
        backoff = JoinOptions().backoff_max_s
        return agent_rank(addr, job, rank, WORLD, manifest_of(), 60, backoff_max_s=backoff)
    except CohortgateError as exc:
        return str(exc)


def _flapped(via: str, proxy: FaultProxy, coordinator: str, job: str) -> list[pb.Verdict | str]:
    """Ranks 0-4 join through `via` while `proxy` flaps; rank 5 joins directly after."""
    with ThreadPoolExecutor(max_workers=WORLD) as pool:
        five = [pool.submit(_rank, via, job, r) for r in range(WORLD - 1)]
        wait_joined(coordinator, job, WORLD - 1, within=30)
        time.sleep(1.5)  # past the first progress event: each rank re-joins naming round 1
        proxy.flap(FLAP_PERIOD_S, FLAP_FOR_S).join()
        sixth = pool.submit(_rank, coordinator, job, WORLD - 1)
        return [f.result(timeout=90) for f in [*five, sixth]]


def _one_formed_cohort(results: list[pb.Verdict | str]) -> None:
    errors = [r for r in results if isinstance(r, str)]
    assert not errors, errors
    verdicts = [r for r in results if isinstance(r, pb.Verdict)]
    assert [v.outcome for v in verdicts] == [pb.Verdict.OUTCOME_FORMED] * WORLD
    assert len({v.cohort_id for v in verdicts}) == 1
    print("formed as", verdicts[0].cohort_id)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_five_ranks_through_a_flapping_link_form_with_the_sixth() -> None:
    c = InProcessCoordinator(join_deadline=90.0, rank_grace=2.0)
    try:
        with FaultProxy(c.addr) as proxy:
            results = _flapped(proxy.addr, proxy, c.addr, "flap")
            assert proxy.resets >= 5  # the link did flap, while the five waited
    finally:
        c.stop()
    _one_formed_cohort(results)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_five_ranks_behind_a_relay_whose_upstream_flaps_form_with_the_sixth(
    tmp_path: Path,
) -> None:
    c = InProcessCoordinator(join_deadline=90.0, rank_grace=2.0)
    try:
        with (
            FaultProxy(c.addr) as proxy,
            relay_process(proxy.addr, tmp_path, "--local-ranks", str(WORLD - 1)) as (relay, _),
        ):
            results = _flapped(relay, proxy, c.addr, "flap-relay")
            assert proxy.resets >= 5
    finally:
        c.stop()
    _one_formed_cohort(results)

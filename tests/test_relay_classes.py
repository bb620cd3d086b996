"""A relay sends a node's ranks upstream as classes of ranks, and one request per rank to an
upstream older than them (a coordinator, or a rack relay), which a gRPC hop in the test plays
by dropping the field on the way up."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.cli.spawn import spawn
from tests.grpc_proxy import GrpcProxy
from tests.helpers import manifest_of, one_cohort, run_cohort
from tests.launches import coordinator_process, kill_group

FORMED = pb.Verdict.OUTCOME_FORMED


def _relay(tmp: Path, name: str, upstream: str) -> tuple[subprocess.Popen[bytes], int]:
    return spawn(
        tmp / f"{name}-port",
        ["--upstream", upstream, "--local-ranks", "4", "--window", "20"],
        stdout=open(tmp / f"{name}.log", "wb"),  # closed with the process
        new_session=True,
        command="relay",
    )


@pytest.mark.parametrize("upstream", ["current", "older-coordinator", "older-relay"])
def test_a_relay_sends_a_nodes_ranks_as_one_class_and_one_per_rank_to_an_older_upstream(
    tmp_path: Path, upstream: str
) -> None:
    """Relays send a node's ranks as one class (the coordinator validates and holds the
    shared part once); an upstream that reads no classes (an older coordinator, or an older
    rack relay) answers the first such group as empty, and from then on gets one request
    per rank: every job forms, and the relay says so once."""
    procs = []
    with coordinator_process("--join-deadline", "30", tmp=tmp_path) as (coordinator, _):
        above = coordinator
        if upstream == "older-relay":  # node relay -> (older) rack relay -> coordinator
            rack, rack_port = _relay(tmp_path, "rack", coordinator)
            procs.append(rack)
            above = f"127.0.0.1:{rack_port}"
        proxy = GrpcProxy(above, older=upstream != "current")
        node, port = _relay(tmp_path, "node", proxy.addr)
        procs.append(node)
        try:
            m = manifest_of()
            for job in ("a", "b"):
                one_cohort(run_cohort(f"127.0.0.1:{port}", job, dict.fromkeys(range(4), m)), FORMED)
        finally:
            for proc in procs:
                kill_group(proc)
            proxy.stop()
    said = (tmp_path / "node.log").read_text().count("the upstream reads no rank classes")
    if upstream != "current":
        assert proxy.sent() == ["classes", "members", "members"], proxy.sent()
        assert said == 1
    else:
        assert proxy.sent() == ["classes", "classes"], proxy.sent()
        # rank 0 (loud, the rendezvous) is a class of its own; the other three one class
        assert sorted(sorted(c.rank) for c in proxy.groups[0].ranks) == [[0], [1, 2, 3]]
        assert said == 0

"""agent.join() and agent.init_process_group(): the one line a training script adds."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from agent.client import CohortgateError, JoinOptions
from agent.client import join as client_join
from agent.torchrun import RankIdentity, free_port, write_error_file
from coordinator.layout import Layout, LayoutBuilder

if TYPE_CHECKING:
    import torch
    from torch.distributed import Store  # type: ignore[attr-defined]

    from coordinator.api.v1 import cohort_pb2 as pb


@dataclass(frozen=True)
class Cohort:
    """A formed cohort: everything init_process_group needs, and nothing before the gate opens."""

    job_id: str
    rank: int
    world_size: int
    init_method: str
    cohort_id: str
    round: int

    def store(self, timeout: timedelta = timedelta(minutes=10)) -> Store:
        """The cohort's rendezvous store: rank 0 hosts it at init_method, the others connect.

        Use this (or agent.init_process_group) rather than init_method= under torchrun:
        torchrun sets TORCHELASTIC_USE_AGENT_STORE, which makes init_process_group expect
        torchrun's own store at the endpoint, so nobody would host the cohort's.
        """
        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        parsed = urlparse(self.init_method)
        if parsed.hostname is None or parsed.port is None:
            raise ValueError(f"init_method {self.init_method!r} is not tcp://HOST:PORT")
        return TCPStore(
            parsed.hostname,
            parsed.port,
            self.world_size,
            is_master=self.rank == 0,
            timeout=timeout,
            multi_tenant=True,
        )


class CohortRefused(RuntimeError):
    """The coordinator refused to form the cohort; `report` is the full, rank-identical text."""

    def __init__(self, reason: str, report: str, verdict: pb.Verdict) -> None:
        super().__init__(f"{reason}\n{report}")
        self.reason = reason
        self.report = report
        self.verdict = verdict


def _device_type(model: torch.nn.Module) -> str:
    for tensor in model.parameters():
        return str(tensor.device.type)
    return "cpu"


def join(
    model: torch.nn.Module,
    *,
    job_id: str | None = None,
    addr: str | None = None,
    timeout_s: float | None = None,
    layout: Layout | LayoutBuilder | None = None,
    verify_values: bool = False,
) -> Cohort:
    """Present this rank's model signature and block until the coordinator decides.

    verify_values=True also sends a digest of the weights' values, computed on their own
    device (agent.digest), so a coordinator with the `weights` check on refuses replicas
    that start from different weights (a missed seed, a stale checkpoint); it costs one
    pass over the weights.

    Reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, TORCHELASTIC_RUN_ID, ...) and
    COHORTGATE_ADDR. A sharded job passes `layout` (see agent.layout()): the coordinator
    then checks placement, shard coverage and one signature per replica group instead of
    one signature for all ranks. Returns the formed cohort, or prints the refusal report to stderr,
    writes it to TORCHELASTIC_ERROR_FILE and raises CohortRefused.
    """
    from agent.client import runtime_facts
    from agent.signature import manifest as build_manifest
    from coordinator.api.v1 import cohort_pb2 as pb

    identity = RankIdentity.from_env(job_id=job_id, addr=addr)
    manifest = build_manifest(model)
    digests = None
    if verify_values:
        from agent.digest import weight_digests

        digests = [d for _, d in weight_digests(model)]
    if isinstance(layout, LayoutBuilder):
        from agent.dtensor import dtensor_pieces

        declared = {p.tensor for p in layout.pieces}
        layout.pieces.extend(dtensor_pieces(model, skip=declared))
    init_method = f"tcp://{identity.endpoint_host}:{free_port()}" if identity.rank == 0 else ""
    options = JoinOptions() if timeout_s is None else JoinOptions(timeout_s=timeout_s)
    try:
        verdict = client_join(
            identity,
            manifest,
            init_method=init_method,
            runtime=runtime_facts(_device_type(model)),
            options=options,
            layout=layout.build() if isinstance(layout, LayoutBuilder) else layout,
            digests=digests,
        )
    except CohortgateError as exc:
        write_error_file(identity.error_file, f"CohortgateError: {exc}", str(exc))
        raise
    if verdict.outcome == pb.Verdict.OUTCOME_FORMED:
        return Cohort(
            job_id=verdict.job_id,
            rank=identity.rank,
            world_size=verdict.world_size,
            init_method=verdict.init_method,
            cohort_id=verdict.cohort_id,
            round=verdict.round,
        )
    report = verdict.refusal.report
    header = f"[cohortgate] rank {identity.rank} on {identity.host}: cohort refused"
    print(f"{header}\n{report}", file=sys.stderr, flush=True)
    write_error_file(identity.error_file, f"CohortRefused: {verdict.reason}", report)
    raise CohortRefused(verdict.reason, report, verdict)


def init_process_group(model: torch.nn.Module, backend: str | None = None, **kwargs: Any) -> Cohort:
    """join(), then torch.distributed.init_process_group on the cohort's endpoint."""
    import torch.distributed as dist

    join_kwargs = {
        k: kwargs.pop(k)
        for k in ("job_id", "addr", "timeout_s", "layout", "verify_values")
        if k in kwargs
    }
    cohort = join(model, **join_kwargs)
    dist.init_process_group(
        backend=backend,
        store=cohort.store(kwargs.get("timeout") or timedelta(minutes=10)),
        rank=cohort.rank,
        world_size=cohort.world_size,
        **kwargs,
    )
    return cohort

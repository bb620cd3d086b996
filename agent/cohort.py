"""cohortgate.join() and cohortgate.init_process_group(): the one line a training script adds."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from cohortgate.agent.client import JoinOptions
from cohortgate.agent.client import join as client_join
from cohortgate.agent.torchrun import (
    CohortgateError,
    RankIdentity,
    free_port,
    say,
    torchrun_store,
    write_error_file,
)
from cohortgate.coordinator.contract.layout import Layout, LayoutBuilder
from cohortgate.coordinator.contract.settings import SettingError

if TYPE_CHECKING:
    import torch
    from torch.distributed import Store  # type: ignore[attr-defined]

    from cohortgate.coordinator.api.v1 import cohort_pb2 as pb


@dataclass(frozen=True)
class Cohort:
    """A formed cohort: everything init_process_group needs, and nothing before the gate opens."""

    job_id: str
    rank: int
    world_size: int
    init_method: str
    cohort_id: str
    round: int
    # Who this rank is (for audits), and its replica class: its layout's replica label,
    # "" for all ranks of a DDP job.
    identity: RankIdentity | None = field(default=None, compare=False, repr=False)
    replica_group: str = ""

    def audit(
        self, model: torch.nn.Module, step: int, optimizer: Any = None, every: int = 0
    ) -> None:
        """Digest this rank's weights (and `optimizer`'s state) on their device and send the
        digest to the coordinator from a background thread: the step waits for the digest
        only, never for the coordinator. The coordinator compares the ranks that must hold
        the same values (all ranks of a DDP job; under a layout, each replica group) and
        names the rank, host, tensors and step where they differ. Under `--policy
        audit=strict` every rank raises ReplicasDiverged at the stop step the coordinator
        picked, with the same report (in torchrun's root cause too). An unreachable
        coordinator is said once; training goes on.

        `every` (default: $COHORTGATE_AUDIT_EVERY, else 1): only steps that are a multiple
        of it are digested and sent; the others cost nothing. Call it every step either way:
        a strict stop is raised at the first call at or past the stop step."""
        self._auditor().audit(model, step, optimizer, every)

    def step(self, step: int) -> None:
        """This rank reached training step `step` (a counter: no network in the call; the
        agent's background thread reports it at most once a second). When no rank reaches a
        new step within the coordinator's --stall-after, the coordinator asks every rank where
        its main thread is and reports the stall: which rank is where, the odd one out first.
        Under `--policy stall=strict` the job ends with that report (in torchrun's root cause
        too); a rank whose main thread reaches this call then raises CohortStalled."""
        self._auditor().mark(step)

    def pause(self, reason: str = "pause") -> AbstractContextManager[None]:
        """`with cohort.pause("checkpoint"):` an on-purpose pause (a checkpoint save, an
        evaluation) that the stall detection skips, up to the coordinator's --pause-limit."""
        paused: AbstractContextManager[None] = self._auditor().pause(reason)
        return paused

    def _auditor(self) -> Any:
        from cohortgate.agent.audit import Auditor

        if self.identity is None:
            raise ValueError(
                "this Cohort was not returned by cohortgate.join(): it cannot audit or mark steps"
            )
        key = (self.cohort_id, self.rank)
        auditor = _AUDITORS.get(key)
        if auditor is None:
            auditor = _AUDITORS[key] = Auditor(
                self.identity, self.cohort_id, self.round, self.replica_group
            )
            _register_close_at_exit()
        return auditor

    def close(self, timeout_s: float = 15.0) -> None:
        """The training loop's last word: wait (up to `timeout_s`) for the audits in flight
        to be compared, and under `--policy audit=strict` raise ReplicasDiverged if any
        replicas differed, even when the job ended before the stop step. Leaving a `with
        cohort:` block does the same; so does the process's exit (exit code 5) for a script
        that calls neither. Without audits it returns at once."""
        auditor = _AUDITORS.get((self.cohort_id, self.rank))
        if auditor is not None:
            auditor.close(timeout_s)

    def __enter__(self) -> Cohort:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is None:  # an exception on its way out is the job's error already
            self.close()

    def store(self, timeout: timedelta = timedelta(minutes=10)) -> Store:
        """The cohort's rendezvous store, for init_process_group(store=...).

        Under torchrun (TORCHELASTIC_USE_AGENT_STORE=True), the store torchrun's agent
        already hosts at MASTER_ADDR:MASTER_PORT, under a prefix only the formed cohort knows
        (its cohort id). The agent outlives its workers, so no worker's exit can pull the
        store from under the others' teardown (rank 0 hosting it made one run in eight abort
        with "terminate called without an active exception"). Elsewhere rank 0 hosts a
        TCPStore at init_method and the others connect.
        """
        from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

        agent_store = torchrun_store()
        if agent_store is not None:
            host, port = agent_store
            client = TCPStore(host, port, is_master=False, timeout=timeout)
            return PrefixStore(f"cohortgate/{self.cohort_id}/", client)
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


_AUDITORS: dict[tuple[str, int], Any] = {}  # (cohort id, rank) -> cohortgate.agent.audit.Auditor


class CohortRefused(RuntimeError):
    """The coordinator refused to form the cohort; `report` is the full, rank-identical text."""

    def __init__(self, reason: str, report: str, verdict: pb.Verdict) -> None:
        super().__init__(f"{reason}\n{report}")
        self.reason = reason
        self.report = report
        self.verdict = verdict


def _drain_at_exit() -> None:
    """Collect garbage while the interpreter is still whole (atexit runs before finalizing).

    Root cause of "terminate called without an active exception" (SIGABRT, or SIGSEGV) in one
    teardown in eight: a DDP module and its optimizer form reference cycles, so the gloo
    process group they hold is freed only by the collection Py_Finalize runs. Meanwhile a
    gloo worker thread still destroys the last allreduce's Work, whose thread-local state
    holds a Python object; taking the GIL once the interpreter is finalizing ends that thread
    with pthread_exit, whose forced unwind through a noexcept destructor is std::terminate.
    Collected here instead, the process group's destructor (which releases the GIL) joins
    its worker threads while they can still take the GIL. (Core dump: thread in
    ProcessGroupGloo::runLoop -> ~AsyncAllreduceWork -> ~ThreadLocalState -> decref ->
    take_gil -> PyThread_exit_thread -> std::terminate; main thread in Py_FinalizeEx ->
    PyGC_Collect.)
    """
    import gc

    gc.collect()


def _close_at_exit() -> None:
    """A script that ended without cohort.close(): its audits still get their last word.
    Under the strict policy a divergence ends the process with EXIT_DIVERGED (an exception
    raised in an exit hook would leave the exit code 0), once the report is out; so does a
    strict stall with EXIT_STALLED, where the script returned before the stall's own end
    (STALL_GRACE_S after the report) came: the rank said it ends the job, it never exits 0."""
    from cohortgate.agent.audit import EXIT_DIVERGED, EXIT_STALLED
    from cohortgate.agent.torchrun import ReplicasDiverged

    for auditor in list(_AUDITORS.values()):
        code = 0
        try:
            auditor.close()
        except ReplicasDiverged:
            code = EXIT_DIVERGED
        if not code and auditor.stalled is not None:
            code = EXIT_STALLED
        if code:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


@functools.cache
def _register_close_at_exit() -> None:
    """Registered after _register_drain: exit hooks run last-in first, so this one runs
    while the process group is still whole."""
    import atexit

    atexit.register(_close_at_exit)


@functools.cache
def _register_drain() -> None:
    """Once per process, however many cohorts it joins."""
    import atexit

    atexit.register(_drain_at_exit)


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
    config: Any = None,
    facts: Mapping[str, Any] | None = None,
    packages: Sequence[str] = (),
) -> Cohort:
    """Present this rank's model signature and block until the coordinator decides.

    Beyond the parameters, every rank must agree on (each checked field by field):
    - the model config: `config`, or the model's own `model.config` (every Hugging Face
      model has one); GPT-2 with another n_head has the same shapes, not the same model;
    - the training code: the launching script, its git commit and local changes, and the
      versions of numerics packages (torch, transformers, ... and `packages`);
    - `facts`: small values the job must share, e.g. {"tokenizer":
      cohortgate.tokenizer_fingerprint(tok), "data": "mix-v3", "resume_step": 1200}.

    verify_values=True also sends a digest of the weights' values, computed on their own
    device (cohortgate.agent.digest), so a coordinator with the `weights` check on refuses replicas
    that start from different weights (a missed seed, a stale checkpoint); it costs one
    pass over the weights.

    Reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, TORCHELASTIC_RUN_ID, ...) and
    COHORTGATE_ADDR. A sharded job passes `layout` (see cohortgate.layout()): the coordinator
    then checks placement, shard coverage and one signature per replica group instead of
    one signature for all ranks. Returns the formed cohort, or prints the refusal report to stderr,
    writes it to TORCHELASTIC_ERROR_FILE and raises CohortRefused.
    """
    try:
        agreed = _agreed(model, config, facts, packages)
        return _join(model, job_id, addr, timeout_s, layout, verify_values, agreed)
    except CohortRefused:
        raise  # its report is on stderr and in the error file already
    except SettingError as exc:
        # A bad COHORTGATE_* value: one line naming it, in torchrun's Root Cause too.
        summary = f"CohortgateError: {exc}"
        write_error_file(os.environ.get("TORCHELASTIC_ERROR_FILE"), summary, summary)
        raise CohortgateError(str(exc)) from None
    except Exception as exc:
        # Whatever stopped the join (a bad environment, an unreachable coordinator, a
        # tensor the manifest cannot read) reaches torchrun's Root Cause, not only stderr.
        summary = f"{type(exc).__name__}: {exc}"
        write_error_file(os.environ.get("TORCHELASTIC_ERROR_FILE"), summary, summary)
        raise


def _agreed(
    model: Any, config: Any, facts: Mapping[str, Any] | None, packages: Sequence[str]
) -> dict[str, dict[str, str]]:
    """The fingerprints this rank sends: config (when there is one), code, facts (when given)."""
    from cohortgate.agent.identity import code_fields
    from cohortgate.coordinator.contract.fingerprint import config_fields, flatten

    agreed = {"code": code_fields(packages)}
    config = config if config is not None else getattr(model, "config", None)
    if config is not None and (
        callable(getattr(config, "to_dict", None)) or isinstance(config, Mapping)
    ):
        agreed["config"] = config_fields(config)
    if facts is not None:
        agreed["facts"] = flatten(facts)
    return agreed


def _join(
    model: torch.nn.Module,
    job_id: str | None,
    addr: str | None,
    timeout_s: float | None,
    layout: Layout | LayoutBuilder | None,
    verify_values: bool,
    agreed: dict[str, dict[str, str]],
) -> Cohort:
    from cohortgate.agent.client import runtime_facts
    from cohortgate.agent.signature import manifest as build_manifest
    from cohortgate.coordinator.api.v1 import cohort_pb2 as pb

    identity = RankIdentity.from_env(job_id=job_id, addr=addr)
    manifest = build_manifest(model)
    digests = None
    if verify_values:
        from cohortgate.agent.digest import weight_digests

        digests = [d for _, d in weight_digests(model)]
    if isinstance(layout, LayoutBuilder):
        from cohortgate.agent.dtensor import dtensor_pieces

        declared = {p.tensor for p in layout.pieces}
        layout.pieces.extend(dtensor_pieces(model, skip=declared))
    sharded = False
    if verify_values and layout is None:
        from cohortgate.agent.dtensor import dtensor_pieces

        sharded = any(not p.replicated for p in dtensor_pieces(model))
    init_method = f"tcp://{identity.endpoint_host}:{free_port()}" if identity.rank == 0 else ""
    options = JoinOptions() if timeout_s is None else JoinOptions(timeout_s=timeout_s)
    built = layout.build() if isinstance(layout, LayoutBuilder) else layout
    verdict = client_join(
        identity,
        manifest,
        init_method=init_method,
        runtime=runtime_facts(_device_type(model)),
        options=options,
        layout=built,
        digests=digests,
        sharded_without_layout=sharded,
        agreed=agreed,
    )
    if verdict.outcome == pb.Verdict.OUTCOME_FORMED:
        if verdict.warnings and identity.local_rank == 0:  # once per node
            lines = "\n".join(f"  {w}" for w in verdict.warnings)
            say(
                f"[cohortgate] rank {identity.rank} on {identity.host}: cohort "
                f"{verdict.cohort_id} formed with warnings:\n{lines}"
            )
        _register_drain()
        return Cohort(
            job_id=verdict.job_id,
            rank=identity.rank,
            world_size=verdict.world_size,
            init_method=verdict.init_method,
            cohort_id=verdict.cohort_id,
            round=verdict.round,
            identity=identity,
            replica_group=built.replica_label if built is not None else "",
        )
    report = verdict.refusal.report
    headline = verdict.refusal.headline or verdict.reason
    # One line per rank, the full report once per node (local rank 0): 4 ranks each
    # printing it, then torchrun's summary, buried the one line that matters.
    said = f"[cohortgate] rank {identity.rank} on {identity.host}: cohort refused: {headline}"
    if identity.local_rank == 0:
        said += f"\n{report}"
    say(said)
    # torchrun's summary shows every failed rank's error file: the report once (local
    # rank 0), the others name the culprits and say where the report is.
    body = (
        report
        if identity.local_rank == 0
        else f"(the full report: stderr of local rank 0 on {identity.host}, or `cohortgate "
        f"explain {verdict.job_id} {verdict.round}`)"
    )
    write_error_file(identity.error_file, f"CohortRefused: {headline}", f"{headline}\n{body}")
    raise CohortRefused(verdict.reason, report, verdict)


def init_process_group(model: torch.nn.Module, backend: str | None = None, **kwargs: Any) -> Cohort:
    """join(), then torch.distributed.init_process_group on the cohort's endpoint."""
    import torch.distributed as dist

    join_kwargs = {
        k: kwargs.pop(k)
        for k in (
            "job_id",
            "addr",
            "timeout_s",
            "layout",
            "verify_values",
            "config",
            "facts",
            "packages",
        )
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

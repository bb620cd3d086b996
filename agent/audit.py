"""cohort.audit(model, step): is this rank still holding the same weights as its replicas?

The training thread pays only for the on-device digest (cohortgate.agent.digest, the same
function the start-up weights check uses); a background thread sends it to the coordinator and
reads the answer. The coordinator never makes a rank wait: an unreachable coordinator is said
once and training goes on; audits resume when it is back.

Per-tensor digests of the last KEPT_STEPS audited steps stay in memory (32 bytes a tensor),
so that when the coordinator finds a difference and asks one rank per class for them, the
rank sends those of the step that differed, and the report names the tensors.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Any

from cohortgate.agent.torchrun import CohortStalled, ReplicasDiverged
from cohortgate.coordinator.contract.digests import DIGEST_FORMAT_VERSION, combine

if TYPE_CHECKING:
    import grpc

    from cohortgate.agent.torchrun import RankIdentity
    from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
    from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
    from cohortgate.coordinator.codec.channel import ClientSecurity
    from cohortgate.coordinator.codec.leader import Upstream

log = logging.getLogger("cohortgate.agent")

KEPT_STEPS = 8
# Audits waiting to be sent (all of them go in the next call); past it the oldest is
# dropped: a coordinator that did not answer for this many audited steps.
QUEUED = 64
CALL_TIMEOUT_S = 5.0
# Per-tensor digests sent in one audit at most (names and digests: ~50 bytes each); past it
# the first ones only, marked truncated.
MAX_TENSORS = 40_000
# A closing rank waits this long at most for its last audited step to be compared: past the
# coordinator's 10 s for per-tensor digests, so that a divergence found as the job ends is
# reported before it exits. It asks again this often meanwhile.
CLOSE_TIMEOUT_S = 15.0
PROBE_S = 0.1
# What a process exits with when its exit hook finds a divergence under the strict policy
# (the script ended without cohort.close(), and the stop step was never reached).
EXIT_DIVERGED = 5
# Step marks (cohort.step, cohort.audit): sent at most this often while the step changes,
# and this often while it does not (a rank waiting in a collective still beats, so the
# coordinator can ask it where it is, and tell a waiting rank from a stopped one).
STEP_EVERY_S = 1.0
BEAT_S = 2.0
# A stall under the strict policy: the main thread has this long to reach cohort.step() and
# raise CohortStalled; then the background thread ends the process with EXIT_STALLED.
STALL_GRACE_S = 2.0
EXIT_STALLED = 6


class Auditor:
    """One rank's audits of one formed cohort."""

    def __init__(self, identity: RankIdentity, cohort_id: str, round_: int, group: str) -> None:
        self.identity, self.cohort_id, self.round, self.group = identity, cohort_id, round_, group
        self.kept: OrderedDict[int, list[tuple[str, bytes]]] = OrderedDict()
        self.queue: deque[pb.RankAudit] = deque(maxlen=QUEUED)
        self.asked: deque[int] = deque()  # steps whose per-tensor digests were asked for
        self.cond = threading.Condition()
        self.level = ""
        self.stop_step = 0
        self.headline = self.report = ""
        self.diverged_step = 0
        # the divergence last printed (its step and headline: step 0 is a step)
        self._told: tuple[int, str] | None = None
        self.last_step = -1  # the last step this rank queued an audit of
        self._last: pb.RankAudit | None = None  # that audit, sent again while closing
        self.compared_until = 0  # what the coordinator last said it has compared
        self.tensors_pending = False  # a divergence's per-tensor digests still asked for
        self.closing = self.closed = self.raised = False
        from cohortgate.agent.torchrun import audit_every

        self.every = audit_every()
        self._unreachable = False
        self._thread: threading.Thread | None = None
        self._stub: pb_grpc.CohortServiceStub | None = None
        self._channel: grpc.Channel | None = None
        self._security: ClientSecurity | None = None
        self._upstream: Upstream | None = None
        self._addr = ""
        # Steps (stall detection): written by the training thread without the lock (one
        # tuple, atomic), read by the sender.
        self._mark: tuple[int, float] = (-1, 0.0)  # (step, monotonic time reached)
        self._pause: tuple[str, float] = ("", 0.0)  # (reason, since)
        self._beat_sent: tuple[int, float] = (-1, 0.0)  # (step, wall-clock time sent)
        self._snapshot_for = 0  # a stall whose snapshot the coordinator asked for
        self._snapshot_sent = 0  # the stall whose snapshot was sent (asked again: not resent)
        self._stall_told = 0  # the stall last printed
        self.stalled: tuple[str, str] | None = None  # strict: (headline, report)

    # -- the training thread ---------------------------------------------------------------
    def mark(self, step: int) -> None:
        """This rank reached `step`: an assignment (no lock, no network); the sender reports
        it within STEP_EVERY_S. Raises CohortStalled once a strict stall ended the job."""
        stalled = self.stalled
        if stalled is not None:
            raise CohortStalled(*stalled)
        if step != self._mark[0]:
            self._mark = (step, time.monotonic())
        if self._thread is None:
            self._start()

    def pause(self, reason: str) -> Any:
        """A context manager: an on-purpose pause (a checkpoint save) the stall detection
        skips, up to the coordinator's --pause-limit."""
        import contextlib

        @contextlib.contextmanager
        def paused() -> Any:
            self._pause = (reason or "pause", time.monotonic())
            with self.cond:
                self.cond.notify_all()  # said at once, not at the next beat
            try:
                yield
            finally:
                self._pause = ("", 0.0)
                self._mark = (self._mark[0], time.monotonic())  # its time is not a stall's
                with self.cond:
                    self.cond.notify_all()

        if self._thread is None:
            self._start()
        return paused()

    def audit(self, model: Any, step: int, optimizer: Any = None, every: int = 0) -> None:
        self.mark(step)
        self._raise_if_stopped(step)
        if self.level == "off" or step % (every or self.every):
            return
        from cohortgate.agent.digest import tensor_digests

        tensors = tensor_digests(model, optimizer)
        with self.cond:
            self.kept[step] = tensors
            while len(self.kept) > KEPT_STEPS:
                self.kept.popitem(last=False)
            audit = self._base(step)
            audit.digest, audit.digest_format = combine(tensors), DIGEST_FORMAT_VERSION
            self.queue.append(audit)
            self.last_step, self._last = step, audit
            self.cond.notify_all()
        self._start()
        self._say_divergence()

    def _raise_if_stopped(self, step: int) -> None:
        with self.cond:
            stop, headline, report = self.stop_step, self.headline, self.report
        if not stop or step < stop:
            return
        self._stop(f"stopped at step {step}", step, headline, report)

    def _stop(self, where: str, step: int, headline: str, report: str) -> None:
        """Said on stderr (the report once per node), written to torchrun's error file,
        raised: the same words on every rank."""
        from cohortgate.agent.torchrun import say, write_error_file

        self.raised = True
        ident = self.identity
        said = f"[cohortgate] rank {ident.rank} on {ident.host}: {where}: {headline}"
        if ident.local_rank == 0:
            said += f"\n{report}"
        say(said)
        write_error_file(ident.error_file, f"ReplicasDiverged: {headline}", f"{headline}\n{report}")
        raise ReplicasDiverged(step, headline, report)

    # -- the last word ---------------------------------------------------------------------
    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Wait (up to `timeout_s`) until the coordinator has compared this rank's last
        audited step and reported any divergence it found; under the strict policy, raise
        ReplicasDiverged if the replicas differed, even when the job ended before the stop
        step: no job exits 0 with corrupted weights. Idempotent; a rank that already raised
        at the stop step is not told twice."""
        with self.cond:
            if self.closed:
                return
            self.closed = self.closing = True
            self._beat_sent = (-2, 0.0)  # a last beat says this rank is done
            self.cond.notify_all()
            settled = self.cond.wait_for(self._settled, timeout_s) if self._started() else True
            level, stop = self.level, self.stop_step
            step, headline, report = self.diverged_step, self.headline, self.report
        if not settled:
            log.warning(
                "cohortgate: the audit of step %d was not compared within %gs of "
                "cohort.close() (a rank sent none, or the coordinator is unreachable); "
                "closing without its word",
                self.last_step,
                timeout_s,
            )
        if self.raised or level == "off":
            return
        if level == "strict" and headline:
            at = f"stop step {stop}" if stop else "the divergence"
            self._stop(f"closing before {at}", step, headline, report)
        self._say_divergence()

    def _started(self) -> bool:
        return self._thread is not None and self._last is not None

    def _settled(self) -> bool:
        """The coordinator has compared the last step this rank audited, and asks for no
        per-tensor digests (a divergence's report is out)."""
        return self.compared_until > self.last_step and not self.tensors_pending

    def _probing(self) -> bool:
        return self.closing and self._last is not None and not self._settled()

    def _say_divergence(self) -> None:
        """Under warn: the divergence once per rank (the report once per node)."""
        with self.cond:
            step, headline, report = self.diverged_step, self.headline, self.report
            strict = self.level == "strict"  # said at the stop step instead, with the stop
        if strict or not headline or (step, headline) == self._told:
            return
        self._told = (step, headline)
        said = f"[cohortgate] rank {self.identity.rank} on {self.identity.host}: {headline}"
        if self.identity.local_rank == 0:
            said += f"\n{report}"
        from cohortgate.agent.torchrun import say

        say(said)

    # -- the sender thread -----------------------------------------------------------------
    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="cohortgate-audit", daemon=True)
            self._thread.start()

    def _base(self, step: int) -> pb.RankAudit:
        from cohortgate.coordinator.api.v1 import cohort_pb2 as pb

        ident = self.identity
        return pb.RankAudit(
            cohort_id=self.cohort_id,
            job_id=ident.job_id,
            round=self.round,
            rank=ident.rank,
            world_size=ident.world_size,
            host=ident.host,
            incarnation=ident.incarnation,
            step=step,
            group=self.group,
        )

    def _next(self) -> list[pb.RankAudit]:
        """The next request's audits: per-tensor digests asked for first (a message of
        their own), else every audit queued (steps faster than a call: one call for all)."""
        with self.cond:
            while not self.queue and not self.asked:
                beat_in = self._beat_due()
                if beat_in <= 0:
                    return [self._beat()]
                if not self._probing():
                    self.cond.wait(None if beat_in == float("inf") else beat_in)
                    continue
                # Closing: the last audit again (the coordinator takes it once), for an
                # answer that says whether its step is compared yet.
                self.cond.wait(PROBE_S)
                if not self.queue and not self.asked and self._probing():
                    assert self._last is not None
                    return [self._last]
            if not self.asked:
                queued = list(self.queue)
                self.queue.clear()
                return queued
            step = self.asked.popleft()
            tensors = self.kept.get(step, [])
        audit = self._base(step)
        audit.tensor_names.extend(n for n, _ in tensors[:MAX_TENSORS])
        audit.tensor_digests.extend(d for _, d in tensors[:MAX_TENSORS])
        audit.tensors_truncated = len(tensors) > MAX_TENSORS
        return [audit]

    def _beat_due(self) -> float:
        """Seconds until the next step mark is due (<= 0: now); inf when there is no step.
        Due on whole periods of the wall clock, which the ranks of one host share: a relay
        takes its node's marks in one batch (one call upstream per node and period)."""
        step, _ = self._mark
        if step < 0:
            return float("inf")
        sent_step, sent_at = self._beat_sent
        if self._snapshot_for or sent_step == -2:
            return 0.0
        period = STEP_EVERY_S if step != sent_step or self._pause[0] else BEAT_S
        now = time.time()
        if now // period > sent_at // period:
            return 0.0
        return (now // period + 1) * period - now

    def _beat(self) -> pb.RankAudit:
        """A step mark: the step and its age, a pause, done, and a snapshot when asked."""
        from cohortgate.coordinator.api.v1 import cohort_pb2 as pb

        step, reached = self._mark
        now = time.monotonic()
        beat = self._base(step)
        beat.step_only = True
        beat.step_age_s = max(0.0, now - reached)
        reason, since = self._pause
        if reason:
            beat.paused, beat.paused_s = reason[:200], max(0.0, now - since)
        beat.done = self.closed
        if self._snapshot_for:
            from cohortgate.agent.stack import main_thread

            w = main_thread()
            beat.stall_id = self._snapshot_sent = self._snapshot_for
            beat.snapshot.CopyFrom(
                pb.StackSnapshot(where=w.where, call=w.call, via=w.via, frames=w.frames)
            )
            self._snapshot_for = 0
        self._beat_sent = (step, time.time())
        return beat

    def _run(self) -> None:
        while True:
            audits = self._next()
            try:
                reply = self._send(audits)
            except Exception as exc:  # never the training's problem
                self._lost(exc)
                continue
            if self._upstream is not None:
                self._upstream.reached()
            if self._unreachable:
                self._unreachable = False
                log.warning("cohortgate: the coordinator answers audits again")
            for answer in reply.answers:
                if answer.cohort_id == self.cohort_id:
                    self._heard(answer)

    def _send(self, audits: list[pb.RankAudit]) -> pb.AuditReply:
        from cohortgate.coordinator.api.v1 import cohort_pb2 as pb

        stub, metadata = self._connected()
        reply: pb.AuditReply = stub.Audit(
            pb.AuditRequest(audits=audits), timeout=CALL_TIMEOUT_S, metadata=metadata
        )
        return reply

    def _connected(self) -> tuple[pb_grpc.CohortServiceStub, Any]:
        """The stub for the coordinator tried now (COHORTGATE_ADDR may list replicas)."""
        from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
        from cohortgate.coordinator.codec.channel import ClientSecurity
        from cohortgate.coordinator.codec.leader import Upstream

        if self._upstream is None:
            self._security = ClientSecurity.from_env()
            self._upstream = Upstream(self.identity.addr)
        assert self._security is not None
        if self._stub is None or self._addr != self._upstream.current:
            if self._channel is not None:
                self._channel.close()
            self._addr = self._upstream.current
            self._channel = self._security.channel(self._addr)
            self._stub = pb_grpc.CohortServiceStub(self._channel)
        return self._stub, self._security.metadata

    def _lost(self, exc: Exception) -> None:
        """Said once, then retried every 0.5 s; a standby's answer (it names the leader)
        moves the next call there at once. The audit that failed is dropped: audits are
        a sample, the next one says as much."""
        import grpc

        pause: float | None = 0.5
        if isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE:
            assert self._upstream is not None
            pause = self._upstream.failed(exc)
            if pause == 0.0:
                return
        if not self._unreachable:
            self._unreachable = True
            details = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
            log.warning(
                "cohortgate: audits and step marks cannot reach the coordinator at %s (%s); "
                "training goes on, and they resume when it answers",
                self._upstream or self.identity.addr,
                str(details or type(exc).__name__).splitlines()[0][:200],
            )
        time.sleep(0.5 if pause is None else max(pause, 0.5))

    def _heard(self, answer: pb.AuditAnswer) -> None:
        if answer.snapshot_wanted or answer.stall_id:
            self._heard_stall(answer)
        with self.cond:
            self.level = answer.level or self.level
            self.compared_until = max(self.compared_until, answer.compared_until)
            self.tensors_pending = bool(answer.tensors_rank)
            self.cond.notify_all()
            if answer.report:
                self.headline, self.report = answer.headline, answer.report
                self.diverged_step = answer.diverged_step
            if answer.stop_step:
                self.stop_step = answer.stop_step
            for rank, step in zip(answer.tensors_rank, answer.tensors_step, strict=False):
                if rank == self.identity.rank and step not in self.asked and step in self.kept:
                    self.asked.append(step)

    # -- stalls ----------------------------------------------------------------------------
    def _heard_stall(self, answer: pb.AuditAnswer) -> None:
        """A snapshot asked for (sent with the next beat, at once), or a stall reported:
        said once per stall (the report once per node); under strict, the job ends here."""
        from cohortgate.agent.torchrun import say, write_error_file

        # Every answer says so until the report is out: one snapshot per stall is enough.
        if answer.snapshot_wanted and answer.snapshot_wanted != self._snapshot_sent:
            with self.cond:
                self._snapshot_for = answer.snapshot_wanted
                self.cond.notify_all()
        if not answer.stall_id or answer.stall_id == self._stall_told:
            return
        self._stall_told = answer.stall_id
        ident = self.identity
        headline, report = answer.stall_headline, answer.stall_report
        said = f"[cohortgate] rank {ident.rank} on {ident.host}: {headline}"
        if ident.local_rank == 0:
            said += f"\n{report}"
        if not answer.stall_stop:
            say(said)
            return
        say(f"{said}\n[cohortgate] rank {ident.rank}: ending the job (--policy stall=strict)")
        write_error_file(ident.error_file, f"CohortStalled: {headline}", f"{headline}\n{report}")
        self.stalled = (headline, report)
        # The main thread raises CohortStalled at its next cohort.step(); one stuck in a
        # collective or in its own code never gets there: the process ends from here.
        threading.Thread(target=self._end, name="cohortgate-stall", daemon=True).start()

    def _end(self) -> None:
        import os
        import sys

        time.sleep(STALL_GRACE_S)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_STALLED)

"""End to end: real torchrun jobs on gloo that call cohort.audit(model, step) every step
(examples/train.py, examples/train_parallel.py), against a real coordinator process; through
`cohortgate run` (a relay on each node); across a coordinator restart."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
from tests.helpers import REPO, free_port
from tests.launches import (
    TRAIN,
    coordinator_process,
    finish,
    kill_group,
    launch,
    launch_env,
    torchrun,
    two_node_args,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

PARALLEL = REPO / "examples" / "train_parallel.py"
AUDITED = ("--audit", "--steps", "20", "--step-sleep", "0.2")
FLIP = ("--flip-rank", "2", "--flip-step", "5")
HEADLINE = "replicas diverged at step 5: rank 2 on {host} differs from ranks 0-1,3 in 2.weight"


def audits_of(addr: str, job: str) -> list[pb.AuditRecord]:
    with grpc.insecure_channel(addr) as ch:
        found = pb_grpc.StatusServiceStub(ch).ListAudits(pb.ListAuditsRequest(job_id=job))
    return list(found.audits)


def audit_status(tmp: Path, job: str) -> dict[str, object]:
    """The job's line in the coordinator's /status.json "audits" (one coordinator in tmp)."""
    (port_file,) = tmp.glob("port-*")
    metrics_port = port_file.read_text().split()[1]
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/status.json") as answer:
        status = json.load(answer)
    (line,) = [a for a in status["audits"] if a["job_id"] == job]
    return dict(line)


def host_of(out: str) -> str:
    found = re.search(r"\[cohortgate\] rank \d+ on (\S+):", out)
    assert found, out
    return found.group(1)


def test_clean_steps_give_no_finding_and_every_step_is_compared(tmp_path: Path) -> None:
    with coordinator_process("--join-deadline", "60", tmp=tmp_path) as (addr, _):
        result = torchrun(addr, "audit-clean", *AUDITED, tmp=tmp_path)
        assert result.returncode == 0, result.stdout
        assert result.stdout.count("trained 20 steps") == 4, result.stdout
        assert "diverged" not in result.stdout and "cannot reach" not in result.stdout
        assert audits_of(addr, "audit-clean") == []
        line = audit_status(tmp_path, "audit-clean")
        assert (line["last_compared"], line["diverged_step"], line["missing"]) == (19, 0, [])


def test_a_bit_flipped_on_rank_2_is_named_at_the_next_audit_and_training_goes_on(
    tmp_path: Path,
) -> None:
    with coordinator_process("--join-deadline", "60", tmp=tmp_path) as (addr, log):
        result = torchrun(addr, "audit-warn", *AUDITED, *FLIP, tmp=tmp_path)
        assert result.returncode == 0, result.stdout  # warn: the job goes on
        out = result.stdout
        headline = HEADLINE.format(host=host_of(out))
        for rank in range(4):  # every rank is told, once
            assert out.count(f"[cohortgate] rank {rank} on ") == 1, out
            assert f"rank {rank} on {host_of(out)}: {headline}" in out, out
        assert "1 tensor of 6 differs: 2.weight (rank 2 against rank 0)" in out
        assert out.count("trained 20 steps") == 4
        (record,) = audits_of(addr, "audit-warn")
        assert (record.kind, record.step, record.level, record.headline) == (
            "diverged",
            5,
            "warn",
            headline,
        )
        assert any("replicas diverged" in line for line in log.read_text().splitlines())


def test_strict_stops_every_rank_at_one_step_with_the_report_in_torchruns_root_cause(
    tmp_path: Path,
) -> None:
    with coordinator_process("--join-deadline", "60", "--policy", "audit=strict", tmp=tmp_path) as (
        addr,
        _,
    ):
        result = torchrun(addr, "audit-strict", *AUDITED, *FLIP, tmp=tmp_path)
    out = result.stdout
    assert result.returncode != 0, out
    stops = set(re.findall(r"\[cohortgate\] rank \d+ on \S+: stopped at step (\d+):", out))
    assert len(stops) == 1, out  # the same stop step for every rank that reached it
    (stop,) = stops
    assert int(stop) > 5 and "trained 20 steps" not in out
    root = out[out.index("Root Cause (first observed failure)") :]
    assert "exitcode  : 5" in root
    assert HEADLINE.format(host=host_of(out)) in root
    assert f"The strict policy stops the job at step {stop}" in root
    assert "1 tensor of 6 differs: 2.weight (rank 2 against rank 0)" in root


def test_under_tp2_dp2_the_replicas_of_each_slice_are_compared_not_all_ranks(
    tmp_path: Path,
) -> None:
    with coordinator_process("--join-deadline", "60", "--policy", "audit=strict", tmp=tmp_path) as (
        addr,
        _,
    ):
        args = ("--sizes", "tp=2,dp=2", *AUDITED)
        clean = torchrun(addr, "audit-mesh", *args, tmp=tmp_path, script=PARALLEL)
        assert clean.returncode == 0, clean.stdout  # tp slices differ, their replicas do not
        assert clean.stdout.count("trained 20 steps") == 4
        assert audits_of(addr, "audit-mesh") == []
        flipped = torchrun(addr, "audit-mesh2", *args, *FLIP, tmp=tmp_path, script=PARALLEL)
    out = flipped.stdout
    assert flipped.returncode != 0, out
    # rank 2 is tp=0 dp=1: only its replica, rank 0 (tp=0 dp=0), is compared with it
    assert "replica group tp=0 cp=0 ep=0 pp=0 (ranks that must hold the same values)" in out
    assert "reference: rank 0 on" in out and "differs:   rank 2 on" in out
    assert "fc1.weight (rank 2 against rank 0)" in out
    assert "tp=1" not in out[out.index("Root Cause") :]


@pytest.mark.parametrize(
    ("steps", "closing"), [("30", "close"), ("8", "close"), ("8", "exit hook")]
)
def test_strict_stops_a_job_that_ends_before_its_stop_step(
    tmp_path: Path, steps: str, closing: str
) -> None:
    """Issue 37's repro: `COHORTGATE_POLICY=audit=strict cohortgate run --nproc-per-node 4
    examples/train.py --steps 30 --audit --flip-rank 2 --flip-step 5`, steps of a few ms. 8
    steps end before any stop step (at least two steps past the last one audited); the
    last word (cohort.close(), or the exit hook of a script that never calls it) still
    stops every rank with the report, and the job exits non-zero."""
    env = launch_env(tmp_path, COHORTGATE_POLICY="audit=strict")
    args = ["--nproc-per-node", "4", "--rdzv-id", f"short-{steps}", str(TRAIN), "--steps", steps]
    args += ["--audit", "--quiet", *FLIP, *(["--no-close"] if closing == "exit hook" else [])]
    proc = launch(args, env, tmp_path, via="cohortgate run")
    (out,) = finish([proc])
    assert proc.returncode != 0, out
    # close() raises before the script says it trained; the exit hook comes after it did.
    assert (f"trained {steps} steps" in out) is (closing == "exit hook"), out
    headline = HEADLINE.format(host=host_of(out))
    told = re.findall(
        r"\[cohortgate\] rank (\d) on \S+: (?:closing before|stopped at) [^:]+: (.*)", out
    )
    # The first rank to stop takes the others down (torchrun ends them): some may not speak.
    assert told and {said for _, said in told} == {headline}, out
    assert "Root Cause (first observed failure)" in out, out
    root = out[out.index("Root Cause (first observed failure)") :]
    assert "exitcode  : 5" in root and headline in root, root


def test_through_cohortgate_run_on_two_nodes_audits_pass_the_node_relays(tmp_path: Path) -> None:
    with coordinator_process("--join-deadline", "120", tmp=tmp_path) as (addr, _):
        rdzv = f"127.0.0.1:{free_port()}"
        args = ["--coordinator", addr, *two_node_args(rdzv, "audit-relay", TRAIN, *AUDITED, *FLIP)]
        procs = [
            launch(args, launch_env(tmp_path), tmp_path, via="cohortgate run") for _ in range(2)
        ]
        outs = finish(procs)
        records = audits_of(addr, "audit-relay")
    for proc, out in zip(procs, outs, strict=True):
        assert proc.returncode == 0, out
        assert "through this node's relay 127.0.0.1:" in out, out
        assert HEADLINE.format(host=host_of(out)) in out, out
        assert out.count("trained 20 steps") == 2, out
    (record,) = records
    assert (record.kind, record.step) == ("diverged", 5)


def test_a_coordinator_restart_mid_training_loses_no_audit_of_the_steps_after_it(
    tmp_path: Path,
) -> None:
    """The coordinator is killed at step ~5 and comes back on its port with its history:
    each rank says once that audits cannot reach it and goes on training; the bit flipped
    at step 40 is found by the restarted coordinator."""
    port = free_port()
    listen = f"127.0.0.1:{port}"
    env = launch_env(tmp_path, COHORTGATE_ADDR=listen, COHORTGATE_JOB="audit-restart")
    args = ["--nproc-per-node", "4", "--master-addr", "127.0.0.1", "--master-port", "0"]
    args += ["--monitor-interval", "0.2", str(TRAIN), "--audit", "--steps", "60"]
    args += ["--step-sleep", "0.2", "--flip-rank", "2", "--flip-step", "40"]
    seen: list[str] = []
    with coordinator_process("--join-deadline", "60", tmp=tmp_path, listen=listen):
        proc = launch(args, env, tmp_path)
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                seen.append(line)
                if line.startswith("step 5:"):
                    break
        except BaseException:
            kill_group(proc)
            raise
    time.sleep(2.0)  # the ranks audit into a closed port meanwhile
    with coordinator_process("--join-deadline", "60", tmp=tmp_path, listen=listen) as (addr, _):
        (rest,) = finish([proc], timeout=180)
        records = audits_of(addr, "audit-restart")
    out = "".join(seen) + rest
    assert proc.returncode == 0, out
    assert out.count("trained 60 steps") == 4, out
    unreachable = out.count("audits and step marks cannot reach the coordinator")
    assert 1 <= unreachable <= 4, out  # once per rank at most
    diverged = [r for r in records if r.kind == "diverged"]
    assert [r.step for r in diverged] == [40], records
    assert "rank 2 on" in diverged[0].headline and "2.weight" in diverged[0].headline


def test_audits_every_4th_step_find_the_flip_at_the_next_audited_step_and_stop_there(
    tmp_path: Path,
) -> None:
    """COHORTGATE_AUDIT_EVERY=4: steps 0, 4, 8... are audited (the same on every rank, so no
    rank is ever missing); the flip after step 5 is found at step 8; strict still stops
    every rank at one step."""
    with coordinator_process("--join-deadline", "60", "--policy", "audit=strict", tmp=tmp_path) as (
        addr,
        _,
    ):
        env = launch_env(
            tmp_path,
            COHORTGATE_ADDR=addr,
            COHORTGATE_JOB="audit-every",
            COHORTGATE_AUDIT_EVERY="4",
        )
        args = ["--nproc-per-node", "4", "--master-addr", "127.0.0.1", "--master-port", "0"]
        args += [str(TRAIN), "--audit", "--steps", "60", "--step-sleep", "0.1", *FLIP]
        (out,) = finish([launch(args, env, tmp_path)])
        records = audits_of(addr, "audit-every")
    assert [(r.kind, r.step) for r in records] == [("diverged", 8)], out
    stops = set(re.findall(r"\[cohortgate\] rank \d+ on \S+: stopped at step (\d+):", out))
    assert len(stops) == 1 and int(next(iter(stops))) > 8, out
    assert "replicas diverged at step 8: rank 2 on" in out

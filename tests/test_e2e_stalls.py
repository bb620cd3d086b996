"""End to end: real torchrun jobs on gloo (examples/train.py: DDP, steps of about 0.2 s,
cohort.step(step) every step) that hang mid-training, against a real coordinator process:
the stall is named while it happens (`cohortgate explain`), or ends the job under strict with
the report in torchrun's root cause; through `cohortgate run` (a relay on each node) too."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from tests.helpers import free_port, log_events, wait_until
from tests.launches import (
    TRAIN,
    coordinator_process,
    finish,
    kill_group,
    kill_job_workers,
    launch,
    launch_env,
    one_node_args,
    two_node_args,
)
from tests.netfault import FaultProxy
from tests.test_e2e_audits import audits_of, host_of

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

# The gloo timeout stays far past the stall bound: the stall is named by cohortgate, long
# before any collective would time out.
STALL = ("--stall-after", "10")
HANG = ("--hang-rank", "2", "--hang-step", "5")
CLI = [sys.executable, "-m", "cohortgate.coordinator.cli"]
SLOW_STEPS = ("--steps", "400", "--step-sleep", "0.2", "--quiet")


def job_args(job: str, *script_args: str) -> list[str]:
    return one_node_args(TRAIN, *SLOW_STEPS, *script_args)


def explained(addr: str, job: str, tmp: Path, until: str, within: float) -> str:
    """`cohortgate explain JOB` until its output holds `until` (the job runs meanwhile)."""
    give_up = time.monotonic() + within
    while True:
        out = subprocess.run(
            [*CLI, "explain", job, "--addr", addr],
            capture_output=True,
            text=True,
            env=launch_env(tmp),
            timeout=30,
        ).stdout
        if until in out:
            return out
        assert time.monotonic() < give_up, f"no {until!r} within {within} s:\n{out}"
        time.sleep(1.0)


def stalled_for(headline: str) -> int:
    found = re.search(r"stalled at step \d+ for (\d+) s", headline)
    assert found, headline
    return int(found.group(1))


def test_strict_ends_a_hung_job_with_the_report_in_torchruns_root_cause(tmp_path: Path) -> None:
    flags = ("--join-deadline", "60", *STALL, "--policy", "stall=strict")
    with coordinator_process(*flags, tmp=tmp_path) as (addr, log):
        env = launch_env(tmp_path, COHORTGATE_ADDR=addr, COHORTGATE_JOB="hung-strict")
        (out,) = finish([launch(job_args("hung-strict", *HANG), env, tmp_path)], timeout=200)
        ended = time.time()
        records = audits_of(addr, "hung-strict")
        (stalled,) = [e for e in log_events(log) if e["event"] == "cohort stalled"]
    assert "Root Cause (first observed failure)" in out, out
    root = out[out.index("Root Cause (first observed failure)") :]
    assert "exitcode  : 6" in root, root
    host = host_of(out)
    headline = next(line for line in root.splitlines() if "traceback : stalled at" in line)
    assert headline.endswith(
        f": rank 2 on {host} in wait_for_batch ({TRAIN}:{wait_line()}); "
        f"ranks 0-1,3 on {host} in backward ({TRAIN}:{backward_line()}, via Tensor.backward)"
    ), headline
    assert "trained" not in out  # no rank finished its steps
    (record,) = records
    assert (record.kind, record.step, record.level) == ("stalled", 5, "strict")
    # named within the bound plus the snapshots' wait, not at a collective's timeout
    assert stalled_for(record.headline) <= 10 + 5 + 5, record.headline
    # torchrun exits within 40 s of the stall's start (its last new step), not at gloo's
    # timeout (30 min): the acceptance's bound, on a busy 2-core machine
    found = datetime.fromisoformat(str(stalled["timestamp"]).replace("Z", "+00:00"))
    started = found.timestamp() - float(stalled["stalled_s"])
    assert ended - started < 40, (ended - started, stalled)


def test_warn_names_the_stall_in_explain_while_the_job_still_hangs(tmp_path: Path) -> None:
    with coordinator_process("--join-deadline", "60", *STALL, tmp=tmp_path) as (addr, _):
        env = launch_env(tmp_path, COHORTGATE_ADDR=addr, COHORTGATE_JOB="hung-warn")
        proc = launch(job_args("hung-warn", *HANG), env, tmp_path)
        try:
            out = explained(addr, "hung-warn", tmp_path, "the stall (still going on)", 90)
            assert proc.poll() is None, "the job ended: warn leaves it alone"
        finally:
            kill_group(proc)
    assert "rank 2 on" in out and f"in wait_for_batch ({TRAIN}:{wait_line()})" in out, out
    assert f"in backward ({TRAIN}:{backward_line()}, via Tensor.backward)" in out, out
    assert re.search(r"last steps: ranks 0-3 at step 5 \(\d+ s ago\)", out), out
    # reported within 30 s of the stall's start (the acceptance's bound): the headline says
    # how long it had lasted when it was found
    headline = out[out.index("the stall (still going on): ") :].splitlines()[0]
    assert stalled_for(headline) <= 30, headline


def test_through_relays_a_stopped_rank_is_named_as_not_answering_with_its_host(
    tmp_path: Path,
) -> None:
    """Two nodes of two ranks through `cohortgate run` (a relay on each); rank 3 SIGSTOPs
    itself at step 5: its beats stop, the others wait in the collective. The report names
    rank 3 and its host as not answering."""
    with coordinator_process("--join-deadline", "120", *STALL, tmp=tmp_path) as (addr, _):
        script = ("--stop-rank", "3", "--stop-step", "5")
        procs = two_relayed_nodes(addr, "hung-relay", tmp_path, *SLOW_STEPS, *script)
        try:
            out = explained(addr, "hung-relay", tmp_path, "the stall (still going on)", 120)
        finally:
            for proc in procs:
                kill_group(proc)
            kill_job_workers("hung-relay")  # rank 3, stopped: its agent's SIGTERM waits
    stall = out[out.index("the stall (still going on)") :]
    headline = stall.splitlines()[0]
    assert re.search(r"; no answer from rank 3 on \S+$", headline), headline
    assert re.search(r"ranks 0-2( on \S+)? in backward \(", headline), headline
    assert "within 5 s (a stopped or dead process, or a lost host)" in stall


def test_through_relays_strict_ends_a_hung_job_on_both_nodes(tmp_path: Path) -> None:
    flags = ("--join-deadline", "120", *STALL, "--policy", "stall=strict")
    with coordinator_process(*flags, tmp=tmp_path) as (addr, _):
        procs = two_relayed_nodes(addr, "hung-relay-strict", tmp_path, *SLOW_STEPS, *HANG)
        outs = finish(procs, timeout=200)
        records = audits_of(addr, "hung-relay-strict")
    for proc, out in zip(procs, outs, strict=True):
        assert proc.returncode != 0, out
        assert "through this node's relay 127.0.0.1:" in out, out
        root = out[out.index("Root Cause (first observed failure)") :]
        assert "exitcode  : 6" in root, root
        assert re.search(r"rank 2 on \S+ in wait_for_batch \(", root), root
    (record,) = records
    assert (record.kind, record.step, record.level) == ("stalled", 5, "strict")


def two_relayed_nodes(
    addr: str, job: str, tmp: Path, *script_args: str
) -> list[subprocess.Popen[str]]:
    """Two `cohortgate run` launches of two ranks each (a relay on each node) of `job`."""
    rdzv = f"127.0.0.1:{free_port()}"
    args = ["--coordinator", addr, *two_node_args(rdzv, job, TRAIN, *script_args)]
    return [launch(args, launch_env(tmp), tmp, via="cohortgate run") for _ in range(2)]


def test_two_collectives_give_two_groups_each_named_by_its_call(tmp_path: Path) -> None:
    with coordinator_process("--join-deadline", "60", *STALL, tmp=tmp_path) as (addr, _):
        env = launch_env(tmp_path, COHORTGATE_ADDR=addr, COHORTGATE_JOB="hung-odd")
        odd = ("--odd-call-rank", "1", "--odd-call-step", "5")
        proc = launch(job_args("hung-odd", *odd), env, tmp_path)
        try:
            out = explained(addr, "hung-odd", tmp_path, "the stall (still going on)", 90)
        finally:
            kill_group(proc)
    headline = out[out.index("the stall (still going on)") :].splitlines()[0]
    assert re.search(
        r"stalled at step 5 for \d+ s: rank 1 on \S+ in broadcast \(\S+train\.py:\d+\); "
        r"ranks 0,2-3 on \S+ in all_reduce \(\S+train\.py:\d+\)$",
        headline,
    ), headline


def test_a_pause_on_purpose_longer_than_the_bound_is_no_stall(tmp_path: Path) -> None:
    """A 30-step job that saves a checkpoint for 5 s at step 10 (inside `with
    cohort.pause("checkpoint"):`), under --stall-after 3: it finishes, and no stall is
    recorded."""
    with coordinator_process("--join-deadline", "60", "--stall-after", "3", tmp=tmp_path) as (
        addr,
        _,
    ):
        env = launch_env(tmp_path, COHORTGATE_ADDR=addr, COHORTGATE_JOB="paused")
        args = job_args("paused", "--pause-step", "10", "--pause-s", "5")
        args[args.index("--steps") + 1] = "30"
        proc = launch(args, env, tmp_path)
        (out,) = finish([proc], timeout=200)
        records = audits_of(addr, "paused")
    assert proc.returncode == 0, out
    assert out.count("trained 30 steps") == 4, out
    assert records == [] and "stalled" not in out, (records, out)


def test_a_flapping_then_partitioned_link_to_the_coordinator_is_no_stall(tmp_path: Path) -> None:
    """The ranks reach the coordinator through a proxy that, mid-training, resets every
    connection every 0.7 s for 6 s, then drops everything for 8 s (past --stall-after 3 and
    the 6 s after which a silent rank counts as gone), then heals. Under stall=strict the job
    must train to its end: marks lost on the way are no stall, and a job nobody hears from is
    not stalled but unheard."""
    flags = ("--join-deadline", "60", "--stall-after", "3", "--policy", "stall=strict")
    with (
        coordinator_process(*flags, tmp=tmp_path) as (addr, _),
        FaultProxy(addr) as proxy,
    ):
        env = launch_env(tmp_path, COHORTGATE_ADDR=proxy.addr, COHORTGATE_JOB="flaky-marks")
        args = job_args("flaky-marks")
        args[args.index("--steps") + 1] = "200"  # 40 s of steps
        proc = launch(args, env, tmp_path)
        try:
            wait_until("the job formed", lambda: audits_status_has(tmp_path, "flaky-marks"), 90)
            proxy.flap(0.7, 6.0).join()
            proxy.blackhole()
            time.sleep(8.0)
            proxy.heal()
            (out,) = finish([proc], timeout=200)
        finally:
            kill_group(proc)
        records = audits_of(addr, "flaky-marks")
    assert proxy.resets >= 5, proxy.resets  # the link did flap, mid-training
    assert proc.returncode == 0, out
    assert out.count("trained 200 steps") == 4, out
    assert records == [], records


def audits_status_has(tmp: Path, job: str) -> bool:
    """The coordinator in `tmp` watches `job`'s steps (its /status.json "stalls")."""
    import json
    import urllib.request

    (port_file,) = tmp.glob("port-*")
    metrics_port = port_file.read_text().split()[1]
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/status.json") as answer:
        return any(s["job_id"] == job for s in json.load(answer)["stalls"])


def line_of(text: str) -> int:
    """The line of examples/train.py that holds `text` (the report names file:line)."""
    for number, line in enumerate(TRAIN.read_text().splitlines(), start=1):
        if text in line:
            return number
    raise AssertionError(f"{text!r} not in {TRAIN}")


def wait_line() -> int:
    return line_of("time.sleep(3600)  # a data loader that never delivers")


def backward_line() -> int:
    return line_of("loss.backward()")

"""Issue 13, the places real deployments go first: one coordinator per address, loud
failures, relaunches after an abandoned round, launches that reuse a job id."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
from cohortgate.coordinator.cli.launch import LaunchError, job_id, parse_torchrun
from tests.helpers import (
    InProcessCoordinator,
    RankResult,
    free_port,
    join_request,
    manifest_of,
    run_rank,
    wait_joined,
)
from tests.launches import coordinator_process, kill_group, session

pytestmark = pytest.mark.timeout(120)


JOIN_DEADLINE = 60.0  # the conftest `coord` fixture's deadline


def cli(*args: str, timeout: float = 30, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cohortgate.coordinator.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **env},
        check=False,
    )


# -- 1. the job id of `cohortgate run` ---------------------------------------------------
def test_the_job_id_comes_from_rdzv_id_as_in_a_plain_torchrun_launch() -> None:
    args = parse_torchrun(["--nnodes", "2", "--rdzv-id=job3", "--nproc-per-node", "2", "t.py"])
    assert job_id(args, {}).value == "job3" and not job_id(args, {}).generated
    assert job_id(parse_torchrun(["--rdzv_id", "j", "t.py"]), {}).value == "j"
    assert job_id(args, {"COHORTGATE_JOB": "mine"}).value == "mine"
    # torchrun reads its options from PET_* too
    assert job_id(parse_torchrun(["--nnodes", "2", "t.py"]), {"PET_RDZV_ID": "p"}).value == "p"
    single = job_id(parse_torchrun(["--nproc-per-node", "2", "t.py", "--rdzv-id", "x"]), {})
    assert single.generated and single.value.startswith("run-")  # script args are not ours
    with pytest.raises(LaunchError, match="needs --rdzv-id"):
        job_id(parse_torchrun(["--nnodes", "1:4", "t.py"]), {})
    assert job_id(parse_torchrun(["--standalone", "--rdzv-id", "j", "t.py"]), {}).generated


def test_torchruns_option_table_matches_torch() -> None:
    """cohortgate run checks torchrun's options itself (before anything starts), so its
    table must be torch's own: a torch upgrade that adds or drops one fails here."""
    from torch.distributed.run import get_args_parser

    from cohortgate.coordinator.cli.launch import TORCHRUN_FLAGS, TORCHRUN_VALUES

    theirs = {
        a.dest: (tuple(a.option_strings), a.nargs == 0)
        for a in get_args_parser()._actions
        if a.option_strings and a.dest != "help"
    }
    ours = {d: (o, True) for d, o in TORCHRUN_FLAGS.items()}
    ours |= {d: (o, False) for d, o in TORCHRUN_VALUES.items()}
    assert {d: (tuple(sorted(o)), f) for d, (o, f) in ours.items()} == {
        d: (tuple(sorted(o)), f) for d, (o, f) in theirs.items()
    }


@pytest.mark.slow
def test_run_refuses_typos_missing_scripts_and_unjoinable_multinode_before_starting(
    tmp_path: Path,
) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    started = time.monotonic()
    for args, words in (
        (["--bogus", str(script)], "--bogus is not a torchrun option"),
        (["--nproc-per-node", "2", "nothere.py"], "training script 'nothere.py' does not exist"),
        (["--nnodes", "2", "--rdzv-id", "j", str(script)], "needs --coordinator HOST:PORT"),
        (["--coordinator", "c:1", "--nnodes", "2", str(script)], "needs --rdzv-id JOB"),
        (["--coordinator", "http://c:1", str(script)], "is not HOST:PORT"),
        (
            ["--join-deadline", "soon", str(script)],
            "--join-deadline: Input should be a valid number",
        ),
        (["--join-deadline", "-5", str(script)], "--join-deadline: Input should be greater than 0"),
    ):
        done = cli("run", *args, TMPDIR=str(tmp_path))
        assert done.returncode == 2, (args, done.stderr)
        assert words in done.stderr, (args, done.stderr)
        assert "[cohortgate] job" not in done.stdout  # nothing was started
    assert time.monotonic() - started < 30
    assert not list(tmp_path.glob("cohortgate-*"))


# -- 2. one process per address ----------------------------------------------------------
def _health(addr: str) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(addr) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
        return int(reply.status)


@pytest.mark.slow
def test_a_second_serve_or_relay_on_a_held_address_fails_in_one_line(tmp_path: Path) -> None:
    port = free_port()
    with coordinator_process(tmp=tmp_path, listen=f"127.0.0.1:{port}") as (addr, _):
        metrics_port = int((tmp_path.glob("port-*").__next__()).read_text().split()[1])
        for args, flag, held in (
            (["serve", "--listen", addr, "--metrics-listen", "off"], "--listen", port),
            (["relay", "--upstream", addr, "--listen", addr], "--listen", port),
            (
                [
                    "serve",
                    "--listen",
                    "127.0.0.1:0",
                    "--metrics-listen",
                    f"127.0.0.1:{metrics_port}",
                ],
                "--metrics-listen",
                metrics_port,
            ),
        ):
            started = time.monotonic()
            done = cli(*args, "--history", "off", timeout=20) if args[0] == "serve" else cli(*args)
            assert time.monotonic() - started < 5
            assert done.returncode == 1, done
            lines = done.stderr.strip().splitlines()
            assert len(lines) == 1, done.stderr
            assert (
                f"{flag} 127.0.0.1:{held}: the address is already in use, held by pid" in lines[0]
            )
            assert "cohortgate.coordinator.cli serve" in lines[0]  # it can tell who holds it
        assert _health(addr) == 1  # the first one still serves


@pytest.mark.slow
def test_start_up_errors_are_one_line_naming_the_address() -> None:
    for listen, words in (
        ("nonsense", "--listen: 'nonsense' is not HOST:PORT"),
        ("127.0.0.1:99999", "port 99999 is out of range (0-65535)"),
        ("192.0.2.1:7070", "--listen 192.0.2.1:7070 is not a loopback address"),
    ):
        done = cli("serve", "--listen", listen, "--history", "off")
        assert done.returncode == 2, done
        assert done.stderr.count("\n") == 1 and words in done.stderr, done.stderr
        assert "pydantic" not in done.stderr


# -- 3. an unreachable or malformed coordinator address ----------------------------------
AGENT = textwrap.dedent(
    """
    import sys, time, torch, cohortgate
    model = torch.nn.Linear(2, 2)
    print("joining", flush=True)
    started = time.monotonic()
    try:
        cohortgate.join(model, timeout_s=float(sys.argv[1]))
    except Exception as exc:
        print(f"failed after {time.monotonic() - started:.2f}s: {type(exc).__name__}: {exc}")
    """
)


def _agent(addr: str, timeout_s: float, tmp: Path, rank: int = 0) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "RANK": str(rank),
        "WORLD_SIZE": "2",
        "COHORTGATE_JOB": "lonely",
        "COHORTGATE_ADDR": addr,
        "TORCHELASTIC_ERROR_FILE": str(tmp / f"error-{rank}.json"),
        "PYTHONUNBUFFERED": "1",
    }
    return session([sys.executable, "-c", AGENT, str(timeout_s)], env=env)


@pytest.mark.slow
def test_no_coordinator_is_reported_by_rank_0_within_10s_and_named_at_the_end(
    tmp_path: Path,
) -> None:
    addr = f"127.0.0.1:{free_port()}"  # nothing listens here
    proc = _agent(addr, 14, tmp_path)
    try:
        assert proc.stdout is not None
        lines: list[tuple[float, str]] = []
        for line in proc.stdout:
            lines.append((time.monotonic(), line.rstrip()))
        proc.wait(timeout=30)
    finally:
        kill_group(proc)
    text = "\n".join(line for _, line in lines)
    joining = next(t for t, line in lines if line == "joining")
    said = [t for t, line in lines if f"cannot reach the cohortgate coordinator at {addr}" in line]
    assert said and said[0] - joining < 10, text
    assert "connection refused" in text and "retrying until" in text, text
    final = next(line for _, line in lines if line.startswith("failed after"))
    assert f"cannot reach the cohortgate coordinator at {addr}: connection refused" in final
    assert "DEADLINE_EXCEEDED" not in final
    assert "cannot reach" in (tmp_path / "error-0.json").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("addr", ["localhost", "http://127.0.0.1:7073", "127.0.0.1:7073/"])
def test_a_malformed_address_fails_at_once_naming_the_form(addr: str, tmp_path: Path) -> None:
    proc = _agent(addr, 60, tmp_path, rank=1)
    out, _ = proc.communicate(timeout=60)
    final = next(line for line in out.splitlines() if line.startswith("failed after"))
    assert float(final.split()[2].rstrip("s:")) < 1.0, final
    assert f"AgentConfigError: COHORTGATE_ADDR={addr!r}" in final and "is not HOST:PORT" in final
    # torchrun's Root Cause shows it (the error file), not "To enable traceback see"
    assert "is not HOST:PORT" in (tmp_path / "error-1.json").read_text()


# -- 4. an abandoned round -----------------------------------------------------------------
def _metric(coord: InProcessCoordinator, name: str) -> float:
    with urllib.request.urlopen(f"{coord.metrics_url}/metrics", timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_relaunch_after_an_abandoned_round_forms_at_once(coord: InProcessCoordinator) -> None:
    m = manifest_of()
    with grpc.insecure_channel(coord.addr) as channel:
        call = pb_grpc.CohortServiceStub(channel).Join(join_request("exp8", 0, 2, m), timeout=30)
        first = next(e for e in call if e.WhichOneof("event") == "progress")
        assert first.progress.joined == 1
        call.cancel()  # Ctrl-C: the only rank of round 1 leaves
    give_up = time.monotonic() + 10
    while coord.call(lambda: coord.running.coordinator.summaries("exp8"))[0].state != "abandoned":
        assert time.monotonic() < give_up, "the round was not abandoned"
        time.sleep(0.05)
    started = time.monotonic()
    results: list[RankResult | None] = [None] * 4
    threads = [
        threading.Thread(
            target=lambda r: results.__setitem__(
                r, run_rank(coord.addr, join_request("exp8", r, 4, m), m)
            ),
            args=(r,),
        )
        for r in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.monotonic() - started < 10
    for res in results:
        assert res is not None and res.error is None, res
        assert res.verdict is not None and res.verdict.outcome == pb.Verdict.OUTCOME_FORMED
        assert res.verdict.round == 2
    summaries = coord.call(lambda: coord.running.coordinator.summaries("exp8"))
    assert [(s.round, s.state) for s in summaries] == [(1, "abandoned"), (2, "formed")]
    assert _metric(coord, "cohortgate_cohorts_abandoned_total") == 1
    assert 'outcome="refused"' not in urllib.request.urlopen(
        f"{coord.metrics_url}/metrics", timeout=10
    ).read().decode().replace("# ", "")
    assert _metric(coord, "cohortgate_cohorts_waiting") == 0


def test_a_rank_that_rejoins_an_abandoned_round_takes_part_in_the_open_one(
    coord: InProcessCoordinator,
) -> None:
    """An agent whose connection blipped re-joins naming its round: if it was the only
    rank there, the round was abandoned meanwhile, and that must not refuse the re-join."""
    m = manifest_of()
    with grpc.insecure_channel(coord.addr) as channel:
        call = pb_grpc.CohortServiceStub(channel).Join(join_request("blip", 0, 2, m), timeout=30)
        assert next(e for e in call if e.WhichOneof("event") == "progress").progress.round == 1
        call.cancel()
    time.sleep(0.5)
    # both ranks re-join naming the abandoned round 1: accepted, and they form round 2
    with ThreadPoolExecutor(2) as pool:
        results = list(
            pool.map(
                lambda r: run_rank(coord.addr, join_request("blip", r, 2, m, round=1), m), (0, 1)
            )
        )
    for res in results:
        assert res.error is None, res.error
        assert res.verdict is not None and res.verdict.outcome == pb.Verdict.OUTCOME_FORMED
        assert res.verdict.round == 2


# -- 5. launches that reuse a job id -------------------------------------------------------
def test_two_launches_with_one_job_id_are_refused_naming_both(coord: InProcessCoordinator) -> None:
    m = manifest_of()
    out: dict[str, object] = {}

    def rank(name: str, r: int, launch: str) -> None:
        req = join_request("collide1", r, 2, m, launch=launch, host=f"host-{launch[-1]}")
        out[name] = run_rank(coord.addr, req, m)

    a0 = threading.Thread(target=rank, args=("a0", 0, "127.0.0.1:29500/A"))
    a0.start()
    wait_joined(coord.addr, "collide1", 1)
    rank("b0", 0, "127.0.0.1:29611/B")  # rank 0 is held by launch A
    a0.join()
    for name in ("a0", "b0"):
        res = out[name]
        verdict = res.verdict  # type: ignore[attr-defined]
        assert verdict is not None and verdict.outcome == pb.Verdict.OUTCOME_REFUSED, res
        assert verdict.refusal.cause == pb.Refusal.CAUSE_LAUNCH
        report = verdict.refusal.report
        assert "launch 127.0.0.1:29500/A: 1 rank [0] on host-A" in report, report
        assert "launch 127.0.0.1:29611/B: 1 rank [0] on host-B" in report, report
        assert "its own --rdzv-id" in report
        assert verdict.refusal.headline.startswith("ranks of 2 launches share job id 'collide1'")


def test_ranks_of_two_launches_on_free_ranks_never_form(coord: InProcessCoordinator) -> None:
    m = manifest_of()
    results = {}

    def rank(r: int, launch: str) -> None:
        results[r] = run_rank(coord.addr, join_request("collide2", r, 2, m, launch=launch), m)

    threads = [
        threading.Thread(target=rank, args=(0, "hostA:29500")),
        threading.Thread(target=rank, args=(1, "hostB:29500")),
    ]
    threads[0].start()
    wait_joined(coord.addr, "collide2", 1)  # launch A holds rank 0 when launch B's rank 1 joins
    threads[1].start()
    for t in threads:
        t.join()
    outcomes = {r: res.verdict.outcome for r, res in results.items() if res.verdict}
    assert pb.Verdict.OUTCOME_FORMED not in outcomes.values()
    assert results[1].verdict is not None
    assert "launch hostB:29500: 1 rank [1]" in results[1].verdict.refusal.report


# -- 9. status shows the real reason -------------------------------------------------------
def test_status_shows_the_reason_not_its_dedupe_key(coord: InProcessCoordinator) -> None:
    m = manifest_of()
    with grpc.insecure_channel(coord.addr) as channel:
        call = pb_grpc.CohortServiceStub(channel).Join(join_request("why", 0, 2, m), timeout=30)
        next(call)
        done = cli("status", "why", "--json", "--addr", coord.addr)
        call.cancel()
    assert '"reason": "[1/2 ranks joined]"' in done.stdout, done.stdout
    assert "#" not in done.stdout


# -- 11. the README's and the docs' commands: tests/test_docs.py (the docs build's check)
def test_every_help_line_states_its_default() -> None:
    import argparse

    from cohortgate.coordinator.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = [
        (name, a.option_strings[-1])
        for name, parser in sub.choices.items()
        for a in parser._actions
        if a.option_strings and a.dest != "help" and not a.required
        if "default" not in (a.help or "") and "required" not in (a.help or "")
    ]
    assert missing == []
    from cohortgate.coordinator.edge.config import ServeConfig

    default = ServeConfig.model_fields["join_deadline"].default
    assert f"serve's default, {default:g})" in cli("run", "--help").stdout


@pytest.mark.slow
def test_explain_reads_the_history_file_when_no_coordinator_answers(tmp_path: Path) -> None:
    history = tmp_path / "history.sqlite"
    with coordinator_process("--join-deadline", "30", tmp=tmp_path) as (addr, _):
        threads = [
            threading.Thread(
                target=run_rank,
                args=(
                    addr,
                    join_request("gone2", r, 2, manifest_of(width=4 + r)),
                    manifest_of(width=4 + r),
                ),
            )
            for r in range(2)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    nobody = f"127.0.0.1:{free_port()}"
    direct = cli("explain", "gone2", "--history", str(history), "--addr", nobody)
    assert direct.returncode == 0, direct.stderr
    assert "job gone2 round 1: refused" in direct.stdout
    assert "differs:   signature" in direct.stdout
    fallback = cli("explain", "gone2", "--addr", nobody, COHORTGATE_HISTORY=str(history))
    assert fallback.returncode == 0, fallback.stderr
    assert f"no coordinator answers at {nobody}; reading {history}" in fallback.stderr
    assert fallback.stdout == direct.stdout
    none = cli("explain", "never", "--history", str(history))
    assert none.returncode == 1 and "no verdict of job 'never'" in none.stderr

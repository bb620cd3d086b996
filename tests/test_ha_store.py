"""Leadership and the verdict history on a real etcd, without coordinators: campaigners take
over from each other, a hung etcd fails every call in flight, a replica that no longer
leads stores nothing, and a large record is stored in parts."""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from pathlib import Path

import pytest

from cohortgate.coordinator.etcd import etcd_pb2 as epb
from cohortgate.coordinator.etcd.client import EtcdError, EtcdSettings, EtcdThread, prefix_end
from cohortgate.coordinator.etcd.leader import Leadership
from cohortgate.coordinator.state.base import VerdictRow
from cohortgate.coordinator.state.etcd_history import EtcdHistory
from tests.etcd import EtcdServer, etcd_server
from tests.etcd import prefix as etcd_prefix
from tests.test_store_contract import verdict_of

TTL = 2


# -- leadership and the store, without coordinators --------------------------------------
@pytest.mark.timeout(60)
def test_one_of_two_campaigners_leads_and_the_other_takes_over_when_it_resigns(
    etcd: EtcdServer,
) -> None:
    settings = EtcdSettings(etcd.endpoint, prefix=etcd_prefix())
    threads = [EtcdThread(settings), EtcdThread(settings)]
    changes: list[tuple[str, bool]] = []
    both = [
        Leadership(
            t,
            replica=name,
            advertise=f"{name}:7070",
            ttl_s=TTL,
            changed=functools.partial(lambda n, leading, _: changes.append((n, leading)), name),
        )
        for t, name in zip(threads, ("a", "b"), strict=True)
    ]
    try:
        both[0].start()
        give_up = time.monotonic() + 10
        while not both[0].leading:
            assert time.monotonic() < give_up
            time.sleep(0.02)
        both[1].start()
        time.sleep(1.5)
        assert not both[1].leading and both[1].lead.advertise == "a:7070", "b sees who leads"
        both[0].close()  # revokes its lease: b leads at once, not after the TTL
        resigned = time.monotonic()
        while not both[1].leading:
            assert time.monotonic() - resigned < 2.0, "b did not take over after a resigned"
            time.sleep(0.02)
        assert changes == [("a", True), ("a", False), ("b", True)]
    finally:
        for leadership in both:
            leadership.close()
        for t in threads:
            t.close()


@pytest.mark.timeout(60)
def test_a_hung_etcd_fails_every_call_in_flight_as_an_etcd_error(tmp_path: Path) -> None:
    """A call that times out drops its channel; the calls still on it (a lease renewal in
    flight) fail as EtcdError too, never as a cancellation that would end the loop that
    made them (a leader that never campaigned again after a hung etcd came back)."""
    with etcd_server(tmp_path) as etcd:
        thread = EtcdThread(EtcdSettings(etcd.endpoint, timeout_s=1.0))
        client = thread.client
        try:
            thread.run(client.range(b"warm"), 5)
            etcd.pause()

            async def both() -> list[object]:
                request = epb.RangeRequest(key=b"slow")
                slow = client.call(
                    "slow range", lambda md, _: client.kv.Range(request, timeout=10, metadata=md)
                )
                got: list[object] = await asyncio.gather(
                    slow, client.range(b"fast"), return_exceptions=True
                )
                return got

            outcomes = thread.run(both(), 15)
            assert [type(o) for o in outcomes] == [EtcdError, EtcdError], outcomes
            assert "its channel broke" in str(outcomes[0])
            etcd.resume()
            thread.run(client.range(b"again"), 5)  # and the next call finds etcd again
        finally:
            etcd.resume()  # (a running etcd takes SIGCONT as nothing)
            thread.close()


@pytest.mark.timeout(60)
def test_a_replica_that_no_longer_leads_stores_no_verdict_and_steps_down(
    etcd: EtcdServer,
) -> None:
    """The fence: a write under a token whose leader key was replaced (another replica
    leads now) is not stored, `written` is never called, and `lost` is."""
    settings = EtcdSettings(etcd.endpoint, prefix=etcd_prefix())
    thread = EtcdThread(settings)
    key = settings.key_prefix + b"leader"

    async def take() -> int:
        await thread.client.put(key, b"{}")
        return int((await thread.client.range(key)).kvs[0].create_revision)

    try:
        old = thread.run(take(), timeout=5)
        lost: list[str] = []
        store = EtcdHistory(thread, token=lambda: old, lost=lost.append)
        thread.run(thread.client.delete(key), timeout=5)
        thread.run(take(), timeout=5)  # the key again, created by someone else
        written = threading.Event()
        store.record(VerdictRow.of(verdict_of("j", 1), {0: "a"}), written.set)
        assert store.flush(5)
        assert not written.is_set(), "a verdict written without the lead"
        assert lost and "no longer this replica" in lost[0]
        stored = thread.run(
            thread.client.range(
                settings.key_prefix + b"v/", prefix_end(settings.key_prefix + b"v/")
            ),
            timeout=5,
        )
        assert not stored.kvs, "nothing stored"
        assert store.get("j") is None and store.last_round("j") == 0
    finally:
        thread.close()


@pytest.mark.timeout(60)
def test_a_record_larger_than_one_etcd_request_is_stored_in_parts_and_read_back(
    etcd: EtcdServer,
) -> None:
    settings = EtcdSettings(etcd.endpoint, prefix=etcd_prefix())
    thread = EtcdThread(settings)
    key = settings.key_prefix + b"leader"
    try:

        async def take() -> int:
            await thread.client.put(key, b"{}")
            return int((await thread.client.range(key)).kvs[0].create_revision)

        token = thread.run(take(), timeout=5)
        store = EtcdHistory(thread, token=lambda: token)
        import os

        members = {r: os.urandom(48).hex() for r in range(30_000)}  # ~2.9 MB, ~1.5 MB packed
        written = threading.Event()
        verdict = verdict_of("big", 1)
        store.record(VerdictRow.of(verdict, members), written.set)
        assert written.wait(10), store.problem
        again = EtcdHistory(thread)  # a standby: reads the listing, the parts on demand
        row = again.get("big")
        assert row is not None and row.members == members
        assert again.verdict_of("big", members[29_999]) == verdict
    finally:
        thread.close()


KILLED_HOLDER = """
import sys, time
sys.path.insert(0, {repo!r})
from pathlib import Path
from tests.etcd import EtcdServer
server = EtcdServer(Path({data!r})).start()
print(server.proc.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(60)
def test_an_etcd_dies_with_the_test_process_that_started_it(tmp_path: Path) -> None:
    """A test process killed outright runs no teardown: its etcd must not live on."""
    import os
    import subprocess
    import sys

    from tests.helpers import REPO

    holder = subprocess.Popen(
        [sys.executable, "-c", KILLED_HOLDER.format(repo=str(REPO), data=str(tmp_path / "e"))],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None
    pid = int(holder.stdout.readline())
    os.kill(pid, 0)  # etcd runs
    holder.kill()
    holder.wait(10)

    def gone() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # a zombie of the init process (it was reparented there) is gone too
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1].startswith("Z")

    deadline = time.monotonic() + 10
    while not gone():
        assert time.monotonic() < deadline, f"etcd {pid} outlived the process that started it"
        time.sleep(0.05)

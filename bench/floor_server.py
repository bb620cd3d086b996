"""The floor of cohortgate's own stack, for bench_scale.py --peers floor: a minimal grpc.aio
server on cohortgate's generated stubs and the same asyncio event loop, with the RPC shape
cohortgate ships (`Join` / `JoinGroup`, server streaming, and `JoinPoll`, unary): it counts
each job's ranks and, once all have joined, answers every call with one FORMED `Verdict`.
No validation, no checks, no history, no metrics, no logs, no progress, no manifest asks:
what is left of a formation when everything cohortgate adds is taken away.

Usage: python bench/floor_server.py --port-file PATH   (writes the port, as `serve` does)
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
from cohortgate.coordinator.codec.groups import size_of


class Floor(pb_grpc.CohortServiceServicer):
    def __init__(self) -> None:
        self.joined: dict[str, int] = {}
        self.formed: dict[str, asyncio.Event] = {}
        self.verdicts: dict[str, pb.JoinEvent] = {}

    async def _verdict(self, job: str, world: int, ranks: int) -> pb.JoinEvent:
        done = self.formed.setdefault(job, asyncio.Event())
        self.joined[job] = self.joined.get(job, 0) + ranks
        if self.joined[job] >= world and not done.is_set():
            self.verdicts[job] = pb.JoinEvent(
                verdict=pb.Verdict(
                    outcome=pb.Verdict.OUTCOME_FORMED,
                    job_id=job,
                    round=1,
                    cohort_id=f"{job}/1",
                    world_size=world,
                    decided_at_unix=time.time(),
                )
            )
            done.set()
        await done.wait()
        return self.verdicts[job]

    async def Join(  # type: ignore[override]
        self, request: pb.JoinRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.JoinEvent]:
        yield await self._verdict(request.job_id, request.world_size, 1)

    async def JoinGroup(  # type: ignore[override]
        self, request: pb.JoinGroupRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.JoinEvent]:
        yield await self._verdict(*_group(request))

    async def JoinPoll(  # type: ignore[override]
        self, request: pb.JoinGroupRequest, context: grpc.aio.ServicerContext
    ) -> pb.JoinEvent:
        return await self._verdict(*_group(request))


def _group(request: pb.JoinGroupRequest) -> tuple[str, int, int]:
    """A group's job, world size and ranks, sent as members or as classes."""
    first = request.members[0] if request.members else request.ranks[0].join
    return first.job_id, first.world_size, size_of(request)


async def serve(port_file: Path) -> None:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_CohortServiceServicer_to_server(Floor(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    port_file.write_text(f"{port}\n0\n")
    await server.wait_for_termination()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port-file", type=Path, required=True)
    parser.add_argument("--listen", default="127.0.0.1:0", help="accepted, as serve's (ignored)")
    args = parser.parse_args()
    asyncio.run(serve(args.port_file))
    return 0


if __name__ == "__main__":
    sys.exit(main())

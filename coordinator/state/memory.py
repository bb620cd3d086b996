"""The live jobs in this process's memory: a `CohortData`, jobs by id, nothing more."""

from __future__ import annotations

from cohortgate.coordinator.state.base import CohortData, Job


class MemoryCohorts(CohortData):
    """Not thread-safe: one event loop owns it."""

    def __init__(self) -> None:
        self._jobs: dict[str, Job] = {}

    def get(self, job_id: str) -> Job | None:
        return self._jobs.get(job_id)

    def put(self, job: Job) -> None:
        self._jobs[job.job_id] = job

    def drop(self, job_id: str) -> None:
        self._jobs.pop(job_id, None)

    def jobs(self) -> list[Job]:
        return list(self._jobs.values())

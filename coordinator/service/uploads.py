"""Uploads the coordinator asked for: manifests and per-tensor digests, checked by the store,
then the cohort decided again (an invalid upload refuses it, and every rank learns why)."""

from __future__ import annotations

import asyncio

import structlog

from cohortgate.coordinator.contract.digests import combine_uploaded
from cohortgate.coordinator.contract.manifest import ManifestLike
from cohortgate.coordinator.decision.cohort import UploadKind
from cohortgate.coordinator.service.deciding import Decider
from cohortgate.coordinator.service.observers import Observer
from cohortgate.coordinator.state.asks import UploadRef
from cohortgate.coordinator.state.base import CohortStore, InvalidUpload

log = structlog.get_logger("cohortgate")

# Digest uploads with more entries are combined in a worker thread (see upload_digests).
INLINE_DIGESTS = 10_000


class Uploads:
    def __init__(self, store: CohortStore, observer: Observer, decider: Decider) -> None:
        self.store, self.observer = store, observer
        self.evaluate = decider.evaluate

    def wants(self, ref: UploadRef, kind: UploadKind, claimed: bytes, size: int) -> bool:
        """Before an upload is decoded: is `ref` a member expected to send it (raises if
        not), and is it still missing?"""
        return self.store.wants_upload(ref, kind, claimed, size)

    def manifest(
        self, ref: UploadRef, manifest: ManifestLike, claimed: bytes, size: int = 0
    ) -> None:
        try:
            cohort = self.store.upload(ref, manifest, claimed, size)
        except InvalidUpload as exc:
            self.observer.uploaded(False, size)
            self.evaluate(exc.cohort)  # every rank learns why, not only the uploader
            raise
        self.observer.uploaded(True, size)
        log.info(
            "manifest uploaded",
            job=ref.job_id,
            round=ref.round,
            rank=ref.rank,
            signature=claimed.hex()[:12],
            entries=len(manifest),
        )
        self.evaluate(cohort)

    async def digests(self, ref: UploadRef, digests: list[bytes]) -> None:
        """Digests combined under their manifest's names (1M SHA-256 updates for a 1M-entry
        model) in a worker thread when many, then checked and kept on the loop."""
        combined = None
        if len(digests) > INLINE_DIGESTS:
            manifest = self.store.digests_manifest(ref, len(digests))
            combined = await asyncio.to_thread(
                lambda: combine_uploaded((e.name for e in manifest.entries), digests)
            )
        try:
            cohort = self.store.upload_digests(ref, digests, combined)
        except InvalidUpload as exc:
            self.evaluate(exc.cohort)
            raise
        log.info("weight digests uploaded", job=ref.job_id, round=ref.round, rank=ref.rank)
        self.evaluate(cohort)

    def files(self, ref: UploadRef, files: list[tuple[str, bytes]]) -> None:
        """A rank's local code files, to name those that differ between ranks."""
        try:
            cohort = self.store.upload_files(ref, files)
        except InvalidUpload as exc:
            self.evaluate(exc.cohort)  # decided without the file names
            raise
        log.info("code files uploaded", job=ref.job_id, round=ref.round, rank=ref.rank)
        self.evaluate(cohort)

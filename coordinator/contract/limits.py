"""Limits on what the network can make the coordinator hold, each checked before allocating."""

from __future__ import annotations

from dataclasses import dataclass

# Rank audits in one AuditRequest: a relay's batch (its node's or rack's ranks, each with the
# audits it had queued). Relays cut their batches at it.
MAX_AUDITS_PER_CALL = 1024


@dataclass(frozen=True)
class Limits:
    # One gRPC message. Every message is copied into Python on the event loop before any
    # handler runs (~10 ms per 4 MiB here), so a large one stalls every job: larger payloads
    # (manifests, digests) travel as a stream of chunks, each a message.
    max_message_bytes: int = 4 * 1024 * 1024
    # One chunked upload in all: 64 MiB carries a manifest of ~2M entries.
    max_upload_bytes: int = 64 * 1024 * 1024
    max_world_size: int = 1 << 20
    max_manifest_entries: int = 1_000_000
    # Waiting cohorts and ranks across all jobs: what a flood of bogus joins can pin down.
    max_cohorts: int = 10_000
    max_waiting_ranks: int = 2_000_000
    # Manifests held while cohorts form (upload bytes; each is kept compressed and dropped
    # at the verdict): per cohort (one per distinct signature) and in all.
    max_cohort_manifest_bytes: int = 256 * 1024 * 1024
    max_manifest_bytes: int = 1024 * 1024 * 1024
    # WatchCohorts streams: each costs a wake-up per change of the jobs it watches.
    max_watchers: int = 1_000
    max_watchers_per_token: int = 100
    # Fields of one fingerprint a join carries (model config, training code, declared facts).
    max_fingerprint_fields: int = 4_096

"""Idempotent job submission: an `Idempotency-Key` header on POST /jobs/finetune, /jobs/finetune/upload (the digest
covers each uploaded file's name and SHA-256) and /jobs/export.

A client that timed out cannot know whether its job was created; it retries with the same key and the same body and
gets the same job back (202, the same id), never a second one. The same key with another body is a 409 naming the
key: a client bug, answered rather than guessed at. Keys live in the store (table idempotency_keys, both backends),
one per route, for TTL_S (24 h, as Stripe's keys, by the database clock); after that the key is free.

Two submissions with one key racing each other (two API processes, a retry while the first is in flight) create
one job: the key row is inserted in the same transaction as the job, and the primary key (route, key) refuses the
second; its job row rolls back with it and it answers with the winner's job. No check-then-insert decides.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from fastapi import Header
from pydantic import BaseModel

from .errors import ApiError
from .schemas import JobInfo
from .store import BaseStore, IdempotencyKey, IdempotencyKeyUsed

HEADER = "Idempotency-Key"
TTL_S = 24 * 3600.0  # how long a key names its job: a client's retries come within minutes, a day is plenty
IdempotencyKeyHeader = Annotated[str | None, Header(
    alias=HEADER, description="a client-chosen key (1-255 printable ASCII characters): a retry with the same key and "
                              "body returns the same job instead of creating another, for 24 hours")]
_VALID = re.compile(r"^[\x21-\x7e]{1,255}$")
T = TypeVar("T")


def body_hash(route: str, body: BaseModel | dict[str, Any]) -> str:
    """A digest of the request as submitted (canonical JSON), so that a retry matches and another body does not."""
    data = body.model_dump(mode="json") if isinstance(body, BaseModel) else body
    text = json.dumps({"route": route, "body": data}, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


class _KeyedStore:
    """The store as one keyed submission sees it: its create_job inserts the key with the job."""

    def __init__(self, store: BaseStore, key: IdempotencyKey):
        self._store, self._key = store, key

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def create_job(self, kind: str, config: dict[str, Any], job_id: str | None = None,
                   register_as: str | None = None) -> dict[str, Any]:
        return self._store.create_job(kind, config, job_id, idempotency=self._key, register_as=register_as)


def _replay(store: BaseStore, key: str, digest: str, job_id: str, held: str) -> JobInfo:
    if held != digest:
        raise ApiError(409, f"{HEADER} {key!r} was already used with another request body (job {job_id}); a retry "
                            f"must send the same body, a new request a new key", "IdempotencyKeyReused")
    job = store.get_job(job_id)
    if job is None:  # the key's job row cascades away with it; a key without one cannot be kept
        raise ApiError(409, f"{HEADER} {key!r} names job {job_id}, which no longer exists", "IdempotencyKeyReused")
    return JobInfo(**job)


def idempotent(store: BaseStore, route: str, key: str | None,
               body: BaseModel | dict[str, Any], submit: Callable[[BaseStore], T]) -> T | JobInfo:
    """Run `submit(store)` (which validates and calls store.create_job once) unless `key` already names a job on
    `route`: then that job, or 409 if it was submitted with another body."""
    if key is None:
        return submit(store)
    if not _VALID.match(key):
        raise ApiError(422, f"{HEADER}: {key[:40]!r} must be 1-255 printable ASCII characters without spaces",
                       "ValidationError")
    digest = body_hash(route, body)
    held = store.idempotent_job(route, key, TTL_S)
    if held is not None:  # a retry: no validation, no new job
        return _replay(store, key, digest, *held)
    try:
        return submit(_KeyedStore(store, IdempotencyKey(route, key, digest, TTL_S)))
    except IdempotencyKeyUsed as e:  # a concurrent submission with this key won
        return _replay(store, key, digest, e.job_id, e.body_hash)

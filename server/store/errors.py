"""What can go wrong opening or using a store, as types the CLI and the worker render (never string-matched)."""

from __future__ import annotations


class StoreError(RuntimeError):
    """The job store cannot be used as configured."""


class StoreUnavailable(StoreError):
    """The database does not answer (at start: after the bounded retries)."""


class DatabaseRefused(StoreError):
    """The database answered and refused the connection for a reason retrying cannot fix (a wrong password, an
    unknown role or database, no pg_hba.conf entry), or its URL is malformed: raised at once, never retried."""


class SchemaTooNew(StoreError):
    """The database was migrated by a newer hfport; this one refuses to write to it."""


class DuplicateWorker(StoreError):
    """Another live worker holds this worker id."""


class MissingDriver(StoreError):
    """A postgresql:// URL without psycopg installed."""


class LeaseLost(StoreError):
    """A write by a job attempt that no longer holds the job's lease (requeued, claimed again, finished, or its
    lease ran out by the database clock): refused, nothing was written. The attempt must stop at once."""


class IdempotencyKeyUsed(StoreError):
    """An Idempotency-Key already names a job (`job_id`) submitted with a body whose hash is `body_hash`."""

    def __init__(self, route: str, key: str, job_id: str, body_hash: str):
        super().__init__(f"Idempotency-Key {key!r} ({route}) already names job {job_id}")
        self.route, self.key, self.job_id, self.body_hash = route, key, job_id, body_hash


class ModelNameTaken(StoreError):
    """A model name that a registered model holds (`job_id` None), or that a queued or running fine-tune (`job_id`)
    will register when it succeeds."""

    def __init__(self, name: str, job_id: str | None):
        if job_id is None:
            message = f"a model named {name!r} exists; DELETE it first, or choose another name"
        else:
            message = (f"{name!r} is the name job {job_id} (queued or running) registers its model under when it "
                       f"succeeds; choose another name, or cancel that job")
        super().__init__(message)
        self.name, self.job_id = name, job_id

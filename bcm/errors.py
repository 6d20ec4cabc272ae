"""One error root for bcm, translated once at each edge (HTTP in bcm.api, one red line in cli).

BcmError                      500  anything bcm raises on purpose
├── InvalidInput              422  bad field value; carries ``field``
├── NotFound                  404  unknown node, category, operation, token ...
├── Unavailable               503  the database cannot answer now; carries ``retry_after``
├── StorageFull               507  the disk is full; nothing was written
├── Conflict                  409  the request clashes with stored state
│   ├── Stale                 409  another request changed the same rows first
│   ├── Duplicate             409  name / MAC / IP already taken
│   ├── IllegalTransition     409  verb not allowed in the node's state
│   └── LockHeld              409  another operation holds the node's lock
├── BadRequest                400  a request bcm will not parse (JSON nested too deep)
├── PayloadTooLarge           413  a body over the configured limit
├── TooManyRequests           429  too many failed authentications from one address; carries ``retry_after``
├── Unauthorized              401  no token or an unknown/revoked one
├── Forbidden                 403  the token's role may not do this
└── DriverError               502  an external system failed (ssh, ansible, slurm, dnsmasq)
    ├── RetryableDriverError  503  worth a bounded retry (timeouts, refused connections)
    └── FatalDriverError      502  retrying will not help (auth failed, changed host key)
"""

from __future__ import annotations


class BcmError(Exception):
    """Root of every error bcm raises on purpose."""

    status_code = 500

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    def to_dict(self) -> dict[str, str]:
        body = {"error": type(self).__name__, "message": self.message}
        if self.field:
            body["field"] = self.field
        return body

    def headers(self) -> dict[str, str]:
        """HTTP headers that go with this error (``Retry-After`` where a retry makes sense)."""
        retry_after = getattr(self, "retry_after", None)
        return {"Retry-After": str(retry_after)} if retry_after is not None else {}


class InvalidInput(BcmError, ValueError):
    """A field value is malformed or out of range (a ValueError too, so pydantic validators report it)."""

    status_code = 422


class NotFound(BcmError):
    """The named object does not exist."""

    status_code = 404


class Conflict(BcmError):
    """The request clashes with stored state."""

    status_code = 409


class Duplicate(Conflict):
    """A unique name, MAC or address is already taken."""


class IllegalTransition(Conflict):
    """The verb is not allowed in the node's current state."""


class LockHeld(Conflict):
    """Another operation holds the node's lock."""


class BadRequest(BcmError):
    """A request bcm refuses to parse at all."""

    status_code = 400


class PayloadTooLarge(BcmError):
    """The request body exceeds the configured limit."""

    status_code = 413


class TooManyRequests(BcmError):
    """Too many failed authentications from one client address."""

    status_code = 429

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Unauthorized(BcmError):
    """No token, or an unknown or revoked token."""

    status_code = 401


class Forbidden(BcmError):
    """The token's role does not allow this."""

    status_code = 403


class DriverError(BcmError):
    """An external system failed."""

    status_code = 502


class RetryableDriverError(DriverError):
    """A failure that a bounded retry may cure (timeout, refused connection)."""

    status_code = 503


class FatalDriverError(DriverError):
    """A failure that retrying will not cure (bad credentials, changed host key)."""


class Unavailable(BcmError):
    """The database (or a part bcm needs) cannot answer now; a retry after ``retry_after`` s may."""

    status_code = 503

    def __init__(self, message: str, *, retry_after: int = 2) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class StorageFull(BcmError):
    """The server's disk is full: the change was not written."""

    status_code = 507


class Stale(Conflict):
    """Another request changed the same rows first (serialization failure, stale row)."""

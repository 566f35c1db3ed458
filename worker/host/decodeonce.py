"""A payload decoded once, even when it fails: the fast path's failure, kept for the slow path.

Decoding an argument unpickles it, and unpickling runs code (``__reduce__``, ``__setstate__``).
When admission (:meth:`~podium.worker.host.admission.CallAdmission.admit`) failed to decode a
payload, the slow path used to decode it again to report the error, so that code ran twice (issue #14).
Now the fast path hands its failure over as a :class:`DecodeFailed`, and the slow path
reports that very error without decoding again.
"""

from __future__ import annotations

__all__ = ["DecodeFailed"]


class DecodeFailed:
    """The error a payload's one decode raised (``error``), in place of its value."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def raise_error(self) -> None:
        """Raise the decode's error again (for the caller's usual error report)."""
        raise self.error

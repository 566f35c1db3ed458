"""Keeping what the controller imported out of the cyclic garbage collector's scans.

A verl controller imports torch (and usually transformers and verl) before ``init()``:
300,000 objects or more, which live as long as the process. CPython's full collection walks
every one of them, about 0.2 s on the 2-core machines Podium targets, and a burst of
``blocking=False`` calls keeps enough new objects alive (a PendingRef and an ObjectRef per
rank) to trigger one every few bursts: a 1,000-call burst then takes several times as long.

So ``init()`` moves everything alive at that moment into the collector's permanent
generation (:func:`gc.freeze`), where it is no longer scanned, and ``shutdown()`` moves it
back (:func:`gc.unfreeze`). Reference counting still frees those objects as usual; only
reference cycles among them wait for ``shutdown()`` to be collected. A process that froze
its heap itself is left alone, and ``PODIUM_GC_FREEZE=0`` turns this off.
"""

from __future__ import annotations

import gc
import os

__all__ = ["freeze", "unfreeze"]


def freeze() -> bool:
    """Freeze the heap as it is now, unless turned off or already managed; True if done."""
    if os.environ.get("PODIUM_GC_FREEZE", "1") == "0" or not gc.isenabled() or gc.get_freeze_count():
        return False
    gc.freeze()
    return True


def unfreeze() -> None:
    """Give the heap frozen by :func:`freeze` back to the collector."""
    gc.unfreeze()

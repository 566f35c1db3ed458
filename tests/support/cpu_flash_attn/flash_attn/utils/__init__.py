"""flash-attn's ``utils`` package in the CPU stand-in: only :mod:`.distributed`."""

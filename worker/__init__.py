"""Podium worker package."""

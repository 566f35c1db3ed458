"""Podium scheduler package."""

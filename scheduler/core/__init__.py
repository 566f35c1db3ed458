"""Podium scheduler/core package."""

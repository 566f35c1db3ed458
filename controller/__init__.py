"""Podium controller package."""

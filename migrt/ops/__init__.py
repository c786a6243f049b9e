"""Orchestration: checkpoint, restore (no argv parsing, no click)."""

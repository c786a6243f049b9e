"""Checkpoint and restore of one container on this node, with its GPU steps (no argv parsing, no click)."""

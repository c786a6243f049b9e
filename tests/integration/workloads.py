"""Shell workloads for busybox containers: the counter, shared with the demo (scripts/lab/workloads.py)."""

from scripts.lab.workloads import COUNTER, parse_ticks

__all__ = ["COUNTER", "parse_ticks"]

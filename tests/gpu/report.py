"""Turn the GPU tests' figures (results.jsonl, one JSON object per test) into a Markdown table.

    python tests/gpu/report.py results.jsonl > results.md
"""

from __future__ import annotations

import json
import sys

COLUMNS = [
    ("test", "test"), ("gb", "GB"), ("processes", "procs"),
    ("gpu_checkpoint_s", "GPU ckpt s"), ("dump_s", "dump s"), ("commit_s", "commit s"),
    ("checkpoint_wall_s", "checkpoint wall s"), ("gpu_resume_s", "GPU resume s"),
    ("verify_s", "verify s"), ("restore_s", "runc restore s"), ("gpu_restore_s", "GPU restore s"),
    ("restore_wall_s", "restore wall s"), ("counting_again_after_s", "counting again after s"),
    ("leave_running_resumed_after_s", "resumed after s"), ("image_bytes", "image GiB"),
    ("checkpoint_total_s", "checkpoint total s"), ("restore_total_s", "restore total s"),
    ("app_hook_s", "hook post-restore s"), ("hook_down_s", "app teardown s"), ("hook_up_s", "app rebuild s"),
    ("refused", "refused"),
    ("pod_downtime_s", "pod downtime s"), ("app_gap_s", "app gap s"), ("side_gap_s", "sidecar gap s"),
]


def cell(key: str, value) -> str:
    if value is None:
        return "-"
    if key == "image_bytes":
        return f"{value / (1 << 30):.2f}"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def render(rows: list[dict]) -> str:
    used = [(k, h) for k, h in COLUMNS if any(r.get(k) is not None for r in rows)]
    lines = ["| " + " | ".join(h for _, h in used) + " |", "|" + "---|" * len(used)]
    for r in rows:
        lines.append("| " + " | ".join(cell(k, r.get(k)) for k, _ in used) + " |")
    meta = sorted({(r.get("gpu"), r.get("driver"), r.get("torch")) for r in rows})
    notes = [f"GPU {g}, driver {d}, torch {t}" for g, d, t in meta]
    return "\n".join(lines + [""] + notes) + "\n"


def main(path: str) -> int:
    with open(path) as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    if not rows:
        print(f"{path}: no results", file=sys.stderr)
        return 1
    sys.stdout.write(render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

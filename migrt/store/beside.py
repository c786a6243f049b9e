"""Manifest fields computed while a commit hashes or syncs the files (`Staging.beside`,
`Import.beside`): work that needs the finished images but should not add to the commit's time, e.g.
the page filler's survey of the images (migrt/pagefill/images.py record_beside). The store does not
know what the fields mean; a function that fails or returns None leaves its field out of the manifest."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Beside:
    def __init__(self) -> None:
        self._jobs: dict[str, tuple[threading.Thread, dict]] = {}

    def start(self, field: str, fn: Callable[[], object]) -> None:
        """Run fn in a thread from now on; its value becomes manifest field `field` at commit."""
        out: dict = {}

        def run() -> None:
            t0 = time.monotonic()
            try:
                out["value"] = fn()
            except Exception:  # noqa: BLE001 - the field is left out; whoever reads it copes without
                out["value"] = None
            out["seconds"] = round(time.monotonic() - t0, 3)

        t = threading.Thread(target=run, name=f"migrt-beside-{field}", daemon=True)
        self._jobs[field] = (t, out)
        t.start()

    def record(self, data: dict) -> None:
        """Wait for every field and write it into the manifest `data` (a field whose value is None is
        removed, so that one inherited from elsewhere does not stay); seconds in data["timings"]."""
        for field, (t, out) in self._jobs.items():
            t.join()
            if out.get("value") is None:
                data.pop(field, None)
            else:
                data[field] = out["value"]
            data.setdefault("timings", {})[f"{field}_s"] = out.get("seconds")

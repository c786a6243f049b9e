"""Read CRIU images with pycriu: process tree, memory, open files. pycriu comes from Debian's
python3-pycriu; when it is missing the caller gets an 'error' field instead of a crash."""

from __future__ import annotations

import os
from typing import Any

PAGE = 4096


def _load(images: str, name: str) -> Any:  # pycriu's decoded entries
    import pycriu

    with open(os.path.join(images, name), "rb") as fh:
        return pycriu.images.load(fh)["entries"]


def inspect_images(images: str) -> dict[str, Any]:
    try:
        import pycriu  # noqa: F401
    except ImportError as exc:
        return {"error": f"pycriu is not importable ({exc}); install python3-pycriu"}
    try:
        tree = _load(images, "pstree.img")
    except Exception as exc:  # noqa: BLE001 - pycriu raises plain Exceptions on bad images
        return {"error": f"pstree.img: {exc}"}
    files = {}
    try:
        for e in _load(images, "files.img"):
            files[e["id"]] = e
    except Exception:  # noqa: BLE001 - pycriu: plain Exceptions; the field is left out
        pass
    procs = []
    for p in tree:
        pid = p["pid"]
        info = {"pid": pid, "ppid": p.get("ppid", 0), "threads": len(p.get("threads", []) or [pid])}
        try:
            core = _load(images, f"core-{pid}.img")[0]
            info["comm"] = core.get("tc", {}).get("comm")
        except Exception:  # noqa: BLE001 - pycriu: plain Exceptions; the field is left out
            pass
        try:
            mm = _load(images, f"mm-{pid}.img")[0]
            info["vma_bytes"] = sum(int(v["end"], 0) - int(v["start"], 0) if isinstance(v["start"], str)
                                    else v["end"] - v["start"] for v in mm.get("vmas", []))
        except Exception:  # noqa: BLE001 - pycriu: plain Exceptions; the field is left out
            pass
        try:
            pm = _load(images, f"pagemap-{pid}.img")
            info["dumped_bytes"] = sum(e.get("nr_pages", 0) for e in pm[1:]) * PAGE
        except Exception:  # noqa: BLE001 - pycriu: plain Exceptions; the field is left out
            pass
        info["files"] = _fds(images, pid, files)
        procs.append(info)
    total = sum(p.get("dumped_bytes", 0) for p in procs)
    return {"processes": procs, "dumped_bytes": total}


def _fds(images: str, pid: int, files: dict[int, Any]) -> list[dict[str, Any]]:
    try:
        ids = _load(images, f"ids-{pid}.img")[0]
        fdinfo = _load(images, f"fdinfo-{ids['files_id']}.img")
    except Exception:  # noqa: BLE001 - pycriu: plain Exceptions; the field is left out
        return []
    out = []
    for fd in fdinfo:
        f = files.get(fd.get("id"), {})
        ftype = str(f.get("type", fd.get("type", "?"))).lower()
        path = ""
        for key in ("reg", "pipe", "unixsk", "isk", "eventfd", "tty"):
            if key in f:
                sub = f[key]
                path = sub.get("name") or (f"pipe:[{sub.get('pipe_id')}]" if key == "pipe" else key)
                break
        out.append({"fd": fd.get("fd"), "type": ftype, "path": path})
    return sorted(out, key=lambda x: x["fd"] if isinstance(x["fd"], int) else 0)

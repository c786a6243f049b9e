"""Finding a container's CUDA processes from /proc and cgroupfs. Standard library only: migrt-runc
decides with this whether a `checkpoint` needs the GPU path at all, and the CRIU hook uses it.

A process of the container is one of the process tree of its init (/proc/<pid>/task/*/children),
plus, when the init has a cgroup of its own, every process of that cgroup and its sub-cgroups.
A CUDA process maps libcuda; a live one (not yet checkpointed by the driver) also holds a
/dev/nvidia* file descriptor. After the driver's checkpoint a process holds no GPU file at all,
which is what lets CRIU dump it.
"""

from __future__ import annotations

import os

from migrt import jsonsafe, names


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return None


def alive(pid: int) -> bool:
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (clock ticks after boot): with the pid, names one process for good."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    fields = stat.rpartition(")")[2].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def ppid(pid: int) -> int | None:
    stat = _read(f"/proc/{pid}/stat")
    try:
        return int(stat.rpartition(")")[2].split()[1]) if stat else None
    except (IndexError, ValueError):
        return None


def nspids(pid: int) -> list[int]:
    """NSpid of /proc/PID/status: the pid at each pid-namespace level, the host's first."""
    for line in (_read(f"/proc/{pid}/status") or "").splitlines():
        if line.startswith("NSpid:"):
            try:
                return [int(x) for x in line.split()[1:]]
            except ValueError:
                return []
    return []


def ns_pid(pid: int) -> int | None:
    """The pid as the process's own (innermost) pid namespace sees it."""
    levels = nspids(pid)
    return levels[-1] if levels else None


def comm(pid: int) -> str:
    return (_read(f"/proc/{pid}/comm") or "?").strip()


def children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        text = _read(f"/proc/{pid}/task/{tid}/children")
        if text is None:
            return _children_by_scan(pid)  # kernel without CONFIG_PROC_CHILDREN
        out.extend(int(x) for x in text.split())
    return out


def _children_by_scan(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _read(f"/proc/{entry}/stat")
            if stat:
                fields = stat.rpartition(")")[2].split()
                if len(fields) > 1 and fields[1] == str(pid):
                    out.append(int(entry))
    return out


def process_tree(root: int) -> list[int]:
    """root and all its descendants, parents before children."""
    seen, order, todo = set(), [], [root]
    while todo:
        pid = todo.pop(0)
        if pid in seen or not os.path.exists(f"/proc/{pid}"):
            continue
        seen.add(pid)
        order.append(pid)
        todo.extend(children(pid))
    return order


def _cgroup_mounts() -> tuple[str | None, dict[str, str]]:
    """(cgroup2 mount point, {v1 controller: mount point}) from our mountinfo."""
    v2: str | None = None
    v1: dict[str, str] = {}
    for line in (_read("/proc/self/mountinfo") or "").splitlines():
        pre, _, post = line.partition(" - ")
        fields, post_fields = pre.split(), post.split()
        if len(fields) < 5 or len(post_fields) < 3:
            continue
        fstype, options = post_fields[0], post_fields[2]
        if fstype == "cgroup2" and v2 is None:
            v2 = fields[4]
        elif fstype == "cgroup":
            for opt in options.split(","):
                v1.setdefault(opt, fields[4])
    return v2, v1


def cgroup_dir(pid: int) -> str | None:
    """The cgroup directory of pid: its cgroup v2 one (unified or hybrid), else v1 'pids' or 'memory'.
    None when it is the root cgroup or cannot be found."""
    text = _read(f"/proc/{pid}/cgroup")
    if not text:
        return None
    v2_mount, v1_mounts = _cgroup_mounts()
    v1 = {}
    for line in text.splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "":
            if v2_mount and path not in ("", "/"):
                d = os.path.join(v2_mount, path.lstrip("/"))
                if os.path.isfile(os.path.join(d, "cgroup.procs")):
                    return d
            continue
        for c in controllers.split(","):
            v1[c] = path
    for c in ("pids", "memory"):
        if v1.get(c) not in (None, "", "/") and c in v1_mounts:
            d = os.path.join(v1_mounts[c], v1[c].lstrip("/"))
            if os.path.isfile(os.path.join(d, "cgroup.procs")):
                return d
    return None


def cgroup_pids(directory: str) -> list[int]:
    out: list[int] = []
    for dirpath, _, files in os.walk(directory):
        if "cgroup.procs" in files:
            out.extend(int(x) for x in (_read(os.path.join(dirpath, "cgroup.procs")) or "").split())
    return out


def container_pids(init_pid: int, cgroup: str | None = None) -> list[int]:
    """Every process of the container whose init is init_pid: its tree, plus the processes of its
    cgroup (given, e.g. from runc's state, or found) and sub-cgroups, unless that is migrt's own."""
    pids = process_tree(init_pid)
    own = cgroup or cgroup_dir(init_pid)
    if own and own != cgroup_dir(os.getpid()):  # never sweep up migrt's own (or the root) cgroup
        known = set(pids)
        pids += [p for p in cgroup_pids(own) if p not in known and os.path.exists(f"/proc/{p}")]
    return pids


def maps_libcuda(pid: int) -> bool:
    maps = _read(f"/proc/{pid}/maps")
    return maps is not None and "libcuda.so" in maps


def holds_nvidia_fd(pid: int) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/dev/nvidia"):
                return True
        except OSError:
            continue
    return False


def cuda_pids(pids: list[int], *, live: bool = True) -> list[int]:
    """Those of pids that are CUDA processes. live: holding the GPU now (for a checkpoint);
    otherwise any process mapping libcuda (after a restore, before the GPU restore)."""
    if os.environ.get("MIGRT_FAKE_GPU"):  # a simulated node (tests): migrt/gpu/fakenode.py
        from migrt.gpu import fakenode

        return fakenode.cuda_pids(pids, live=live)
    return [p for p in pids if maps_libcuda(p) and (not live or holds_nvidia_fd(p))]


def runc_state(root: str, container_id: str) -> dict | None:
    """runc's own state file (<root>/<id>/state.json): init_process_pid without running runc."""
    if not names.is_container_id(container_id):
        return None
    text = _read(os.path.join(root, container_id, "state.json"))
    try:
        data = jsonsafe.loads(text) if text else None
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def runc_container_pids(root: str, container_id: str) -> list[int]:
    """Every process of a runc container, from runc's state file (empty when it is not running)."""
    state = runc_state(root, container_id) or {}
    pid = state.get("init_process_pid")
    if not isinstance(pid, int) or pid <= 0 or not alive(pid):
        return []
    paths = state.get("cgroup_paths") or {}
    cgroup = paths.get("") or paths.get("pids") if isinstance(paths, dict) else None
    return container_pids(pid, cgroup if isinstance(cgroup, str) and os.path.isdir(cgroup) else None)


def container_cuda_pids(root: str, container_id: str) -> list[int]:
    """The live CUDA processes of a runc container (empty when it has none or is not running)."""
    return cuda_pids(runc_container_pids(root, container_id))


def runc_vpid_map(root: str, container_id: str) -> dict[int, int]:
    """pid inside the container's pid namespace (the key of CRIU's images) -> host pid, for every
    process of a runc container (the level of the container's init, so nested namespaces map right)."""
    init = (runc_state(root, container_id) or {}).get("init_process_pid")
    level = len(nspids(init)) - 1 if isinstance(init, int) else -1
    out = {}
    for pid in runc_container_pids(root, container_id):
        ns = nspids(pid)
        if ns and 0 <= level < len(ns):
            out[ns[level]] = pid
    return out

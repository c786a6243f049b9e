"""A restore through migrt's page filler on containerd's CRI path: kubelet (our CRI client) ->
containerd CRI -> containerd-shim-runc-v2 -> `migrt-runc create` with MIGRT_RESTORE -> runc restore
--lazy-pages, with the memory copied by migrt's filler under its guard.

The pod's process holds 96 MiB of random data and rehashes it at every tick (hashticker.c). The
session's config lowers `fill_min_mib` to 64 for this test only, so `restore_pages: auto` (the
default) picks the filler as it would for a big container on a real node. The guard and the filler
outlive `migrt-runc create`: they run in their own session, are reparented to the shim (the pod's
subreaper) and must be gone, reaped, with their run directory, once the memory is in; the restored
container must then stop and go away like any other.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import threading
import time
import uuid

import pytest

from tests.helpers.cri import read_cri_log
from tests.integration.conftest import run_cli
from tests.integration.workloads import parse_ticks

pytestmark = pytest.mark.integration
HERE = os.path.dirname(os.path.abspath(__file__))
DATA_MIB = 96
FILL_MIN_MIB = 64  # below DATA_MIB, far above the memory of the other tests' containers
BIN_DEST = "/opt/migrt-test"  # where the workload's directory is mounted in both pods
FILL_RUN_BASE = "/run/migrt/fill"  # migrt/pagefill/session.py RUN_BASE
EXIT_ON_SIGTERM = 7  # hashticker.c


@pytest.fixture(scope="module")
def ticker_dir(tmp_path_factory) -> str:
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.fail("gcc is needed to build the test workload (it is installed on CI)")
    d = tmp_path_factory.mktemp("hashticker")
    subprocess.run([gcc, "-static", "-O2", "-o", str(d / "hashticker"), os.path.join(HERE, "hashticker.c")],
                   check=True)
    return str(d)


@pytest.fixture
def fill_min_mib(migrt_config):
    """The session's migrt config (read by every migrt-runc call) with fill_min_mib lowered, for this
    test only; replaced atomically both ways (containerd may call migrt-runc at any time)."""
    path = migrt_config["config"]
    with open(path) as fh:
        original = fh.read()
    assert "fill_min_mib" not in original and "restore_pages" not in original, original

    def write(text: str) -> None:
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)

    write(original + f"fill_min_mib: {FILL_MIN_MIB}\n")
    try:
        yield FILL_MIN_MIB
    finally:
        write(original)


def _wait_ticks(cri, cid: str, pred, timeout: float = 60) -> list:
    path = cri.status(cid).log_path
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ticks = parse_ticks(read_cri_log(path))
        if pred(ticks):
            return ticks
        time.sleep(0.1)
    raise AssertionError(f"ticks not as expected in {path}: {read_cri_log(path)[-2000:]!r}; "
                         f"container {cri.state_name(cid)}")


def _cmdline(pid: int) -> list[bytes]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().split(b"\0")
    except OSError:
        return []


def _guard_procs(cid: str) -> dict[int, dict]:
    """The page filler's processes for container cid (the guard and the filler it forked share its
    command line: python -m migrt.pagefill.guard '<json args>'): pid -> args."""
    out = {}
    for ent in os.listdir("/proc"):
        if not ent.isdigit():
            continue
        argv = _cmdline(int(ent))
        if len(argv) >= 4 and argv[1:3] == [b"-m", b"migrt.pagefill.guard"]:
            try:
                args = json.loads(argv[3])
            except ValueError:
                continue
            if args.get("container_id") == cid:
                out[int(ent)] = args
    return out


class FillWatch(threading.Thread):
    """Records, while StartContainer restores and until stopped, every page-filler process of a
    container: pid -> its run directory."""

    def __init__(self, cid: str) -> None:
        super().__init__(daemon=True)
        self.cid = cid
        self.seen: dict[int, str] = {}
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            for pid, args in _guard_procs(self.cid).items():
                self.seen.setdefault(pid, args.get("run_dir") or "")
            self.halt.wait(0.02)

    def stop(self) -> None:
        self.halt.set()
        self.join(10)


def _proc_state(pid: int) -> str | None:
    """'R', 'S', 'Z' (a zombie nobody reaped)...; None once the pid is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _wait_gone(pids, dirs, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(_proc_state(p) is None for p in pids) and not any(os.path.exists(d) for d in dirs):
            return
        time.sleep(0.1)
    left = {p: _proc_state(p) for p in pids if _proc_state(p) is not None}
    raise AssertionError(f"after {timeout:.0f} s the page filler's processes (pid: state) {left} and run "
                         f"directories {[d for d in dirs if os.path.exists(d)]} are still there")


def _log_events(path: str, event: str, key: str, value: str) -> list[dict]:
    out = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("event") == event and rec.get(key) == value:
                out.append(rec)
    return out


def _fill_dirs() -> set[str]:
    return set(glob.glob(os.path.join(FILL_RUN_BASE, "f-*")))


def _cgroup_dirs(pid: int) -> list[str]:
    """The cgroup directories of a process, in every hierarchy mounted under /sys/fs/cgroup."""
    out = []
    with open(f"/proc/{pid}/cgroup") as fh:
        for line in fh:
            _hid, ctrls, path = line.rstrip("\n").split(":", 2)
            if path == "/":
                continue
            name = ctrls.split(",")[0].removeprefix("name=") if ctrls else "unified"
            for base in (f"/sys/fs/cgroup/{name}", "/sys/fs/cgroup") if not ctrls else (f"/sys/fs/cgroup/{name}",):
                if os.path.isdir(base + path):
                    out.append(base + path)
                    break
    return out


def _shim_pids(sandbox_id: str) -> list[int]:
    """containerd-shim-runc-v2 processes serving that pod (started with -id <sandbox id>)."""
    out = []
    for ent in os.listdir("/proc"):
        if ent.isdigit():
            argv = _cmdline(int(ent))
            if argv and b"containerd-shim" in argv[0] and sandbox_id.encode() in argv:
                out.append(int(ent))
    return out


def test_restore_through_the_page_filler_into_new_pod(cri, cri_containerd, migrt_config, fill_min_mib, ticker_dir,
                                                      tmp_path):
    image = cri_containerd.image
    command = [f"{BIN_DEST}/hashticker", str(DATA_MIB)]
    name = f"cri-fill-{uuid.uuid4().hex[:6]}"

    # -- pod A: the workload, checkpointed (stopped) with `migrt checkpoint`, then deleted ----------
    pod_a = cri.run_pod("hashticker", "team-a")
    src = cri.create_container(pod_a, "app", image, command, mounts=[(ticker_dir, BIN_DEST)])
    cri.start(src)
    _wait_ticks(cri, src, lambda t: len(t) >= 3)
    run_cli("checkpoint", src, "--name", name)
    try:
        cri.wait_state(src, "CONTAINER_EXITED")
        before = parse_ticks(read_cri_log(cri.status(src).log_path))
        last = before[-1]
        assert last[1] == last[2], before  # the data was intact when it was dumped
        cri.delete_pod(pod_a)

        # -- pod B: a new sandbox whose container asks for the checkpoint --------------------------
        dirs_before = _fill_dirs()
        pod_b = cri.run_pod("hashticker-restored", "team-a")
        cid = cri.create_container(pod_b, "app", image, command, env={"MIGRT_RESTORE": name},
                                   mounts=[(ticker_dir, BIN_DEST)])
        watch = FillWatch(cid)
        watch.start()
        try:
            t0 = time.monotonic()
            cri.start(cid)  # containerd creates the task here: migrt-runc create -> restore
            start_s = time.monotonic() - t0
            cri.wait_state(cid, "CONTAINER_RUNNING")

            # the restore went through the filler, chosen by `auto`
            restored = _log_events(migrt_config["log"], "restored", "container_id", cid)
            assert len(restored) == 1, restored
            pages = restored[0]["pages"]
            assert pages["mode"] == "lazy" and pages["requested"] == "auto", pages
            assert pages["lazy_bytes"] >= DATA_MIB << 20 and pages["threads"] >= 2, pages
            assert f"fill_min_mib ({fill_min_mib})" in pages["reason"], pages
            markers = glob.glob(f"/run/containerd/runc/*/{cid}/migrt-restored")
            assert len(markers) == 1, markers  # in the shim's runc state directory
            with open(markers[0]) as fh:
                marker = json.load(fh)
            assert marker["checkpoint"] == name and marker["pages"] == "lazy", marker

            # the process resumed at its next tick, its 96 MiB bit-identical (every tick rehashes all)
            after = _wait_ticks(cri, cid, lambda t: len(t) >= 3)
            assert after[0][0] == last[0] + 1, f"first tick after the restore {after[0]}, last before {last}"
            assert all(t[1] == last[1] and t[2] == last[1] for t in after), (after, last)
            cgroups = _cgroup_dirs(marker["pid"])  # the restored init's (host pid)
            assert cgroups, f"no cgroup of the restored init {marker['pid']}"

            # the guard and its filler were there, and are gone once the memory is in: exited and
            # reaped (by the shim, their subreaper once migrt-runc exited), run directory removed
            seen = dict(watch.seen)
            assert seen, "no page-filler process seen during StartContainer (the watch missed it?)"
            run_dirs = sorted(set(seen.values()))
            assert len(run_dirs) == 1 and run_dirs[0].startswith(FILL_RUN_BASE + "/f-"), seen
            _wait_gone(list(seen), run_dirs)
        finally:
            watch.stop()
        assert not _guard_procs(cid)
        assert _fill_dirs() <= dirs_before, _fill_dirs() - dirs_before
        assert not _log_events(migrt_config["log"], "page_fill_failed", "container", cid)

        # -- stop, remove: containerd sees the restored init exit, not the guard's --------------------
        shims = _shim_pids(pod_b)
        assert shims, f"no shim serves pod {pod_b}"
        assert read_cri_log(cri.status(cid).log_path).count("\n") >= len(after)
        t0 = time.monotonic()
        cri.stop(cid, timeout=20)  # SIGTERM: the workload's handler exits 7 at once
        stop_s = time.monotonic() - t0
        st = cri.wait_state(cid, "CONTAINER_EXITED")
        assert st.exit_code == EXIT_ON_SIGTERM, (st.exit_code, st.reason, st.message)
        assert stop_s < 10, f"StopContainer took {stop_s:.1f} s (SIGTERM should end it at once)"
        log = read_cri_log(st.log_path)
        assert f"term {parse_ticks(log)[-1][0]}" in log, log[-500:]
        cri.remove(cid)
        assert cid not in [c.id for c in cri.list_containers()]
        assert not glob.glob(f"/run/containerd/runc/*/{cid}")  # runc's state (and the marker) deleted
        for d in cgroups:
            assert not os.path.exists(d) or not open(os.path.join(d, "cgroup.procs")).read().strip(), d
        cri.delete_pod(pod_b)
        assert pod_b not in [p.id for p in cri.list_pods()]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_proc_state(p) for p in shims):
            time.sleep(0.1)
        assert not [p for p in shims if _proc_state(p)], f"pod {pod_b}'s shim {shims} did not exit"
        print(f"StartContainer (restore) {start_s:.2f} s, StopContainer {stop_s:.2f} s")
    finally:
        run_cli("rm", name, check=False)

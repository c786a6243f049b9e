"""A restore through migrt's page filler on containerd's CRI path: kubelet (our CRI client) ->
containerd CRI -> containerd-shim-runc-v2 -> `migrt-runc create` with MIGRT_RESTORE -> runc restore
--lazy-pages, with the memory copied by migrt's filler under its guard.

The session's config lowers `fill_min_mib` to 64 for these tests only, so `restore_pages: auto`
(the default) picks the filler for 96 MiB as it would for a big container on a real node. The guard
and the filler outlive `migrt-runc create`: they run in their own session, are reparented to the
pod's shim (its subreaper) and must be gone, reaped, with their run directory, once the memory is in;
the restored container must stop and go away like any other.

- The production set-up: the pod's process holds 96 MiB of random data and rehashes it at every
  tick (hashticker.c); on the test machine the fill ends within `create` (0.05 s for 96 MiB).
- A containerd whose shims carry the test seam MIGRT_FILL_PACE_MIBS (16 MiB/s): the pod runs while
  its memory arrives (memhog, which touches its data only on SIGUSR1), its guard adopted by the shim;
  memory faulted in during the fill hashes as before the checkpoint; a StopContainer in the middle of
  the fill ends the container, the filler and the guard cleanly; a checkpoint taken in the middle of
  the fill (`migrt checkpoint`, CRI CheckpointContainer) waits for it and holds all the memory.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import tarfile
import threading
import time
import uuid
from dataclasses import dataclass

import pytest

from tests.helpers.cri import CriContainerd, read_cri_log
from tests.integration.conftest import run_cli
from tests.integration.conftest_cri import new_client, running_containerd
from tests.integration.workloads import parse_ticks

pytestmark = pytest.mark.integration
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
DATA_MIB = 96
FILL_MIN_MIB = 64  # below DATA_MIB, far above the memory of the other tests' containers
BIN_DEST = "/opt/migrt-test"  # where the workload's directory is mounted in both pods
FILL_RUN_BASE = "/run/migrt/fill"  # migrt/pagefill/session.py RUN_BASE
EXIT_ON_SIGTERM = 7  # hashticker.c


@pytest.fixture(scope="module")
def bin_dir(tmp_path_factory) -> str:
    """hashticker and memhog (bench/memhog.c), static, in a directory both pods mount at BIN_DEST."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.fail("gcc is needed to build the test workloads (it is installed on CI)")
    d = tmp_path_factory.mktemp("fillbin")
    for name, src in (("hashticker", os.path.join(HERE, "hashticker.c")),
                      ("memhog", os.path.join(REPO, "bench", "memhog.c"))):
        subprocess.run([gcc, "-static", "-O2", "-o", str(d / name), src], check=True)
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
    container (pid -> its run directory, the parent pids it had) and the last status it wrote."""

    def __init__(self, cid: str) -> None:
        super().__init__(daemon=True)
        self.cid = cid
        self.seen: dict[int, str] = {}
        self.ppids: dict[int, set[int]] = {}
        self.status: dict = {}
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            for pid, args in _guard_procs(self.cid).items():
                run_dir = self.seen.setdefault(pid, args.get("run_dir") or "")
                ppid = _ppid(pid)
                if ppid:
                    self.ppids.setdefault(pid, set()).add(ppid)
                st = _read_json(os.path.join(run_dir, "status.json"))
                if st:
                    self.status = st
            self.halt.wait(0.02)

    def guard(self) -> int:
        """The guard's pid: the one whose parent is not a page-filler process (the filler's is the guard)."""
        guards = [p for p, parents in self.ppids.items() if not parents & set(self.seen)]
        assert len(guards) == 1, (self.seen, self.ppids)
        return guards[0]

    def stop(self) -> None:
        self.halt.set()
        self.join(10)


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return {}


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


def _container_cgroups(cid: str) -> list[str]:
    """The cgroup directories of a running restored container (its init's, from migrt's marker)."""
    markers = glob.glob(f"/run/containerd/runc/*/{cid}/migrt-restored")
    assert len(markers) == 1, markers
    dirs = _cgroup_dirs(_read_json(markers[0])["pid"])
    assert dirs, f"no cgroup for container {cid}"
    return dirs


def _remove_and_delete_pod(cri, pod: str, cid: str, cgroups: list[str]) -> None:
    """RemoveContainer of the exited container, then its pod: runc's state (with migrt's marker) and
    the container's cgroups are gone, and the pod's shim exits."""
    shims = _shim_pids(pod)
    assert shims, f"no shim serves pod {pod}"
    cri.remove(cid)
    assert cid not in [c.id for c in cri.list_containers()]
    assert not glob.glob(f"/run/containerd/runc/*/{cid}")
    left = [d for d in cgroups if os.path.exists(d)]
    assert not left, left
    cri.delete_pod(pod)
    assert pod not in [p.id for p in cri.list_pods()]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_proc_state(p) for p in shims):
        time.sleep(0.1)
    assert not [p for p in shims if _proc_state(p)], f"pod {pod}'s shim {shims} did not exit"


def test_restore_through_the_page_filler_into_new_pod(cri, cri_containerd, migrt_config, fill_min_mib, bin_dir,
                                                      tmp_path):
    image = cri_containerd.image
    command = [f"{BIN_DEST}/hashticker", str(DATA_MIB)]
    name = f"cri-fill-{uuid.uuid4().hex[:6]}"

    # -- pod A: the workload, checkpointed (stopped) with `migrt checkpoint`, then deleted ----------
    pod_a = cri.run_pod("hashticker", "team-a")
    src = cri.create_container(pod_a, "app", image, command, mounts=[(bin_dir, BIN_DEST)])
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
        pod_b = cri.run_pod("hashticker-restored", "team-a")
        cid = cri.create_container(pod_b, "app", image, command, env={"MIGRT_RESTORE": name},
                                   mounts=[(bin_dir, BIN_DEST)])
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
            cgroups = _container_cgroups(cid)

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
        assert not _log_events(migrt_config["log"], "page_fill_failed", "container", cid)

        # -- stop, remove: containerd sees the restored init exit, not the guard's --------------------
        t0 = time.monotonic()
        cri.stop(cid, timeout=20)  # SIGTERM: the workload's handler exits 7 at once
        stop_s = time.monotonic() - t0
        st = cri.wait_state(cid, "CONTAINER_EXITED")
        assert st.exit_code == EXIT_ON_SIGTERM, (st.exit_code, st.reason, st.message)
        assert stop_s < 10, f"StopContainer took {stop_s:.1f} s (SIGTERM should end it at once)"
        log = read_cri_log(st.log_path)
        assert f"term {parse_ticks(log)[-1][0]}" in log, log[-500:]
        _remove_and_delete_pod(cri, pod_b, cid, cgroups)
        print(f"StartContainer (restore) {start_s:.2f} s, StopContainer {stop_s:.2f} s")
    finally:
        run_cli("rm", name, check=False)


# -- memory still arriving while the pod runs: a containerd whose shims pace the filler ---------------

PACE_MIBS = 16  # the filler's background copy in the paced containerd: 96 MiB take 6 s unless touched


class _PacedContainerd(CriContainerd):
    """A CRI containerd whose shims, and so migrt-runc and the page filler, run with the test seam
    MIGRT_FILL_PACE_MIBS (environment: the only way a seam reaches migrt-runc under containerd)."""

    def env(self) -> dict:
        return {**super().env(), "MIGRT_FILL_PACE_MIBS": str(PACE_MIBS)}


@pytest.fixture(scope="module")
def paced_containerd(cri_containerd, cri_stubs, tmp_path_factory):
    """Beside cri_containerd (same version, its own network namespace, root and pods)."""
    base = tmp_path_factory.mktemp(f"cri-paced-{cri_containerd.version}")
    with running_containerd(lambda root, net: _PacedContainerd(root, net, version=cri_containerd.version), base,
                            cri_stubs) as ctd:
        yield ctd


@pytest.fixture
def paced(paced_containerd, cri_stubs, tmp_path):
    client = new_client(paced_containerd, cri_stubs, str(tmp_path / "kubelet"))
    try:
        yield client
    finally:
        client.cleanup()
        client.close()


@dataclass
class MemhogCheckpoint:
    name: str
    ready: str  # memhog's hash of its data, printed once at its start
    last_tick: int


def _memhog(text: str) -> tuple[str | None, list[int], list[str]]:
    """(ready hash, tick numbers, sum hashes) from memhog's output."""
    ready, ticks, sums = None, [], []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "ready":
            ready = parts[1]
        elif len(parts) == 3 and parts[0] == "tick" and parts[1].isdigit():
            ticks.append(int(parts[1]))
        elif len(parts) == 2 and parts[0] == "sum":
            sums.append(parts[1])
    return ready, ticks, sums


def _wait_output(cri, cid: str, pred, timeout: float = 60) -> tuple:
    path = cri.status(cid).log_path
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = _memhog(read_cri_log(path))
        if pred(*out):
            return out
        time.sleep(0.1)
    raise AssertionError(f"memhog's output not as expected in {path}: {read_cri_log(path)[-1000:]!r}; "
                         f"container {cri.state_name(cid)}")


@pytest.fixture(scope="module")
def memhog_checkpoint(paced_containerd, cri_stubs, bin_dir, tmp_path_factory) -> MemhogCheckpoint:
    """memhog (96 MiB that it touches only on SIGUSR1) checkpointed in pod team-a/memhog, then deleted."""
    client = new_client(paced_containerd, cri_stubs, str(tmp_path_factory.mktemp("memhog") / "kubelet"))
    name = f"cri-fill-memhog-{uuid.uuid4().hex[:6]}"
    try:
        pod = client.run_pod("memhog", "team-a")
        cid = client.create_container(pod, "app", paced_containerd.image, [f"{BIN_DEST}/memhog", str(DATA_MIB)],
                                      mounts=[(bin_dir, BIN_DEST)])
        client.start(cid)
        _wait_output(client, cid, lambda ready, ticks, _s: ready and len(ticks) >= 10)
        run_cli("checkpoint", cid, "--name", name)
        client.wait_state(cid, "CONTAINER_EXITED")
        ready, ticks, _sums = _memhog(read_cri_log(client.status(cid).log_path))
        client.delete_pod(pod)
        yield MemhogCheckpoint(name, ready, ticks[-1])
    finally:
        client.cleanup()
        client.close()
        run_cli("rm", name, check=False)


@dataclass
class PacedRestore:
    pod: str
    cid: str
    watch: FillWatch
    run_dir: str  # the fill's run directory (/run/migrt/fill/f-*)
    cgroups: list[str]  # the container's cgroup directories


def _restore_paced(cri, ctd, ckpt: MemhogCheckpoint, bin_dir: str, pod_name: str, migrt_config: dict) -> PacedRestore:
    """A new pod asking for the memhog checkpoint, started; returns once the guard has outlived
    migrt-runc create and been adopted by the pod's shim (its subreaper)."""
    pod = cri.run_pod(pod_name, "team-a")
    cid = cri.create_container(pod, "app", ctd.image, [f"{BIN_DEST}/memhog", str(DATA_MIB)],
                               env={"MIGRT_RESTORE": ckpt.name}, mounts=[(bin_dir, BIN_DEST)])
    watch = FillWatch(cid)
    watch.start()
    cri.start(cid)
    cri.wait_state(cid, "CONTAINER_RUNNING")
    restored = _log_events(migrt_config["log"], "restored", "container_id", cid)
    assert len(restored) == 1 and restored[0]["pages"]["mode"] == "lazy", restored
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(watch.ppids) < 2:
        time.sleep(0.02)
    guard = watch.guard()
    shims = _shim_pids(pod)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _ppid(guard) not in shims:
        time.sleep(0.02)
    parent = _ppid(guard)
    assert parent in shims, f"the guard's parent is {parent} ({_comm(parent)}), not the pod's shim {shims}"
    return PacedRestore(pod, cid, watch, watch.seen[guard], _container_cgroups(cid))


def _comm(pid: int | None) -> str:
    try:
        with open(f"/proc/{pid}/comm") as fh:
            return fh.read().strip()
    except OSError:
        return "?"


def _still_filling(run_dir: str) -> dict:
    st = _read_json(os.path.join(run_dir, "status.json"))
    assert st.get("state") == "filling" and 0 < st["lazy_bytes"] - st["copied_bytes"], st
    return st


def test_memory_arriving_while_the_pod_runs(paced, paced_containerd, migrt_config, fill_min_mib, bin_dir,
                                           memhog_checkpoint):
    """The pod runs on memory still arriving (paced fill), its guard adopted by the pod's shim; kubelet
    execs into it; memhog hashes its 96 MiB (faulting in what the fill has not copied yet): the hash
    from before the checkpoint."""
    ckpt = memhog_checkpoint
    r = _restore_paced(paced, paced_containerd, ckpt, bin_dir, "memhog-fill", migrt_config)
    try:
        _still_filling(r.run_dir)
        _ready, ticks, _sums = _wait_output(paced, r.cid, lambda _r, ticks, _s: len(ticks) >= 20)
        assert ticks[0] == ckpt.last_tick + 1, f"first tick after the restore {ticks[0]}, last before {ckpt.last_tick}"
        _still_filling(r.run_dir)  # memhog ticks without touching its data: the background copy is paced
        code, out, err = paced.exec_sync(r.cid, ["kill", "-USR1", "1"])  # hash it all now
        assert code == 0, (out, err)
        _ready, _ticks, sums = _wait_output(paced, r.cid, lambda _r, _t, sums: sums)
        assert sums == [ckpt.ready], (sums, ckpt.ready)
        _wait_gone(list(r.watch.seen), [r.run_dir], timeout=30)
    finally:
        r.watch.stop()
    assert not _log_events(migrt_config["log"], "page_fill_failed", "container", r.cid)
    paced.stop(r.cid, timeout=1)  # memhog, pid 1 without a SIGTERM handler, ignores it: SIGKILL after 1 s
    st = paced.wait_state(r.cid, "CONTAINER_EXITED")
    assert st.exit_code == 137, (st.exit_code, st.reason, st.message)
    _remove_and_delete_pod(paced, r.pod, r.cid, r.cgroups)


def test_pod_stopped_while_its_memory_is_arriving(paced, paced_containerd, migrt_config, fill_min_mib, bin_dir,
                                                 memhog_checkpoint):
    """StopContainer while most of the memory is still to come: the container exits (containerd is
    not confused by the guard, a child of its shim), the filler and the guard end without reporting a
    failure, and nothing is left."""
    r = _restore_paced(paced, paced_containerd, memhog_checkpoint, bin_dir, "memhog-stop", migrt_config)
    try:
        _still_filling(r.run_dir)
        t0 = time.monotonic()
        paced.stop(r.cid, timeout=1)  # SIGTERM ignored (see above), SIGKILL after 1 s
        st = paced.wait_state(r.cid, "CONTAINER_EXITED")
        assert st.exit_code == 137, (st.exit_code, st.reason, st.message)
        assert time.monotonic() - t0 < 10
        _wait_gone(list(r.watch.seen), [r.run_dir], timeout=30)
    finally:
        r.watch.stop()
    last = r.watch.status
    assert last.get("state") != "failed" and last["copied_bytes"] < last["lazy_bytes"], last
    # a filler failure would be in migrt's log (the bundle, with runc's log, is gone: containerd
    # deleted the task when it exited)
    assert not _log_events(migrt_config["log"], "page_fill_failed", "container", r.cid)
    assert not os.path.exists(paced_containerd.bundle(r.cid))
    _remove_and_delete_pod(paced, r.pod, r.cid, r.cgroups)


# -- a checkpoint of a container whose memory is still arriving ----------------------------------------
# CRIU dumps the pages pagemap shows present: before the fix, a checkpoint taken mid-fill held only what
# the filler had copied so far, and its restore read zeros elsewhere (memhog's hash differed, silently).

def test_checkpoint_waits_for_memory_still_arriving(paced, paced_containerd, migrt_config, fill_min_mib, bin_dir,
                                                    memhog_checkpoint):
    """`migrt checkpoint` of a container restored lazily, while most of its memory is still to come,
    waits for the fill; the new checkpoint restores with the memory memhog had at the first one."""
    ckpt = memhog_checkpoint
    r = _restore_paced(paced, paced_containerd, ckpt, bin_dir, "memhog-again", migrt_config)
    name = f"cri-fill-again-{uuid.uuid4().hex[:6]}"
    try:
        try:
            _still_filling(r.run_dir)
            data = json.loads(run_cli("checkpoint", r.cid, "--name", name, "--json").stdout)
            assert data["timings"].get("memory_wait_s", 0) > 1, data["timings"]  # 16 MiB/s: seconds to go
        finally:
            r.watch.stop()
        paced.wait_state(r.cid, "CONTAINER_EXITED")
        _ready, ticks, _sums = _memhog(read_cri_log(paced.status(r.cid).log_path))
        again = MemhogCheckpoint(name, ckpt.ready, ticks[-1])
        r2 = _restore_paced(paced, paced_containerd, again, bin_dir, "memhog-again-restored", migrt_config)
        r2.watch.stop()
        code, out, err = paced.exec_sync(r2.cid, ["kill", "-USR1", "1"])
        assert code == 0, (out, err)
        _ready, ticks2, sums = _wait_output(paced, r2.cid, lambda _r, _t, sums: sums)
        assert ticks2[0] == again.last_tick + 1, (ticks2[:3], again.last_tick)
        assert sums == [ckpt.ready], f"memory after checkpoint mid-fill + restore: {sums}, want {ckpt.ready}"
    finally:
        run_cli("rm", name, check=False)


@pytest.mark.cri_checkpoint_api
def test_cri_checkpoint_container_waits_for_memory_still_arriving(paced, paced_containerd, migrt_config, fill_min_mib,
                                                                  bin_dir, memhog_checkpoint, tmp_path):
    """kubelet's checkpoint API (containerd -> migrt-runc checkpoint) mid-fill: the archive holds all
    96 MiB of memhog's data, not just what had arrived."""
    r = _restore_paced(paced, paced_containerd, memhog_checkpoint, bin_dir, "memhog-kubelet", migrt_config)
    location = str(tmp_path / "checkpoint.tar")
    try:
        _still_filling(r.run_dir)
        paced.checkpoint_container(r.cid, location)
    finally:
        r.watch.stop()
    with tarfile.open(location) as tar:
        pages = sum(m.size for m in tar.getmembers() if os.path.basename(m.name).startswith("pages-"))
    assert pages >= DATA_MIB << 20, f"{pages >> 20} MiB of pages in the CRI checkpoint"
    assert paced.state_name(r.cid) == "CONTAINER_RUNNING"  # kubelet's checkpoint leaves it running

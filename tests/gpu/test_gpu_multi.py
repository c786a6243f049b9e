"""Multi-GPU jobs on the 2-GPU machine (docs/gpu.md, "Multi-GPU jobs"): a torch.distributed job in a
container, one process per GPU, NCCL between them (tests/gpu/ddp_workload.py), GB GiB of tensors
per rank (MIGRT_GPU_MULTI_GB, default 8: the issue's 2 x 8 GiB; e.g. "2" for a quick run).

  (a) NCCL defaults, no hook: `migrt gpu suspend` and `migrt checkpoint` are refused before the
      lock (exit 8), the job keeps running, nothing was taken from the GPUs;
  (b) NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1, each on a job of its own:
      in place:  `migrt gpu suspend` + `migrt gpu resume` onto the swapped GPUs;
      restore:   `migrt checkpoint --tcp-established` + a restore into a new container onto the
                 swapped GPUs (migrt.io/restore-gpus);
      identical tensors, all-reduce results right, training goes on;
  (c) NCCL defaults with the application hook: the same two round trips; the ranks destroy their
      process group at "pre-checkpoint" and build a new one at "post-restore".
Each case records what the peer rule saw of the ranks (`evidence`: the rule's view, the driver's
per-GPU process lists, the device files mapped, thread names, the transports NCCL chose).

Nothing here waits without a deadline, and a run that stops early still says where it was:
  - every step has a time limit (scaled by GB) inside a budget per test (MIGRT_GPU_MULTI_BUDGET_S
    overrides it); the job's waits also end at once when a rank or the container is gone;
  - every step writes a timestamped line to stderr and to $MIGRT_GPU_RESULTS/multi-steps.log
    (appended and closed line by line: a run killed from outside keeps it);
  - a step that runs out of time, or a rank that died, writes a diagnostics file
    ($MIGRT_GPU_RESULTS/multi/<tag>/diag-N.txt): the stacks of the ranks' and migrt's Python threads
    (SIGUSR1 -> faulthandler), the container's processes and threads with their kernel wait
    channels, the driver's checkpoint state of each rank (each query in a process of its own, with a
    deadline: a query can block while a peer is locked, NVIDIA/cuda-checkpoint#30), nvidia-smi,
    the tails of migrt's log, CRIU's logs, the ranks' logs and dmesg; then the test fails;
  - the ranks' logs (NCCL_DEBUG=INFO) and migrt's stdout/stderr of each command are kept there too.
Run: see docs/gpu.md ("Multi-GPU jobs", how it was measured)."""

from __future__ import annotations

import collections
import faulthandler
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.gpu import harness, rig
from tests.gpu.harness import Container

pytestmark = pytest.mark.gpu
WORKLOAD = Path(__file__).with_name("ddp_workload.py")
APPHOOK = harness.REPO / "migrt" / "apphook.py"
# (b): the two settings under test, and the collectives kept on NCCL's own socket transport over
# loopback, whatever network plugin or interface the host's /etc/nccl.conf names
OFF = ["NCCL_P2P_DISABLE=1", "NCCL_SHM_DISABLE=1", "NCCL_IB_DISABLE=1", "NCCL_NET=Socket", "NCCL_SOCKET_IFNAME=lo"]
COMMON = ["TORCH_NCCL_ENABLE_MONITORING=0", "NCCL_RAS_ENABLE=0", "NCCL_DEBUG=INFO"]
DEV_SHM = {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
           "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=1g"]}
HOOK_TMPFS = {"destination": "/run/migrt", "type": "tmpfs", "source": "tmpfs",
              "options": ["nosuid", "nodev", "mode=755", "size=1m"]}
LOCK_TIMEOUT_MS = 10_000  # a lock held up by a collective fails (and is retried once) in 10 s, not 30
LOCK_WORST_S = 2 * (LOCK_TIMEOUT_MS / 1000 + 2 * 10)  # two tries, each its timeout + gpu.session.LOCK_GRACE_S twice


def multi_gbs() -> list[float]:
    return [float(x) for x in os.environ.get("MIGRT_GPU_MULTI_GB", "8").split()]


def budget(kind: str, gb: float) -> float:
    """Seconds one test may take, its clean-up (at most ~45 s, ~2 s when all went well) not counted:
    refused 60 s; in place 102 s at 2 GiB, 138 s at 8 GiB; checkpoint + restore 104 s, 176 s."""
    if os.environ.get("MIGRT_GPU_MULTI_BUDGET_S"):
        return float(os.environ["MIGRT_GPU_MULTI_BUDGET_S"])
    return {"refuse": 60.0, "inplace": 90 + 6 * gb, "restore": 80 + 12 * gb}[kind]


# -- steps, deadlines, diagnostics ------------------------------------------------------------------------
class Steps:
    """One test's clock, log and diagnostics."""

    def __init__(self, node, tag: str, seconds: float) -> None:
        self.node, self.tag = node, tag
        self.t0 = time.monotonic()
        self.end = self.t0 + seconds
        self.dir = node.results / "multi" / tag
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = node.results / "multi-steps.log"
        self.stacks = node.base / "stacks"  # the launchers' SIGUSR1 stacks, <pid>.txt
        self.stacks.mkdir(exist_ok=True)
        self.env = dict(node.env, MIGRT_CONFIG=str(self._config()), MIGRT_TEST_STACKS=str(self.stacks))
        self.jobs: list[Job] = []
        self.cids: list[str] = []  # containers this test made (deleted at its end)
        self.containers: list[Container] = []
        self.checkpoint: str | None = None
        self.diagnosed: Path | None = None
        self.n = 0
        self._guard = open(self.dir / "test-stacks.txt", "w")  # our own stacks, should this process hang
        faulthandler.dump_traceback_later(seconds + 120, file=self._guard)
        self.log(f"test budget {seconds:.0f} s")

    def _config(self) -> Path:
        path = self.node.base / "config-multi.yaml"
        if not path.exists():
            base = Path(self.node.env["MIGRT_CONFIG"]).read_text()
            path.write_text(base + f"gpu_lock_timeout_ms: {LOCK_TIMEOUT_MS}\n")
        return path

    def log(self, msg: str) -> None:
        now = time.time()
        line = (f"{time.strftime('%H:%M:%S', time.gmtime(now))}.{int(now * 1000) % 1000:03d} "
                f"+{time.monotonic() - self.t0:6.1f}s [{self.tag}] {msg}")
        print(line, file=sys.stderr, flush=True)
        with open(self.path, "a") as fh:
            fh.write(line + "\n")

    def limit(self, want: float) -> float:
        """want, or what is left of the budget (at least 1 s)."""
        return max(1.0, min(want, self.end - time.monotonic()))

    def wait(self, fn, want: float, what: str, alive=None):
        """fn() until truthy; alive() (every second) names a reason to stop at once, or None."""
        limit = self.limit(want)
        t0 = time.monotonic()
        next_check = t0 + 1
        self.log(f"{what}: waiting (up to {limit:.0f} s)")
        while time.monotonic() - t0 < limit:
            v = fn()
            if v:
                self.log(f"{what}: ok after {time.monotonic() - t0:.1f} s")
                return v
            if alive is not None and time.monotonic() >= next_check:
                next_check = time.monotonic() + 1
                problem = alive()
                if problem:
                    self.fail(f"{what}: {problem}")
            time.sleep(0.05)
        spent = " (the test's budget is spent)" if limit < want else ""
        self.fail(f"{what}: not within {limit:.0f} s{spent}")

    def fail(self, why: str, diagnosed: Path | None = None):
        """Diagnostics (unless a timeout's handler wrote them already), then AssertionError."""
        self.log(f"FAILED: {why}")
        path = diagnosed or self.diagnose(why)
        raise AssertionError(f"[{self.tag}] {why}\ndiagnostics: {path}")

    # -- commands ------------------------------------------------------------------------------------------
    def container(self, what: str, cid: str, argv: list[str], bundle: str, want: float) -> Container:
        """A harness Container (stdio on pipes, as containerd gives) whose command has a deadline."""
        limit = self.limit(want)
        self.cids.append(cid)
        self.log(f"{what}: {os.path.basename(argv[0])} {' '.join(argv[1:])} (up to {limit:.0f} s)")
        try:
            c = Container(self.node, cid, argv, bundle, env=self.env, timeout=limit,
                          on_timeout=lambda p: self.on_timeout(p, what, limit))
        except subprocess.TimeoutExpired:
            self.fail(f"{what}: still running after {limit:.0f} s", self.diagnosed)
        self.containers.append(c)
        self.log(f"{what}: exit {c.rc} after {c.seconds:.1f} s")
        return c

    def cli(self, what: str, *args: str, want: float, check: bool = True) -> subprocess.CompletedProcess:
        """migrt ARGS with a deadline; stdout/stderr kept in the test's directory."""
        return self.run(what, [self.node.migrt, *args], want=want, check=check)

    def run(self, what: str, argv: list[str], *, want: float, check: bool = True) -> subprocess.CompletedProcess:
        self.n += 1
        stem = self.dir / f"{self.n:02d}-{re.sub(r'[^A-Za-z0-9]+', '-', what).strip('-')[:40]}"
        limit = self.limit(want)
        self.log(f"{what}: {' '.join(os.path.basename(a) if i == 0 else a for i, a in enumerate(argv))} "
                 f"(up to {limit:.0f} s)")
        t0 = time.monotonic()
        with open(f"{stem}.out", "w") as out, open(f"{stem}.err", "w") as err:
            p = subprocess.Popen(argv, stdout=out, stderr=err, env=self.env)
            try:
                rc = p.wait(limit)
            except subprocess.TimeoutExpired:
                self.fail(f"{what}: still running after {limit:.0f} s", self.on_timeout(p, what, limit))
        r = subprocess.CompletedProcess(argv, rc, Path(f"{stem}.out").read_text(), Path(f"{stem}.err").read_text())
        self.log(f"{what}: exit {rc} after {time.monotonic() - t0:.1f} s")
        if check and rc != 0:
            self.fail(f"{what}: exit {rc}\n{r.stderr[-3000:]}")
        return r

    def on_timeout(self, p: subprocess.Popen, what: str, limit: float) -> Path:
        """A command that did not end: its Python stacks, the diagnostics (returned, and kept as
        self.diagnosed), then it and its children killed."""
        tree = _tree(p.pid)
        self.log(f"{what}: still running after {limit:.0f} s: SIGUSR1 to {_pythons(tree, str(self.node.bin))} "
                 f"for their stacks, then diagnostics, then SIGKILL to {tree}")
        told = _pythons(tree, str(self.node.bin))
        for pid in told:
            _signal(pid, signal.SIGUSR1)
        time.sleep(2)
        stacks = "\n".join(f"--- pid {pid}: {_cmdline(pid)[:300]}\n{_tail(self.stacks / f'{pid}.txt', 400)}"
                           for pid in told)
        self.diagnosed = self.diagnose(f"{what} still running after {limit:.0f} s", stacks)
        for pid in reversed(tree):
            _signal(pid, signal.SIGKILL)
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            self.log(f"{what}: pid {p.pid} did not end within 10 s of SIGKILL (D state? see the diagnostics)")
        return self.diagnosed

    # -- what a stuck step leaves to read ---------------------------------------------------------------
    def diagnose(self, why: str, stacks: str = "") -> Path:
        self.n += 1
        path = self.dir / f"diag-{self.n:02d}.txt"
        out: list[str] = [f"why: {why}", f"test time: {time.monotonic() - self.t0:.1f} s"]

        def section(title: str, fn) -> None:
            t0 = time.monotonic()
            try:
                text = fn()
            except Exception as exc:  # noqa: BLE001 - diagnostics never fail the diagnosis
                text = f"(failed: {type(exc).__name__}: {exc})"
            out.append(f"\n===== {title} ({time.monotonic() - t0:.1f} s)\n{text}")
            path.write_text("\n".join(out) + "\n")  # written as it goes: a diagnosis cut short keeps its start

        if stacks:
            section("the command's Python stacks (SIGUSR1)", lambda: stacks)
        ranks = [pid for job in self.jobs for pid in job.known_pids() if _alive(pid)]
        section("ranks: SIGUSR1 (Python stacks into rR.log)", lambda: _usr1(ranks))
        section("containers (runc state)", lambda: "\n".join(
            f"{cid}: {_sh(['runc', '--root', str(self.node.runc_root), 'state', cid], 10)}" for cid in self.cids))
        section("processes (ps)", lambda: _ps(self.node))
        section("rank threads and kernel stacks", lambda: "\n".join(_threads(p) for p in ranks))
        section("driver checkpoint state per rank (one process each, 8 s)", lambda: "\n".join(
            f"pid {p}: {_cuda_state(self.node, p)}" for p in ranks))
        section("nvidia-smi", lambda: _sh(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory",
                                           "--format=csv"], 15) + _sh(
            ["nvidia-smi", "--query-gpu=index,uuid,memory.used,utilization.gpu", "--format=csv"], 15))
        section("sockets of the ranks (ss)", lambda: "\n".join(
            line for line in _sh(["ss", "-tanpx"], 10).splitlines() if any(f"pid={p}," in line for p in ranks)))
        time.sleep(1)  # faulthandler's output reaches the rank logs
        for job in self.jobs:
            for name in job.log_names():
                section(f"{job.tag}: {name} (last 80 lines)", lambda n=name, j=job: _tail(j.data / n, 80))
        section("migrt.log (last 100 lines)", lambda: _tail(self.node.base / "migrt.log", 100))
        section("hook.log (last 30 lines)", lambda: _tail(self.node.base / "hook.log", 30))
        section("CRIU and runc logs written during this test", lambda: self._criu_logs())
        section("dmesg (last 40 lines)", lambda: "\n".join(_sh(["dmesg"], 10).splitlines()[-40:]))
        self.log(f"diagnostics: {path}")
        return path

    def _criu_logs(self) -> str:
        since = time.time() - (time.monotonic() - self.t0) - 5
        found = []
        for name in ("dump.log", "restore.log", "runc.log", "runc.stderr"):
            found += [p for p in glob.glob(f"{self.node.base}/**/{name}", recursive=True)
                      if os.path.getmtime(p) >= since]
        found.sort(key=os.path.getmtime)
        return "\n".join(f"--- {p}\n{_tail(Path(p), 40)}" for p in found[-6:]) or "(none)"

    # -- the end of a test -----------------------------------------------------------------------------
    def cleanup(self) -> None:
        """Bounded: containers deleted, the checkpoint removed, the job's files kept, GPUs free."""
        faulthandler.cancel_dump_traceback_later()
        self._guard.close()
        pids = [pid for job in self.jobs for pid in job.known_pids()]
        for job in self.jobs:
            for name in job.log_names():
                try:
                    shutil.copy(job.data / name, self.dir / f"{job.tag}.{name}")
                except OSError:
                    pass
        for cid in self.cids:
            r = _sh(["runc", "--root", str(self.node.runc_root), "delete", "--force", cid], 10)
            self.log(f"cleanup: runc delete --force {cid}: {r.strip()[:200] or 'ok'}")
        for c in self.containers:
            for fd in (c.w_in, c.r_out):
                try:
                    os.close(fd)
                except OSError:
                    pass
        if self.checkpoint:
            r = _sh([self.node.migrt, "rm", self.checkpoint], 15, env=self.env)
            self.log(f"cleanup: migrt rm {self.checkpoint}: {r.strip()[:200] or 'ok'}")
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10:
            left = [p for p in pids if p in _nvml_pids()]
            if not left:
                break
            time.sleep(0.5)
        else:
            self.log(f"cleanup: ranks {left} still hold GPU memory after 10 s")
        self.log(f"cleanup: done, test took {time.monotonic() - self.t0:.1f} s")


def _sh(argv: list[str], timeout: float, env: dict | None = None) -> str:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
        return r.stdout + r.stderr
    except subprocess.TimeoutExpired:
        return f"({' '.join(argv)}: no answer within {timeout:.0f} s)"
    except OSError as exc:
        return f"({argv[0]}: {exc})"


def _tail(path: Path, n: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError as exc:
        return f"({exc})"


def _alive(pid: int) -> bool:
    from migrt.gpu import procs

    return procs.alive(pid)


def _tree(pid: int) -> list[int]:
    from migrt.gpu import procs

    try:
        return procs.process_tree(pid)
    except Exception:  # noqa: BLE001 - gone already
        return [pid]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _pythons(pids: list[int], marker: str) -> list[int]:
    """Those of pids that run one of the test's migrt launchers (they print their stacks on SIGUSR1)."""
    return [p for p in pids if marker in _cmdline(p)]


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError:
        pass


def _usr1(ranks: list[int]) -> str:
    sent = [p for p in ranks if "ddp_workload.py" in _cmdline(p)]
    for p in sent:
        _signal(p, signal.SIGUSR1)
    return f"sent to {sent}"


def _ps(node) -> str:
    keep = ("ddp_workload", "migrt", "criu", "runc", str(node.bin))
    lines = _sh(["ps", "-eo", "pid,ppid,stat,etimes,wchan:32,args", "--sort=pid"], 10).splitlines()
    return "\n".join(line[:400] for line in lines[:1] + [x for x in lines[1:] if any(k in x for k in keep)])


def _threads(pid: int) -> str:
    out = [f"pid {pid}: {_cmdline(pid)[:200]}"]
    for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
        base = f"/proc/{pid}/task/{tid}"
        try:
            comm = Path(f"{base}/comm").read_text().strip()
            stat = Path(f"{base}/stat").read_text().rsplit(")", 1)[1].split()[0]
            wchan = Path(f"{base}/wchan").read_text().strip()
        except OSError:
            continue
        out.append(f"  tid {tid} {comm:16s} {stat} {wchan}")
    try:
        out.append("  kernel stack of the main thread:\n    " + Path(f"/proc/{pid}/stack").read_text().strip()
                   .replace("\n", "\n    "))
    except OSError as exc:
        out.append(f"  (no kernel stack: {exc})")
    return "\n".join(out)


def _cuda_state(node, pid: int) -> str:
    code = ("import sys; from migrt.gpu import select; b = select.get_backend('auto'); "
            f"print(b.state({pid}))")
    return _sh([node.python if os.path.exists(node.python) else "python3", "-c", code], 8, env=node.env).strip()


def _nvml_pids() -> set[int]:
    from migrt.gpu import inventory

    return set(inventory.take().processes)


# -- the job ---------------------------------------------------------------------------------------------
class Rank:
    def __init__(self, data: Path, rank: int) -> None:
        self.data, self.rank, self.k = data, rank, 0

    def read(self, suffix: str) -> dict | None:
        try:
            return json.loads((self.data / f"r{self.rank}.{suffix}").read_text())
        except (OSError, ValueError):
            return None

    def hook_events(self) -> list[dict]:
        p = self.data / f"r{self.rank}.hook.jsonl"
        return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


class Job:
    """The container and its two ranks; every wait bounded by the test's Steps."""

    def __init__(self, node, st: Steps, tag: str, gb: float, env: list[str], hook: bool,
                 criu_config: str | None = None, netns: tuple[str, str] | None = None) -> None:
        """criu_config: a CRIU configuration file for the container's checkpoints and restores
        (rig.criu_config_file: `network-lock skip` where CRIU's iptables lock cannot work); netns:
        network namespaces (names under /run/netns) for the source and the restored container, as two
        pods have (None: the host's)."""
        self.node, self.st, self.tag, self.gb = node, st, tag, gb
        self.criu_config = criu_config
        self.netns = netns
        self.data = node.data_dir(tag)
        shutil.copy(WORKLOAD, self.data / "ddp_workload.py")
        shutil.copy(APPHOOK, self.data / "apphook.py")  # what an application does: carry the helper
        self.env = [*COMMON, *env, *(["WORKLOAD_HOOK=1"] if hook else [])]
        # NCCL's socket transport keeps its proxy buffers in /dev/shm (34 MB a segment; runc spec's
        # 64 MiB /dev/shm failed with ENOSPC on the H200 pair): 1 GiB, as pods give NCCL jobs
        self.mounts = [DEV_SHM] + ([HOOK_TMPFS] if hook else [])
        self.ranks = [Rank(self.data, r) for r in (0, 1)]
        self.host_pids: list[int] = []
        self.ended_before = ""  # job.log as it was when the current container started
        st.jobs.append(self)
        cid = f"{tag}-src"
        bundle = node.bundle(cid, [node.python, "/data/ddp_workload.py", "--job", str(gb)], self.data, [0, 1],
                             env=self.env, mounts=self.mounts, criu_config=criu_config,
                             netns=netns[0] if netns else None)
        st.log(f"job {tag}: starting container {cid}, 2 ranks x {gb:g} GiB, env {' '.join(env) or '(NCCL defaults)'}"
               f"{', application hook' if hook else ''}")
        self.container = st.container("runc create", cid, ["runc", "--root", str(node.runc_root), "create",
                                                            "--bundle", bundle, cid], bundle, want=60)
        if self.container.rc != 0:
            st.fail(f"runc create {cid}: {self.container.output()}")
        st.run("runc start", ["runc", "--root", str(node.runc_root), "start", cid], want=30)
        self.ready = [st.wait(lambda r=r: r.read("ready.json"), 90, f"rank {r.rank} ready (torch, CUDA, NCCL init)",
                              alive=self.problem) for r in self.ranks]
        self.host_pids = self.pids()
        st.log(f"job {tag}: ranks at host pids {self.host_pids}")
        for r in self.ranks:
            self.past(r, 3)

    # -- state --------------------------------------------------------------------------------------------
    def log_names(self) -> list[str]:
        return [p.name for p in sorted(self.data.glob("*")) if p.suffix in (".log", ".jsonl")
                or p.name.endswith((".ready.json", ".status.json"))]

    def known_pids(self) -> list[int]:
        return list(self.host_pids)

    def problem(self) -> str | None:
        """Why waiting on the ranks is pointless: a rank exited (job.log) or died, or the container stopped."""
        ended = "\n".join(_read_lines(self.data / "job.log"))
        if ended != self.ended_before:
            return f"the job ended: {ended.splitlines()[-1]}"
        dead = [p for p in self.host_pids if not _alive(p)]
        if dead:
            return f"rank process(es) {dead} are gone"
        state = self.container.state()
        if state.get("status") not in ("running", "created", None) or not state:
            return f"container {self.container.cid} is {state.get('status', 'gone')}"
        return None

    def pids(self, container: Container | None = None) -> list[int]:
        """Host pids of ranks 0 and 1 (the init is the supervisor, without CUDA), by their pid in the
        container (what they wrote in ready.json; a restore keeps it)."""
        from migrt.gpu import procs

        init = (container or self.container).state()["pid"]
        by_ns = {procs.ns_pid(p): p for p in procs.process_tree(init) if p != init}
        return [by_ns[r["pid"]] for r in self.ready]

    def counts(self) -> list[int]:
        return [(r.read("status.json") or {}).get("count", -1) for r in self.ranks]

    def past(self, r: Rank, count: int, want: float = 45) -> dict:
        return self.st.wait(lambda: (s := r.read("status.json")) and s["count"] > count and s, want,
                            f"rank {r.rank} past step {count}", alive=self.problem)

    def going_on(self, after: list[int]) -> float:
        """Seconds until both ranks passed `after` (+3) with every all-reduce right."""
        t0 = time.monotonic()
        for r, n in zip(self.ranks, after):
            s = self.past(r, n + 3)
            assert s["allreduce_bad"] == 0, f"rank {r.rank}: {s['allreduce_bad']} wrong all-reduce results"
            assert s["gpu_count"] == s["count"]
        return round(time.monotonic() - t0, 3)

    def same_tensors(self) -> None:
        for r, ready in zip(self.ranks, self.ready):
            r.k += 1
            (self.data / f"r{r.rank}.verify-{r.k}").write_text("")
            check = self.st.wait(lambda r=r: r.read(f"result-{r.k}.json"), 20 + 2 * self.gb,
                                 f"rank {r.rank} checksum #{r.k}", alive=self.problem)
            assert check["checksum"] == ready["checksum"], f"rank {r.rank}: tensors differ after the round trip"

    def evidence(self, container: Container | None = None) -> dict:
        """What the peer rule saw, and the raw signals beside it."""
        from migrt.gpu import inventory, peers

        inv = inventory.take()
        pids = self.pids(container)
        v = peers.assess(pids, driver_version=inv.driver_version, contexts=inv.contexts())
        raw = {}
        for rank, pid in enumerate(pids):
            maps = collections.Counter(line.split()[-1] for line in _read_lines(f"/proc/{pid}/maps")
                                       if "/dev/nvidia" in line)
            threads = collections.Counter(x.strip() for t in glob.glob(f"/proc/{pid}/task/*")
                                          for x in _read_lines(f"{t}/comm"))
            via = [line.split("NCCL INFO", 1)[-1].strip() for line in _read_lines(self.data / f"r{rank}.log")
                   if " via " in line]
            raw[str(pid)] = {"rank": rank, "nvml": inv.processes.get(pid), "maps_nvidia": dict(maps),
                             "threads": dict(threads), "nccl_transports": via[:6], "nccl_transport_lines": len(via)}
        conf = _read_lines("/etc/nccl.conf")
        return {"processes": [p.to_dict() for p in v.processes], "findings": [f.to_dict() for f in v.findings],
                "raw": raw, "host_nccl_conf": conf[:20]}

    def restore(self, name: str, *, swapped: bool) -> Container:
        """A new container (migrt-runc create with MIGRT_RESTORE), both GPUs, swapped if asked."""
        st, node = self.st, self.node
        g = node.gpus
        ann = {"migrt.io/restore-gpus": f"{g[1].uuid},{g[0].uuid}"} if swapped else None
        cid = f"{self.tag}-dst"
        bundle = node.bundle(cid, [node.python, "/data/ddp_workload.py", "--job", "0"], self.data, [0, 1],
                             env=[*self.env, f"MIGRT_RESTORE={name}"], annotations=ann, mounts=self.mounts,
                             criu_config=self.criu_config, netns=self.netns[1] if self.netns else None)
        log = os.path.join(bundle, "log.json")
        st.log(f"restore {name} into {cid}: GPUs {'swapped' if swapped else 'as they were'}")
        self.ended_before = "\n".join(_read_lines(self.data / "job.log"))
        c = st.container("migrt-runc create (restore)", cid, [node.shim, "--root", str(node.runc_root), "--log", log,
                                                               "--log-format", "json", "create", "--bundle", bundle,
                                                               cid], bundle, want=60 + 8 * self.gb)
        if c.rc != 0:
            err = ""
            if os.path.exists(log):
                err = "\n".join(json.loads(line).get("msg", "") for line in open(log) if '"error"' in line)
            st.fail(f"restore {name}: exit {c.rc}: {err}")
        st.run("migrt-runc start", [node.shim, "--root", str(node.runc_root), "start", cid], want=30)
        self.container = c
        self.host_pids = self.pids(c)
        st.log(f"restore: ranks at host pids {self.host_pids}")
        return c


def _read_lines(path) -> list[str]:
    try:
        return Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return []


def gpus_of(pids: list[int]) -> list[list[str]]:
    return [harness.gpu_of_pid(p) for p in pids]


# -- the round trips -------------------------------------------------------------------------------------
def suspend_resume_swapped(node, st: Steps, job: Job) -> dict:
    """In place: suspend both ranks, resume each onto the other GPU; returns the figures."""
    cid, root, gb = job.container.cid, str(node.runc_root), job.gb
    g = node.gpus
    before = gpus_of(job.pids())
    st.log(f"GPUs of the ranks before: {before}")
    rec = json.loads(st.cli("gpu suspend", "gpu", "suspend", cid, "--root", root, "--json",
                            want=LOCK_WORST_S + 10 + 3 * gb).stdout)
    stalled = job.counts()
    time.sleep(1)
    assert job.counts() == stalled, "the ranks went on while their GPU state was away"
    st.log(f"suspended: {rec['timings']}, counts {stalled} (held for 1 s)")
    done = json.loads(st.cli("gpu resume onto the swapped GPUs", "gpu", "resume", cid, "--root", root, "--gpus",
                             f"{g[1].uuid},{g[0].uuid}", "--json", want=30 + 3 * gb).stdout)
    assert done["moved"] and [(p["old"], p["new"]) for p in done["pairs"]] == [(g[0].uuid, g[1].uuid),
                                                                             (g[1].uuid, g[0].uuid)]
    after = job.going_on(stalled)
    swap = {g[0].uuid: g[1].uuid, g[1].uuid: g[0].uuid}
    now = gpus_of(job.pids())
    assert [sorted(u) for u in now] == [sorted(swap[u] for u in b) for b in before], \
        f"each rank's memory should now be on the other GPU: before {before}, after {now}"
    job.same_tensors()
    return {"suspend_s": rec["timings"].get("suspend_s"), "resume_s": done["timings"].get("resume_s"),
            "going_on_after_s": after, "hook": done.get("app_hook")}


def checkpoint_restore_swapped(node, st: Steps, job: Job, name: str, *flags: str) -> dict:
    """migrt checkpoint (the source stops), restore into a new container onto the swapped GPUs."""
    g, gb = node.gpus, job.gb
    swap = {g[0].uuid: g[1].uuid, g[1].uuid: g[0].uuid}
    before = gpus_of(job.pids())
    st.log(f"GPUs of the ranks before: {before}")
    st.checkpoint = name
    t0 = time.monotonic()
    st.cli("checkpoint", "checkpoint", job.container.cid, "--root", str(node.runc_root), "--name", name, "--json",
           *flags, want=LOCK_WORST_S + 40 + 8 * gb)
    ck_wall = time.monotonic() - t0
    manifest = json.loads(st.cli("inspect", "inspect", name, "--json", want=30).stdout)["manifest"]
    st.log(f"checkpoint {name}: {manifest.get('timings')}, {manifest.get('size_bytes')} bytes")
    stopped = job.counts()
    dst = job.restore(name, swapped=True)
    after = job.going_on(stopped)
    job.same_tensors()
    moved = gpus_of(job.pids(dst))
    restored = node.migrt_events("restored")[-1].get("timings", {})
    t = manifest.get("timings", {})
    return {"gpu_checkpoint_s": t.get("gpu_checkpoint_s"), "dump_s": t.get("dump_s"),
            "checkpoint_total_s": t.get("total_s"), "checkpoint_wall_s": round(ck_wall, 3),
            "image_bytes": manifest.get("size_bytes"), "restore_s": restored.get("restore_s"),
            "gpu_restore_s": restored.get("gpu_restore_s"), "app_hook_s": restored.get("app_hook_s"),
            "restore_total_s": restored.get("total_s"), "restore_wall_s": round(dst.seconds, 3),
            "going_on_after_s": after, "gpus_before": before, "gpus_after": moved,
            "swapped": [sorted(u) for u in moved] == [sorted(swap[u] for u in b) for b in before]}


def two_gpus(node) -> None:
    if len(node.gpus) < 2 or node.gpus[0].name != node.gpus[1].name:
        pytest.fail(f"needs two GPUs of one model (this node: {[g.name for g in node.gpus]}): run on nvidia-h200-x2 "
                    "or nvidia-h100-x2")


def case(node, title: str, tag: str, kind: str, gb: float, body) -> None:
    """body(st) inside a budget; a failure is recorded (with where to read more) and re-raised;
    the containers, the checkpoint and the GPUs are cleaned up in any case."""
    two_gpus(node)
    st = Steps(node, tag, budget(kind, gb))
    st.log(f"=== {title}, 2 x {gb:g} GiB")
    try:
        body(st)
        st.log(f"=== {title}: passed")
    except BaseException as exc:
        node.record(f"{title}: FAILED", gb=gb, processes=2, error=str(exc)[-2000:],
                    details=str(st.dir.relative_to(node.results)))
        raise
    finally:
        st.cleanup()


def tag_of(prefix: str, gb: float) -> str:
    return f"{prefix}-{gb:g}".replace(".", "p")


# -- the cases -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gb", multi_gbs())
def test_multi_a_nccl_defaults_without_hook_are_refused_before_the_lock(node, gb):
    tag = tag_of("ma", gb)

    def body(st: Steps) -> None:
        job = Job(node, st, tag, gb, [], hook=False)
        ev = job.evidence()
        st.log(f"evidence: findings {ev['findings']}")
        used = gpus_of(job.pids())
        before = job.counts()
        root = str(node.runc_root)
        r = st.cli("gpu suspend (must be refused)", "gpu", "suspend", job.container.cid, "--root", root, want=60,
                   check=False)
        refused = r.returncode == 8 and "hold peer-to-peer or IPC state" in r.stderr
        node.record("multi (a) NCCL defaults, no hook: gpu suspend refused", gb=gb, processes=2, refused=refused,
                    evidence=ev, stderr=r.stderr[-1500:])
        assert refused, f"not refused (exit {r.returncode}): {r.stderr}\nevidence: {json.dumps(ev)}"
        r = st.cli("checkpoint (must be refused)", "checkpoint", job.container.cid, "--root", root, "--name", tag,
                   want=60, check=False)
        assert r.returncode == 8 and "hold peer-to-peer or IPC state" in r.stderr, r.stderr
        assert "NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1" in r.stderr and "application hook" in r.stderr
        assert job.container.state().get("status") == "running"
        job.going_on(before)  # never stopped, all-reduce right
        assert gpus_of(job.pids()) == used  # nothing taken from the GPUs

    case(node, "multi (a) NCCL defaults, no hook", tag, "refuse", gb, body)


@pytest.mark.parametrize("gb", multi_gbs())
def test_multi_b_inplace_p2p_and_shm_off_suspend_and_resume_onto_swapped_gpus(node, gb):
    tag = tag_of("mbi", gb)

    def body(st: Steps) -> None:
        job = Job(node, st, tag, gb, OFF, hook=False)
        ev = job.evidence()
        st.log(f"evidence: findings {ev['findings']}")
        inplace = suspend_resume_swapped(node, st, job)
        node.record("multi (b) P2P/SHM off: gpu suspend + resume onto swapped GPUs", gb=gb, processes=2,
                    gpu_checkpoint_s=inplace["suspend_s"], gpu_resume_s=inplace["resume_s"],
                    counting_again_after_s=inplace["going_on_after_s"], evidence=ev)

    case(node, "multi (b) P2P/SHM off, in place", tag, "inplace", gb, body)


@pytest.mark.parametrize("gb", multi_gbs())
def test_multi_b_restore_p2p_and_shm_off_checkpoint_and_restore_onto_swapped_gpus(node, gb):
    tag = tag_of("mbr", gb)

    def body(st: Steps) -> None:
        # NCCL's TCP sockets between the ranks go through the dump (--tcp-established); CRIU locks each
        # connection with an iptables rule matching a mark, which the GPU machine's kernel cannot load
        # (no xt_mark): then the rig's `network-lock skip` (both ends are in the dump, frozen)
        conf_dir = node.base / f"criu-{tag}"
        conf_dir.mkdir(exist_ok=True)
        conf, lock = rig.criu_config_file(str(conf_dir))
        st.log(f"CRIU network lock: {lock}")
        # Each container in its own network namespace, as two pods: the ranks' TCP connections (NCCL's
        # socket transport on lo) come back in the new one. In the host's, the killed source's ports
        # were still taken ("Can't bind inet socket: Address already in use", H200 pair).
        names = (f"{tag}-nsa", f"{tag}-nsb")
        for n in names:
            subprocess.run(["ip", "netns", "add", n], check=True, capture_output=True, timeout=30)
            subprocess.run(["ip", "-n", n, "link", "set", "lo", "up"], check=True, capture_output=True, timeout=30)
        try:
            job = Job(node, st, tag, gb, OFF, hook=False, criu_config=conf, netns=names)
            ev = job.evidence()
            st.log(f"evidence: findings {ev['findings']}")
            out = checkpoint_restore_swapped(node, st, job, tag, "--tcp-established")
        finally:
            for n in names:
                subprocess.run(["ip", "netns", "del", n], capture_output=True, timeout=30)
        assert out["swapped"], out["gpus_after"]
        node.record("multi (b) P2P/SHM off: checkpoint + restore onto swapped GPUs", gb=gb, processes=2,
                    counting_again_after_s=out.pop("going_on_after_s"), evidence=ev, network_lock=lock, **out)

    case(node, "multi (b) P2P/SHM off, checkpoint + restore", tag, "restore", gb, body)


@pytest.mark.parametrize("gb", multi_gbs())
def test_multi_c_inplace_nccl_defaults_with_the_hook_suspend_and_resume_onto_swapped_gpus(node, gb):
    tag = tag_of("mci", gb)

    def body(st: Steps) -> None:
        job = Job(node, st, tag, gb, [], hook=True)
        ev = job.evidence()
        st.log(f"evidence: findings {ev['findings']}")
        inplace = suspend_resume_swapped(node, st, job)
        downs = [r.hook_events() for r in job.ranks]
        assert all([e["event"] for e in d] == ["pre-checkpoint", "post-restore"] for d in downs), downs
        assert all(d[-1]["reason"] == "resumed" for d in downs)
        assert all(r.read("status.json")["gen"] == 1 for r in job.ranks)  # a new process group
        node.record("multi (c) NCCL defaults + hook: gpu suspend + resume onto swapped GPUs", gb=gb, processes=2,
                    gpu_checkpoint_s=inplace["suspend_s"], gpu_resume_s=inplace["resume_s"],
                    counting_again_after_s=inplace["going_on_after_s"], evidence=ev,
                    hook_down_s=max(d[0]["seconds"] for d in downs), hook_up_s=max(d[1]["seconds"] for d in downs))

    case(node, "multi (c) NCCL defaults + hook, in place", tag, "inplace", gb, body)


@pytest.mark.parametrize("gb", multi_gbs())
def test_multi_c_restore_nccl_defaults_with_the_hook_checkpoint_and_restore_onto_swapped_gpus(node, gb):
    tag = tag_of("mcr", gb)

    def body(st: Steps) -> None:
        job = Job(node, st, tag, gb, [], hook=True)
        ev = job.evidence()
        st.log(f"evidence: findings {ev['findings']}")
        out = checkpoint_restore_swapped(node, st, job, tag)  # no TCP left: the group is gone at the dump
        assert out["swapped"], out["gpus_after"]
        ups = [r.hook_events()[-1] for r in job.ranks]
        assert all(u["event"] == "post-restore" and u["reason"] == "restored" for u in ups), ups
        assert all(r.read("status.json")["gen"] == 1 for r in job.ranks)
        node.record("multi (c) NCCL defaults + hook: checkpoint + restore onto swapped GPUs", gb=gb, processes=2,
                    counting_again_after_s=out.pop("going_on_after_s"), hook_up_s=max(u["seconds"] for u in ups),
                    evidence=ev, **out)

    case(node, "multi (c) NCCL defaults + hook, checkpoint + restore", tag, "restore", gb, body)

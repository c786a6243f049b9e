"""The pod-level pull: every container of a new pod pulls its namesake from a running pod on another
node, with ONE cut of the source pod (issue 29).

How it is asked for. The new pod carries two annotations:

    migrt.io/migrate-from: <node>[:port]/<namespace>/<pod>        (the pod: no container named)
    migrt.io/migrate-pod:  <name>=<image>,<name>=<image>,...      the new pod's containers that pull

`migrate-from` of that form alone keeps its meaning (the container of this one's name, one freeze
each); `migrate-pod` makes it pod-level. The list is what the target's side cannot learn otherwise
(kubelet creates the containers one at a time and a create sees only its own bundle): it names
every container that pulls, with its image as the new pod's containers give it, so the source pod is
checked against the whole new pod before anything is frozen. A container of the new pod that is
not listed (a regular init container) is created as an immediate exit 0 when the source's agent says
its namesake ran there, else it starts fresh (initran.py).
`migrt k8s move-manifest` writes the list.

kubelet's steps, and what each does (containers are created one after another; each create waits):

    first listed create   joins the new pod's hold (pods/hold.py, keyed by its sandbox id), pulls
        (migrate-from)    from the source's agent with the list; the agent finds the source pod's
                          running containers, checks each (opt-in, namespace, running), the list
                          against them (names and images: members.mismatch) and every container's
                          migration preflight (lazy dump limits; a GPU container's CUDA processes
                          probed: the driver's checkpoint API usable, no peer state it cannot
                          restore), all before anything is frozen; then locks and checkpoints the GPU
                          containers' CUDA processes (migration/gpu.py suspend_together: the driver
                          needs running tasks) and freezes them all (one cut, members.PodFreeze), each
                          under a guard that resumes it (its GPU state too); then every CPU
                          container's lazy dump starts at once (migration/earlydump.py). This
                          container's part then migrates as a single pull does (its images from
                          its dump made at the cut, page server),
                          restored into the create's bundle and held frozen (hold), the create
                          returns. A GPU part is restored running (the driver restores through a
                          thread of each process: its host copy fetched first, as a lazy GPU
                          migration orders it), then paused before it joins the hold.
    the next creates      pull their parts from the same cut (each one's images dumped at the cut,
                          its restore, held; a held part's filler copies nothing in the background
                          until the release: pagefill/engine.py, hold.FILL_ENV).
    the last create       its part restored, the create returns, then every part is thawed together.
    pages                 every part's memory follows from its page server; a part's pull ends (and its
                          source container is destroyed) only once the pod is whole and its pages in.

Exactly one copy, always:
    - a part's pull that fails (either side) abandons the hold: the parts already restored here are
      removed, each source part resumes (its migration's rollback), and the cut resumes every
      container no part took yet (its dumps made at the cut stopped first); the cut refuses later
      parts. A GPU container is thawed first, then
      its CUDA processes restored and unlocked on their own GPU (a GPU part's target preflight, the
      new container's GPUs, answers at that part's own offer, after the cut: a refusal there is such
      a failure).
    - the rest of the pod never comes (an image that cannot be pulled, a create killed at kubelet's
      deadline, an agent gone): the hold's deadline (`pod_pull_deadline`) abandons it on the target,
      the cut's resumes the rest on the source.
    - a source that lost its target asks whether its part runs there: a held part answers only once
      its pod is decided (receive.py, hold.wait_for_part).
A failed pod-level pull is not tried again by kubelet's retries (the hold stays abandoned): delete
the new pod and create it again.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from dataclasses import dataclass, field

from migrt.config import Config
from migrt.errors import Conflict, PreconditionFailed, UsageError
from migrt.migration.earlydump import EarlyDump
from migrt.migration.earlydump import start_all as start_early
from migrt.migration.gpu import GpuSource, suspend_together
from migrt.migration.guard import Guard
from migrt.oci.bundle import Bundle
from migrt.pods import hold, netlock
from migrt.pods.members import Member, PodFreeze, mismatch, pod_members
from migrt.pods.members import parse_listed as parse_parts  # migrt.io/migrate-pod's value
from migrt.runtime import control
from migrt.runtime.runc import LowerRuntime


class TargetPart:
    """One container of the new pod pulling its part (pull.py's worker): the checks of its own
    create, its place in the pod's hold, the hold's freeze for its restore."""

    def __init__(self, cfg: Config, bundle: Bundle, root: str, request_pod: str, source: dict) -> None:
        self.parts = parse_parts(request_pod)
        meta = bundle.cri_metadata()
        self.name = meta.get("container_name", "")
        if "container_id" in source or source.get("container") != self.name:
            raise UsageError("a pod-level pull (migrt.io/migrate-pod) names the source pod, not a container: "
                             "migrt.io/migrate-from=<node>[:port]/<namespace>/<pod>")
        want, image = self.parts.get(self.name), meta.get("image_name", "")
        if want and image and want != image:
            raise UsageError(f"container {self.name}: migrt.io/migrate-pod gives image {want!r}, the container "
                             f"runs {image!r}; list the new pod's images as its containers give them")
        if not meta.get("sandbox_id"):
            raise UsageError(f"container {self.name}: a pod-level pull needs the pod's sandbox id (a CRI create)")
        self.hold = hold.Hold(root, meta["sandbox_id"], cfg.runtime_path())
        rec = self.hold.join(list(self.parts), cfg.pod_pull_deadline, netlock.netns_path(bundle))
        if rec.get("state") == hold.RELEASED:  # a container of the moved pod created again (a restart)
            raise PreconditionFailed("this pod's pod-level pull completed earlier and its source is gone: a container "
                                     "created again cannot pull; remove the pod's migrt.io/migrate-from and "
                                     "migrt.io/migrate-pod annotations once the pod runs (docs/kubernetes.md)")
        if rec.get("state") != hold.HOLDING:
            raise PreconditionFailed(f"the pod-level pull of this pod was given up earlier ({rec.get('reason')}); "
                                     "it is not tried again: delete this pod and create it anew")
        self.first = not rec.get("parts")
        self.gpu, self.runtime = False, cfg.runtime_path()
        self.sandbox = meta["sandbox_id"]
        self._work = tempfile.mkdtemp(prefix="migrt-pod-hold-")
        self._env_before = os.environ.get("CRIU_CONFIG_FILE")
        os.environ.update(hold.criu_env(dict(os.environ), self._work))  # this worker's restore: held
        os.environ[hold.FILL_ENV] = self.hold.path  # its filler's background copies wait for the release

    def message(self) -> dict:
        return {"parts": self.parts, "sandbox": self.sandbox, "first": self.first}

    def unheld(self) -> None:
        """A GPU part (its offer has CUDA processes): the driver restores through a thread of each
        process, so no freeze at CRIU's pre-resume; arrived() pauses it once restored, as a pod
        restore's GPU part (ops/pod_restore.py). It runs for that moment with the loopback dropped."""
        self.gpu = True
        self._restored()

    def arrived(self, cid: str) -> bool:
        """This part runs (frozen): True when it is the pod's last (release() then)."""
        self._restored()
        if self.gpu:
            LowerRuntime(self.runtime).pause(self.hold.root, cid)
        return self.hold.arrived(self.name, cid)

    def release(self) -> None:
        self.hold.release()

    def wait(self) -> None:
        """Until the pod is whole (the part's pull then ends) or given up (PreconditionFailed: the
        caller removes this part)."""
        st = self.hold.wait()
        if st != hold.RELEASED:
            raise PreconditionFailed(f"the new pod's other containers did not all come: {self.hold.reason()}")

    def abandon(self, reason: str) -> None:
        self._restored()
        self.hold.abandon(reason)

    def _restored(self) -> None:
        """The restore is over: the freeze script and its config go, CRIU_CONFIG_FILE as it was."""
        if self._env_before is None:
            os.environ.pop("CRIU_CONFIG_FILE", None)
        else:
            os.environ["CRIU_CONFIG_FILE"] = self._env_before
        os.environ.pop(hold.FILL_ENV, None)
        shutil.rmtree(self._work, ignore_errors=True)


class NotEligible(PreconditionFailed):
    """The source pod may not go to this pod (absent, not opted in, another namespace, not running):
    the agent answers with its one refusal text (agent.Refused); this reason stays in its log."""


@dataclass
class PodCut:
    """The source pod, frozen at one instant, its containers handed to the parts' pulls one by one.
    Until a part's migration has it (handed), a container is the cut's: resumed by fail(), or by its
    guard should the agent die."""
    pod: str
    runtime: str
    members: dict[str, Member]
    preps: dict[str, object]
    guards: dict[str, Guard] = field(default_factory=dict)
    taken: set[str] = field(default_factory=set)
    handed: set[str] = field(default_factory=set)
    ended: set[str] = field(default_factory=set)
    failed: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    timer: threading.Timer | None = None
    early: dict[str, EarlyDump] = field(default_factory=dict)  # each container's dump, made at the cut

    def take(self, name: str) -> tuple[Member, object]:
        with self.lock:
            if self.failed:
                raise Conflict(f"the pod-level pull of pod {self.pod} was given up ({self.failed}); the source pod "
                               "runs on")
            if name not in self.members or name in self.taken:
                raise Conflict(f"pod {self.pod}: container {name} is pulled already, or not part of this pull")
            self.taken.add(name)
            return self.members[name], self.preps[name]

    def hand(self, name: str) -> None:
        """The part's migration armed its own guard for the container: ours stands down. Refused
        (the part's migration then rolls back) when the cut was given up meanwhile (its deadline):
        the container was resumed, and this pull no longer belongs to one cut."""
        with self.lock:
            if self.failed:
                raise Conflict(f"the pod-level pull of pod {self.pod} was given up ({self.failed}) while container "
                               f"{name} was being handed over; the source pod runs on")
            self.handed.add(name)
            guard = self.guards.pop(name, None)
        if guard:
            guard.disarm()

    def end(self, name: str, error: str | None) -> bool:
        """A part's pull ended; on an error the cut is given up. True when every part has ended."""
        if error:
            self.fail(f"container {name}: {error}")
        with self.lock:
            self.ended.add(name)
            return self.ended >= set(self.members) or self.failed is not None

    def fail(self, reason: str) -> None:
        """Resume every container no part's migration has (in the cut's order), once."""
        with self.lock:
            if self.failed:
                return
            self.failed = reason
            mine = [m for n, m in self.members.items() if n not in self.handed]
            guards, self.guards = self.guards, {}
        if self.timer:
            self.timer.cancel()
        for dump in self.early.values():  # stopped first: a container is never thawed under its dump
            dump.cancel()
        for m in mine:
            try:
                control.resume(self.runtime, m.root, m.cid)
            except Exception:  # noqa: BLE001 - its guard tries again below
                continue
            gpu = _gpu(self.preps.get(m.name))
            if gpu is not None:  # thawed: its CUDA processes back onto their own GPU
                gpu.resume()
            if m.name in guards:
                guards.pop(m.name).disarm()
        for guard in guards.values():  # those that could not be resumed: the guard tries on release
            guard.release()

    def start_deadline(self, seconds: float) -> None:
        def expire() -> None:
            with self.lock:
                missing = sorted(set(self.members) - self.taken)
            if missing:
                self.fail(f"deadline: containers {missing} never pulled (pod_pull_deadline {seconds:g} s)")
        self.timer = threading.Timer(seconds, expire)
        self.timer.daemon = True
        self.timer.start()


def cut_pod(cfg: Config, namespace: str, pod: str, parts: dict[str, str], to: str,
            eligible, prepare) -> PodCut:
    """The source pod's containers checked (eligible(bundle) -> reason or None; the list against
    them; prepare(member) -> the migration's preflight), then frozen together under guards."""
    from migrt.migration.migrate import MigrateRequest

    try:
        members = pod_members(cfg, namespace, pod)
    except PreconditionFailed as exc:
        raise NotEligible(str(exc)) from exc
    for m in members:
        bundle = Bundle.load(m.bundle)
        why = eligible(bundle) or (None if m.running else "it is not running")
        if why:
            raise NotEligible(f"container {m.name} ({m.cid[:12]}): {why}")
    problems = mismatch(members, parts, "the source pod")
    if problems:
        raise UsageError(f"pod {namespace}/{pod} cannot be pulled by this pod: {'; '.join(problems)}; nothing was "
                         "frozen")
    preps = {m.name: prepare(MigrateRequest(container_id=m.cid, to=to, root=m.root, lazy=True)) for m in members}
    runtime = cfg.runtime_path()
    cut = PodCut(f"{namespace}/{pod}", runtime, {m.name: m for m in members}, preps)
    for m in members:  # armed before the GPU lock and the freeze: a kill in between resumes what was done
        gpu = _gpu(preps[m.name])
        cut.guards[m.name] = Guard(f"pod-cut:{m.cid}", cfg.log_file)
        cut.guards[m.name].arm({"do": "resume", "runtime": runtime, "root": m.root, "cid": m.cid,
                                "gpu_pids": gpu.pids if gpu else []})
    gpus = [g for g in map(_gpu, preps.values()) if g is not None]
    try:  # the GPU containers' CUDA processes first: the driver's lock needs running tasks
        suspend_together(gpus)
        try:
            PodFreeze(LowerRuntime(runtime), members, cut.pod).freeze()
        except BaseException:  # PodFreeze thawed what it froze: now their GPU state, onto their own GPU
            for g in gpus:
                g.resume()
            raise
    except BaseException:
        for guard in cut.guards.values():
            guard.disarm()
        raise
    cut.early = start_early(runtime, members, preps, cut.guards)  # every part's dump at once
    return cut


def _gpu(prep: object) -> GpuSource | None:
    """The container's CUDA processes, when it has any (the migration's preflight probed them)."""
    gpu = getattr(prep, "gpu", None)
    return gpu if getattr(prep, "gpu_offer", None) and isinstance(gpu, GpuSource) else None

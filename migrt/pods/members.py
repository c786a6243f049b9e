"""A pod's containers on this node, and one cut for all of them (issue 29).

The rule: a pod is every application container whose CRI annotations name it (sandbox namespace and
name), found in the node's runc roots through each container's state.json and bundle, never its
sandbox (pause container); in creation order (runc's `created`), which is the order kubelet started
them in (native sidecars first). One cut: every running member is frozen (the cgroup freezer,
`runc pause` through the lower runtime) before anything is read from any of them; a freeze that
fails part-way thaws those it froze, in reverse order, and says which container failed. A member
that was paused before (by its user) is neither frozen nor thawed by us.

`scan` is the one walk over the runc roots (the agent's lookups by name use it too).
"""

from __future__ import annotations

import functools
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from migrt import jsonsafe
from migrt.config import Config
from migrt.errors import MigrtError, PreconditionFailed, RuntimeFailed, UsageError
from migrt.oci.bundle import Bundle
from migrt.runtime.runc import LowerRuntime, candidate_roots

_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # a Kubernetes container name (DNS label)
_CREATED = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?")


@dataclass(frozen=True)
class Member:
    cid: str       # runc container id
    name: str      # the container's name in the pod (CRI annotation io.kubernetes.cri.container-name)
    image: str     # io.kubernetes.cri.image-name ("" when unknown)
    root: str      # runc state root it lives in
    bundle: str
    running: bool

    def describe(self, pod: str = "") -> str:
        return f"container {self.name}{f' of pod {pod}' if pod else ''} ({self.cid[:12]})"


@dataclass(frozen=True)
class Found:
    """One container of the node: where runc keeps it, its state.json and its bundle."""
    root: str
    cid: str
    state: dict
    bundle: Bundle


def _state(root: str, cid: str) -> dict | None:
    try:
        with open(os.path.join(root, cid, "state.json"), encoding="utf-8") as fh:
            state = jsonsafe.load(fh)
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def state_bundle(root: str, cid: str) -> Bundle | None:
    """The bundle of container `cid` under runc root `root`, through its state.json; None when unreadable."""
    return Bundle.of_state(_state(root, cid))


def scan(cfg: Config) -> Iterator[Found]:
    """Every container of the node's runc roots whose state and bundle can be read."""
    for root in candidate_roots(cfg.runtime_roots):
        try:
            entries = os.listdir(root)
        except OSError:
            continue
        for cid in entries:
            state = _state(root, cid) if not cid.startswith(".") else None
            bundle = Bundle.of_state(state) if state is not None else None
            if state is not None and bundle is not None:
                yield Found(root, cid, state, bundle)


def _created(state: dict) -> tuple[str, int]:
    """runc's `created` (RFC 3339, nanoseconds with trailing zeros cut) as a sortable key."""
    m = _CREATED.match(str(state.get("created") or ""))
    if not m:
        return ("", 0)
    return (m.group(1), int((m.group(2) or "0").ljust(9, "0")[:9]))


def _running(runtime: LowerRuntime, root: str, cid: str) -> bool:
    try:
        return runtime.state(root, cid).status == "running"
    except MigrtError:
        return False  # gone meanwhile, unreadable: nothing of it to freeze


def pod_members(cfg: Config, namespace: str, pod: str,
                running: Callable[[str, str], bool] | None = None) -> list[Member]:
    """Every application container of pod namespace/pod on this node, in creation order;
    PreconditionFailed naming the pod when there is none. running(root, cid): a seam for tests
    (default: the lower runtime says `running`)."""
    if running is None:
        running = functools.partial(_running, LowerRuntime(cfg.runtime_path()))
    found = []
    for f in scan(cfg):
        meta = f.bundle.cri_metadata()
        if f.bundle.is_application_container and (meta.get("pod_namespace"), meta.get("pod_name")) == (namespace, pod):
            found.append(f)
    found.sort(key=lambda f: _created(f.state))
    if not found:
        raise PreconditionFailed(f"pod {namespace}/{pod}: no container of it on this node (runc roots: "
                                 f"{', '.join(candidate_roots(cfg.runtime_roots)) or 'none'}); is it running here?")
    return [Member(cid=f.cid, name=f.bundle.cri_metadata().get("container_name", f.cid),
                   image=f.bundle.cri_metadata().get("image_name", ""), root=f.root, bundle=f.bundle.path,
                   running=running(f.root, f.cid)) for f in found]


def parse_listed(text: object) -> dict[str, str]:
    """migrt.io/migrate-pod's value, the new pod's containers that take a part of a pod (a pod-level
    pull's or restore's): {container name: image ("" when not given)}; UsageError otherwise."""
    usage = f"migrt.io/migrate-pod {text!r}: expected <container>=<image>[,<container>=<image>...]"
    if not isinstance(text, str) or not text.strip():
        raise UsageError(usage)
    pairs = [tuple(x.strip() for x in entry.partition("=")[::2]) for entry in text.split(",")]
    return _checked_parts(pairs, usage)


def listed_parts(parts: object) -> dict[str, str]:
    """The same list as it travels in a pull's request ({container name: image}), held to the rules
    of parse_listed; UsageError otherwise."""
    usage = f"pull: malformed list of the pod's containers {parts!r}"
    if not isinstance(parts, dict) or not all(isinstance(v, str) for v in parts.values()):
        raise UsageError(usage)
    return _checked_parts(list(parts.items()), usage)


def _checked_parts(pairs: list, usage: str) -> dict[str, str]:
    """{name: image} of (name, image) pairs: every name a container name, once; images printable, no
    blank, no comma (the list's separator); at least one pair."""
    out: dict[str, str] = {}
    for name, image in pairs:
        if (not isinstance(name, str) or not _NAME.fullmatch(name) or name in out or not image.isprintable()
                or " " in image or "," in image):
            raise UsageError(usage)
        out[name] = image
    if not out:
        raise UsageError(usage)
    return out


def mismatch(source: Sequence[Member], target: Mapping[str, str], source_is: str = "the checkpoint") -> list[str]:
    """What keeps `target` (container name -> image) from taking the source's containers by name:
    one line per difference; [] when they match. `source_is` names what the target is compared with
    ("the checkpoint" for a pod restore, "the source pod" for a pod-level pull)."""
    have = {m.name: m.image for m in source}
    out = [f"container {name}: {source_is} has no container of that name (it has {', '.join(have) or 'none'})"
           for name in target if name not in have]
    out += [f"container {name}: the new pod has no container of that name" for name in have if name not in target]
    out += [f"container {name}: image {target[name]!r}, {source_is}'s is {have[name]!r}"
            for name in target if name in have and target[name] and have[name] and target[name] != have[name]]
    return out


class PodFreeze:
    """One cut: freeze() pauses every running member (in order); if one fails, those frozen so far are
    thawed and RuntimeFailed names the container. thaw() resumes what freeze() paused. As a context
    manager it freezes on entry and thaws on leaving (an exception or not) unless keep() was called
    (the caller then owns the frozen containers: it destroys or thaws them itself)."""

    def __init__(self, runtime: LowerRuntime, members: Sequence[Member], pod: str = "") -> None:
        self.runtime, self.members, self.pod = runtime, list(members), pod
        self.frozen: list[Member] = []
        self.freeze_s = 0.0
        self._kept = False

    def freeze(self) -> float:
        """Seconds from the first pause to the last."""
        t0 = time.monotonic()
        for m in self.members:
            if not m.running:
                continue
            try:
                self.runtime.pause(m.root, m.cid)
            except MigrtError as exc:
                problems = self._thaw_all()
                raise RuntimeFailed(f"pod {self.pod or '?'}: cannot freeze {m.describe()}: {exc.message}; the "
                                    f"containers frozen before it were thawed", details=problems) from exc
            self.frozen.append(m)
        self.freeze_s = time.monotonic() - t0
        return self.freeze_s

    def _thaw_all(self) -> list[str]:
        problems = []
        for m in reversed(self.frozen):
            try:
                self.runtime.resume(m.root, m.cid)
            except MigrtError as exc:
                problems.append(f"{m.describe()} stays frozen: {exc.message}")
        self.frozen = []
        return problems

    def thaw(self) -> None:
        """Resume every member freeze() paused; RuntimeFailed naming those that could not be."""
        problems = self._thaw_all()
        if problems:
            raise RuntimeFailed(f"pod {self.pod or '?'}: " + "; ".join(problems) + " (runc resume ID)")

    def keep(self) -> None:
        self._kept = True

    def __enter__(self) -> PodFreeze:
        self.freeze()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._kept or not self.frozen:
            return
        if exc is None:
            self.thaw()
            return
        problems = self._thaw_all()  # the failure goes on up, with what could not be undone
        if problems and isinstance(exc, MigrtError):
            exc.details.extend(problems)

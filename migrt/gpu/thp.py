"""Transparent huge pages while the NVIDIA driver writes its checkpoint (config `gpu_checkpoint_thp`).

The driver's checkpoint (cuCheckpointProcessCheckpoint) copies a process's GPU memory into one private
anonymous mapping it creates inside the process, faulting it in as it writes (~2 GB/s). The mapping
is not madvised, so under THP `madvise` (most distributions' default) it gets 4 KiB pages, under
`always` 2 MiB ones: 16 GiB took 5.75 s instead of 8-10 s (H200). Nothing turns huge pages on for a
mapping another program creates in a process (process_madvise refuses MADV_HUGEPAGE, prctl only turns
them off), so `gpu_checkpoint_thp: always` writes `always` into the node-wide `enabled` file for the
window in which the driver writes (the checkpoint calls, after the lock) and puts the value it found
back right after. `keep` (the default) never touches it. `defrag` is left alone: under its default
`madvise` a fault in a mapping that is not madvised takes a huge page only when one is free and never
stalls to compact memory, so the window cannot slow the driver (or anyone else) down.

The rule, for several migrt processes checkpointing at once and for any of them being killed:
- a state file, STATE_DIR/thp.json, changed only under an flock on STATE_DIR/thp.lock, holds the
  value found before the first holder switched (`before`) and who holds the window (`holders`:
  pid, start time and a token per window, so that two windows of one process are told apart);
- entering: holders whose process is gone (no such pid, or another start time) are dropped; the
  first holder records `before` and itself, and only then writes `always` (a migrt killed between
  the two leaves a record the next one settles); later holders add themselves;
- leaving: the holder removes itself; the last one puts `before` back, unless the file no longer
  says `always` (whoever changed it meanwhile is not overruled), and removes the state file;
- `repair()` (`migrt doctor`) and every entry settle what dead holders left: with no live holder,
  `before` goes back;
- a file that cannot be written (read-only /sys in a container, not root; or STATE_DIR): one
  warning per process, and the checkpoint goes on at the current setting.
Tests point ENABLED and STATE_DIR at temporary files.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import uuid
from collections.abc import Iterator

from migrt import jsonsafe
from migrt import log as log_mod
from migrt.gpu import procs
from migrt.kernel.files import atomic_file
from migrt.text import printable

ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"  # test seam
STATE_DIR = "/run/migrt"  # test seam
SETTINGS = ("keep", "always")
ALWAYS, KEPT, FAILED = "always", "kept", "failed"  # what a window did (Window.applied)
MAX_STATE = 1 << 20  # bytes of the state file
MAX_STATE_DEPTH = 8  # {"holders": [{...}]} needs three levels
_warned = False


def state_path() -> str:
    return os.path.join(STATE_DIR, "thp.json")


def current(path: str | None = None) -> str | None:
    """'always' | 'madvise' | 'never' (the bracketed word of the kernel's file), None if unknown."""
    try:
        with open(path or ENABLED, encoding="ascii") as fh:
            text = fh.read()
    except (OSError, ValueError):
        return None
    m = re.search(r"\[(\w+)\]", text)
    word = m.group(1) if m else text.strip()  # a stand-in file holds the word written last
    return word if word.isalpha() else None


def _set(value: str) -> None:
    with open(ENABLED, "w", encoding="ascii") as fh:
        fh.write(value)


class Window:
    """`with Window(setting):` around the driver's checkpoint calls; reusable (suspend_all retries).
    `applied` says what the last window did: 'always' (in effect), 'kept' (setting keep) or 'failed'
    (always asked for, not possible here: warned once, the checkpoint ran at the current setting)."""

    def __init__(self, setting: str = "keep") -> None:
        self.setting = setting
        self.applied = KEPT
        self._token: str | None = None

    def __enter__(self) -> Window:
        self._token = None
        if self.setting != ALWAYS:
            self.applied = KEPT
            return self
        token = uuid.uuid4().hex
        try:
            held = _enter(token)
        except OSError as exc:
            _warn_once(f"cannot switch transparent huge pages to always for the GPU checkpoint: {exc}")
            self.applied = FAILED
            return self
        self._token = token if held else None
        self.applied = ALWAYS
        return self

    def __exit__(self, *exc_info) -> None:
        if self._token:
            token, self._token = self._token, None
            try:
                _leave(token)
            except OSError as exc:
                log_mod.get().error("gpu_checkpoint_thp_not_put_back", path=ENABLED, state=state_path(),
                                    error=str(exc), fix="run 'migrt doctor' as root")


def window(cfg) -> Window:
    """The window the config asks for (`gpu_checkpoint_thp`; keep without one)."""
    return Window(getattr(cfg, "gpu_checkpoint_thp", "keep") or "keep")


def repair() -> dict:
    """Settle what migrt processes that died left (`migrt doctor`): {"holders": live holders,
    "dropped": dead ones, "put_back": the value written back or None, "before": the recorded value;
    "damaged": what is wrong, for a state file that holds no state, set aside}.
    Raises OSError when the state cannot be read or the value cannot be written."""
    if not os.path.exists(state_path()):
        return {"holders": [], "dropped": [], "put_back": None, "before": None}
    with _locked():
        try:
            state = _read()
        except StateDamaged as exc:
            return {"holders": [], "dropped": [], "put_back": None, "before": None, "damaged": str(exc)}
        if state is None:
            return {"holders": [], "dropped": [], "put_back": None, "before": None}
        before = state.get("before")
        state, done = _settle(state, changed=False)
    return {"holders": state["holders"] if state else [], "before": before, **done}


# -- under the lock ----------------------------------------------------------------------------------
def _enter(token: str) -> bool:
    """True when this window holds the switch (to be left), False when `always` was set already."""
    with _locked():
        state = _read_or_none()
        if state is not None:
            state, _ = _settle(state, changed=False)
        me = {"pid": os.getpid(), "start_time": procs.start_time(os.getpid()), "token": token}
        if state is not None:
            state["holders"].append(me)
            _save(state)
            return True
        now = current()
        if now is None:
            raise OSError(errno.ENOENT, "cannot read the setting", ENABLED)
        if now == ALWAYS:
            return False  # nothing to switch, nothing to put back
        _save({"before": now, "holders": [me]})  # first: a migrt killed after the switch leaves the way back
        try:
            _set(ALWAYS)
        except OSError:
            _remove()
            raise
        log_mod.get().info("gpu_checkpoint_thp", switched="always", before=now, path=ENABLED)
        return True


def _leave(token: str) -> None:
    with _locked():
        state = _read_or_none()
        if state is None:
            return
        state["holders"] = [h for h in state["holders"] if h.get("token") != token]
        _settle(state, changed=True)


def _settle(state: dict, changed: bool) -> tuple[dict | None, dict]:
    """Drop the holders that died; with none left, put `before` back and remove the state file.
    Returns (the state, None once removed; {"dropped": [...], "put_back": value or None})."""
    live = [h for h in state["holders"] if _alive(h)]
    dropped = [h for h in state["holders"] if h not in live]
    if dropped:
        log_mod.get().warning("gpu_checkpoint_thp_holder_gone", holders=dropped, before=state.get("before"))
    if live:
        state["holders"] = live
        if changed or dropped:
            _save(state)
        return state, {"dropped": dropped, "put_back": None}
    before, put_back = state.get("before"), None
    if isinstance(before, str) and before != ALWAYS and current() == ALWAYS:
        _set(before)
        put_back = before
        log_mod.get().info("gpu_checkpoint_thp", put_back=before, path=ENABLED)
    _remove()
    return None, {"dropped": dropped, "put_back": put_back}


def _alive(holder: dict) -> bool:
    pid = holder.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0 or not procs.alive(pid):
        return False
    return holder.get("start_time") is None or procs.start_time(pid) == holder.get("start_time")


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    os.makedirs(STATE_DIR, mode=0o700, exist_ok=True)
    fd = os.open(os.path.join(STATE_DIR, "thp.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class StateDamaged(ValueError):
    """The state file holds no state (not JSON, too large or too deep, another shape); it was set aside."""


def _read() -> dict | None:
    """The state, None without one. Content that is no state (read with the bounded JSON reader: a
    deeply nested file is not a RecursionError) raises StateDamaged once the file is set aside."""
    try:
        with open(state_path(), "rb") as fh:
            data = jsonsafe.load(fh, max_bytes=MAX_STATE, max_depth=MAX_STATE_DEPTH)
    except FileNotFoundError:
        return None
    except ValueError as exc:  # JSONRejected, not JSON, not UTF-8
        raise _damaged(exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)) from exc
    if not isinstance(data, dict) or not isinstance(data.get("holders"), list):
        raise _damaged("no object with a 'holders' list")
    data["holders"] = [h for h in data["holders"] if isinstance(h, dict)]
    return data


def _damaged(reason: str) -> StateDamaged:
    """Set the damaged file aside (kept for a look, out of the way of the next window) and say so."""
    path, aside = state_path(), state_path() + ".damaged"
    with contextlib.suppress(OSError):
        os.replace(path, aside)
    now = current()
    msg = (f"{path} is damaged ({printable(reason, 120)}); set aside as {aside}: the value of {ENABLED} to put "
           f"back after a GPU checkpoint is lost, and it says {now or 'nothing readable'} now; write the node's "
           "usual value there (e.g. madvise) if that is not it")
    log_mod.get().warning("gpu_checkpoint_thp_state_damaged", path=path, aside=aside, reason=printable(reason, 120),
                          enabled=now)
    return StateDamaged(msg)


def _read_or_none() -> dict | None:
    """_read(), a damaged file counting as none (the window goes on as the first holder)."""
    try:
        return _read()
    except StateDamaged:
        return None


def _save(state: dict) -> None:
    """Whole or not at all (kernel/files.py's atomic write): a migrt killed while writing leaves the old state."""
    with atomic_file(state_path(), text=True) as fh:
        json.dump(state, fh, sort_keys=True)


def _remove() -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(state_path())


def _warn_once(message: str) -> None:
    global _warned
    log = log_mod.get()
    if _warned:
        log.debug("gpu_checkpoint_thp_unchanged", error=message, path=ENABLED)
        return
    _warned = True
    log.warning("gpu_checkpoint_thp_unchanged", error=message, path=ENABLED,
                note="the GPU checkpoint goes on at the current setting (gpu_checkpoint_thp: always needs root "
                     "and a writable /sys)")

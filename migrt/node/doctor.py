"""`migrt doctor`: node checks, each with a status (ok | warn | fail), a detail and how to fix it."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from typing import TYPE_CHECKING

from migrt import trust
from migrt.criu.binary import chosen as criu_choice
from migrt.criu.version import (
    MIN_CONTAINERD,
    MIN_CRIU,
    MIN_RUNC,
    criu_version,
    kernel_version,
    parse_version,
    run_query,
    runtime_version,
)
from migrt.errors import MigrtError
from migrt.node.doctor_containerd import containerd_handler_check
from migrt.node.doctor_gpu import gpu_checks
from migrt.node.doctor_install import install_checks
from migrt.runtime.lower import configured_value
from migrt.trust import Untrusted

if TYPE_CHECKING:
    from migrt.config import Config


def _check(name: str, status: str, detail: str, fix: str = "") -> dict:
    return {"name": name, "status": status, "detail": detail, "fix": fix}


def _criu_feature(crit: str, feature: str) -> bool:
    try:
        return run_query([crit, "check", "--feature", feature], 30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _page_filler_check(cfg, criu_uffd: bool) -> dict:
    """Can restores fill memory with migrt's page filler here (restore_pages auto|lazy)?"""
    from migrt.pagefill.uffd import usable

    mode = cfg.restore_pages if cfg else "auto"
    why = usable() or (None if criu_uffd else "CRIU cannot restore with --lazy-pages here (uffd-noncoop)")
    if why:
        return _check("page filler (lazy restore)", "warn" if mode != "eager" else "ok",
                      f"not usable: {why}" + ("; restores copy eagerly" if mode == "auto" else ""),
                      ("restore_pages: lazy will fail here; use auto or eager" if mode == "lazy" else
                       "nothing to do (restores copy eagerly); for faster restores: a kernel with CONFIG_USERFAULTFD "
                       "and the fork/remap/remove/unmap events (Linux >= 4.11), run as root"))
    return _check("page filler (lazy restore)", "ok",
                  f"usable (restore_pages: {mode}" + (", set auto to use it" if mode == "eager" else "") + ")")


def run_checks() -> list[dict]:
    cfg, out = _config_checks()
    out += _criu_checks(cfg)
    runtime, runtime_checks = _runtime_checks(cfg)
    out += runtime_checks
    out += install_checks()
    out += _containerd_checks()
    out.append(_check("iptables", "ok" if shutil.which("iptables") else "warn",
                      shutil.which("iptables") or "not found",
                      "CRIU needs iptables to lock the network of containers with their own netns"))
    out += gpu_checks(runtime, thp_mode=cfg.gpu_checkpoint_thp if cfg else "keep")
    out.append(_check("kernel", "ok", kernel_version()))
    if cfg:
        out.append(_store_check(cfg.store))
        out.append(_store_pages_check(cfg.store))
        out.append(_recovery_check(cfg.store))
    return out


def _config_checks() -> tuple[Config | None, list[dict]]:
    """The node's config (None when it is refused or malformed) and the checks of it and of the files it
    trusts."""
    from migrt import config

    try:
        cfg = config.load()
    except Untrusted as exc:
        return None, [_check("config", "fail", str(exc), "every migrt command and migrt-runc refuse it until it is "
                             "fixed")]
    except MigrtError as exc:
        return None, [_check("config", "fail", str(exc), "fix the file or point MIGRT_CONFIG at a valid one")]
    return cfg, [_check("config", "ok", f"{cfg.path}" + ("" if cfg.loaded else " (absent: defaults in use)")),
                 trusted_files_check(cfg)]


def _criu_checks(cfg: Config | None) -> list[dict]:
    """Which CRIU, its version and `criu check`, then the kernel features the lazy paths need."""
    setup = "run packaging/setup-host.sh (builds migrt's own CRIU 4.2 into /opt/migrt/criu)"
    crit, why = criu_choice(configured_value("criu", cfg.path if cfg else None))
    if not crit:
        return [_check("criu", "fail", why, setup)]
    v = criu_version()
    ok = parse_version(v) >= MIN_CRIU
    out = [_check("criu", "ok" if ok else "fail", f"{crit} version {v} ({why})",
                  "" if ok else f"CRIU >= {'.'.join(map(str, MIN_CRIU))} is needed on kernel "
                                f"{kernel_version()}; {setup}")]
    try:
        res = run_query([crit, "check"], 60)  # from a private directory: a relative log-file in CRIU's config
        text = (res.stdout + res.stderr).strip().splitlines()
        out.append(_check("criu check", "ok" if res.returncode == 0 else "fail",
                          text[-1] if text else f"exit {res.returncode}",
                          "see 'criu check' output; usually a kernel config or missing capability"))
    except (OSError, subprocess.TimeoutExpired) as exc:
        out.append(_check("criu check", "fail", str(exc), "run 'criu check' by hand"))
    uffd = _criu_feature(crit, "uffd-noncoop")
    out.append(_check("lazy pages (userfaultfd)", "ok" if uffd else "warn",
                      "available" if uffd else "not available",
                      "" if uffd else "kernel needs CONFIG_USERFAULTFD; lazy migration is disabled"))
    from migrt.criu.lazy import lazy_problem

    problem = lazy_problem("source")
    out.append(_check("lazy migration page server", "warn" if problem else "ok",
                      problem or "can serve pages (migrt's page server)",
                      "see docs/migration.md, 'Lazy migration: how the pages travel'" if problem else ""))
    out.append(_page_filler_check(cfg, uffd))
    sd = _criu_feature(crit, "mem_dirty_track")
    out.append(_check("pre-dump (soft-dirty)", "ok" if sd else "warn",
                      "available" if sd else "not available (CONFIG_MEM_SOFT_DIRTY unset)",
                      "" if sd else "pre-dump rounds cannot be incremental here; migrations use stop-and-copy "
                                    "or lazy pages"))
    return out


def _runtime_checks(cfg: Config | None) -> tuple[str | None, list[dict]]:
    """The lower runtime the config names (None when none is usable) and its check."""
    try:
        runtime = cfg.runtime_path() if cfg else None
    except Untrusted as exc:
        return None, [_check("lower runtime", "fail", str(exc), "migrt-runc refuses to run it until it is fixed")]
    except MigrtError as exc:
        return None, [_check("lower runtime", "fail", str(exc), "install runc or set 'runtime:' in the config")]
    if not runtime:
        return None, []
    rv = runtime_version(runtime)
    old = os.path.basename(runtime).startswith("runc") and parse_version(rv) < MIN_RUNC
    return runtime, [_check("lower runtime", "fail" if old else "ok", f"{runtime} version {rv}",
                            f"migrt needs runc >= {'.'.join(map(str, MIN_RUNC))}: upgrade the node's runc"
                            if old else "")]


def _containerd_checks() -> list[dict]:
    """containerd's version and migrt's handler in its config (a warning when it is not installed: needed
    only for Kubernetes)."""
    ctrd = shutil.which("containerd")
    if not ctrd:
        return [_check("containerd", "warn", "not found", "needed only for Kubernetes/containerd use")]
    try:
        v = subprocess.run([ctrd, "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        v = "?"
    m = re.search(r"\s(v?\d+\.\d+[.\d]*)", v)
    old = m is not None and parse_version(m.group(1).lstrip("v")) < MIN_CONTAINERD
    return [_check("containerd", "fail" if old else "ok", v,
                   f"migrt needs containerd >= {'.'.join(map(str, MIN_CONTAINERD))}" if old else ""),
            containerd_handler_check()]


def trusted_files_check(cfg) -> dict:
    """The key, TLS and registry files the config names: root's (or ours) and written by nobody else,
    the secrets read by nobody else (migrt/trust.py); migrt refuses them otherwise when it needs them."""
    files = [(cfg.migration_key_file, "migration_key_file", True), (cfg.registry_auth_file, "registry_auth_file", True),
             (cfg.registry_ca_file, "registry_ca_file", False)]
    for key, path in sorted((cfg.migration_tls or {}).items()):
        files.append((path, f"migration_tls {key}", key == "key"))
    named = [(p, what, secret) for p, what, secret in files if p]
    if not named:
        return _check("trusted files", "ok", "the config names no key, TLS or registry file")
    bad = []
    for path, what, secret in named:
        if not os.path.exists(path):
            bad.append(f"{what} {path} does not exist")
        elif why := trust.problem(path, secret=secret):
            bad.append(f"{what} {path}: {why}")
    if bad:
        return _check("trusted files", "fail", "; ".join(bad), "migrt refuses these files until they are fixed")
    return _check("trusted files", "ok", ", ".join(f"{what} {p}" for p, what, _ in named))


def _recovery_check(root: str) -> dict:
    """Interrupted operations (journal entries whose migrt is gone) and images kept from them."""
    from migrt.store import Store, journal

    try:
        Store(root).check()
    except MigrtError:
        return _check("recovery", "warn", "not checked: the store is refused (see the store check)")
    stale = [e for e in journal.entries(root) if e.get("stale")]
    kept = Store(root).incomplete()
    if stale:
        what = ", ".join(f"{e.get('op')} of {e.get('container') or e.get('name')} at {e.get('phase')}"
                         for e in stale[:3])
        return _check("recovery", "fail", f"{len(stale)} interrupted operation(s) not recovered: {what}",
                      "run 'migrt recover' (it thaws frozen containers and resumes their GPU processes)")
    if kept:
        return _check("recovery", "warn", f"{len(kept)} incomplete checkpoint(s) kept under {root}/.incomplete "
                      "(their containers were gone before the commit)",
                      "'migrt recover --list' shows them; inspect them, then remove them by hand")
    return _check("recovery", "ok", "no interrupted operation")


def _store_check(root: str) -> dict:
    fix = f"install -d -m 0700 -o root -g root {root}"
    try:
        st = os.stat(root)
    except FileNotFoundError:
        return _check("store", "warn", f"{root} does not exist yet (created on first checkpoint)", fix)
    except OSError as exc:
        return _check("store", "fail", f"{root}: {exc}", fix)
    from migrt.store.store import unsafe_root

    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != 0 or mode & 0o077:
        return _check("store", "fail", f"{root} is owned by uid {st.st_uid} with mode {mode:o}; must be root, 0700",
                      fix)
    why = unsafe_root(root)  # what every command refuses (the directories above it too)
    if why:
        return _check("store", "fail", f"{why}; every migrt command refuses this store", fix)
    return _check("store", "ok", f"{root} (root, 0700)")


def _store_pages_check(root: str) -> dict:
    """A tmpfs store in 4 KiB pages: every byte a receive or a parallel dump writes lands in a fresh
    small page, which bounds them (store/hugetmpfs.py); its own tmpfs with huge=within_size does not."""
    from migrt.store import hugetmpfs

    m = hugetmpfs.mount_of(root)
    if m is None:
        return _check("store pages", "warn", "not checked: /proc/self/mountinfo cannot be read")
    if not m.tmpfs:
        return _check("store pages", "ok", f"{root} is on {m.fstype} (mounted on {m.point}), not tmpfs")
    if m.huge_pages:
        why = "shmem_enabled=force" if m.shmem_enabled == "force" else f"huge={m.huge}"
        return _check("store pages", "ok", f"{root} is on a tmpfs with huge pages ({m.point}, {why})")
    if m.shmem_enabled == "deny":
        why = "shmem_enabled=deny"
        fix = "/sys/kernel/mm/transparent_hugepage/shmem_enabled says deny: no tmpfs gets huge pages"
    elif m.point == os.path.realpath(root):
        why, fix = f"huge={m.huge}", f"mount -o remount,huge=within_size {m.point} (this mount only; docs/install.md)"
    else:
        why = f"huge={m.huge}"
        fix = (f"give the store a tmpfs of its own, in huge pages (this mount only, not the node's; it hides what "
               f"is under {root} now: empty it first): {hugetmpfs.mount_hint(root)} (docs/install.md)")
    return _check("store pages", "warn",
                  f"{root} is on a tmpfs in 4 KiB pages ({m.point}, {why}): receives and parallel dumps land every "
                  "byte in a fresh 4 KiB page, about half the write rate of 2 MiB pages", fix)

"""`migrt doctor`'s GPU checks: driver and checkpoint API, persistence mode, transparent huge pages
(and the window `gpu_checkpoint_thp: always` opens: one a migrt that died left at `always` is put back
here), the lower runtime for GPU containers, the CRIU hook. Without an NVIDIA driver: one 'warn: no GPU'."""

from __future__ import annotations

import glob
import os

from migrt import trust
from migrt.gpu import inventory
from migrt.gpu import thp as thp_mod
from migrt.gpu.cuda import LIBCUDA, CudaDriverBackend
from migrt.node.doctor_install import SETUP, script_problem
from migrt.node.launchers import read_installed

CRIU_CONFIGS = ("/etc/criu/runc.conf", "/etc/criu/default.conf")
CDI_SPECS = ("/etc/cdi/nvidia*.yaml", "/etc/cdi/nvidia*.json", "/var/run/cdi/nvidia*.yaml", "/var/run/cdi/nvidia*.json")
REMAP_DRIVER = (580,)  # restore onto other GPUs (UUID pairs) needs r580+
MIN_DRIVER = (570,)    # the process checkpoint API


def _check(name: str, status: str, detail: str, fix: str = "") -> dict:
    return {"name": name, "status": status, "detail": detail, "fix": fix}


def thp_setting(path: str | None = None) -> str | None:
    """'always' | 'madvise' | 'never' (the bracketed one), None if unknown."""
    return thp_mod.current(path)


def action_script(configs: tuple[str, ...] | None = None) -> tuple[str, str] | None:
    """(config file, script) of the first `action-script` line in CRIU's config files."""
    for conf in configs or CRIU_CONFIGS:
        try:
            with open(conf, encoding="utf-8") as fh:
                for line in fh:
                    words = line.split("#", 1)[0].split()
                    if len(words) == 2 and words[0] in ("action-script", "--action-script"):
                        return conf, words[1].strip("\"'")
        except OSError:
            continue
    return None


def gpu_checks(runtime: str | None = None, *, backend: CudaDriverBackend | None = None,
               inv: inventory.Inventory | None = None, thp_mode: str = "keep") -> list[dict]:
    """thp_mode: the config's gpu_checkpoint_thp."""
    inv = inv or inventory.take(with_processes=False)
    if not inv.available:
        return [_check("gpu", "warn", f"no GPU: {inv.error}",
                       "nothing to do on a node without GPUs; GPU checkpoints restore only on GPU nodes")]
    out = []
    models = sorted({g.name for g in inv.gpus})
    summary = ", ".join(f"{sum(g.name == m for g in inv.gpus)} x {m}" for m in models) or "no GPU listed"
    version = inventory.parse_version(inv.driver_version)
    status = "ok" if version >= MIN_DRIVER else "fail"
    out.append(_check("gpu driver", status, f"NVIDIA {inv.driver_version}; {summary} (from {inv.source})",
                      "" if status == "ok" else "the CUDA process checkpoint API needs driver r570 or newer"))
    backend = backend or CudaDriverBackend(os.environ.get("MIGRT_CUDA_LIBRARY") or LIBCUDA)
    if backend.available():
        api = backend.driver_api_version()
        detail = "cuCheckpointProcess* present" + (f" (driver API {api // 1000}.{api % 1000 // 10})" if api else "")
        if version and version < REMAP_DRIVER:
            out.append(_check("gpu checkpoint API", "warn", detail + "; no restore onto other GPUs before r580",
                              "upgrade the driver to r580+ to restore onto GPUs with other UUIDs"))
        else:
            out.append(_check("gpu checkpoint API", "ok", detail))
    else:
        out.append(_check("gpu checkpoint API", "fail", backend.unavailable_reason() or "unusable",
                          "install an NVIDIA driver r570+ (r580+ for restore onto other GPUs)"))
    off = [str(g.index) for g in inv.gpus if g.persistence_mode is False]
    if inv.source != "nvml":
        out.append(_check("gpu persistence mode", "warn", "unknown (pynvml not usable)", "install nvidia-ml-py"))
    elif off:
        out.append(_check("gpu persistence mode", "warn", f"off on GPU(s) {', '.join(off)}",
                          "run nvidia-persistenced (or 'nvidia-smi -pm 1'): otherwise the driver tears a GPU down "
                          "when its last process stops, and every restore pays its initialisation again"))
    else:
        out.append(_check("gpu persistence mode", "ok", "on"))
    out += thp_checks(thp_mode)
    out.append(_runtime_check(runtime))
    out.append(_hook_check())
    out.append(_target_check(out, inv, version))
    return out


def thp_checks(mode: str) -> list[dict]:
    """The THP setting, and the window of gpu_checkpoint_thp: one left by a migrt that died is put
    back here (gpu/thp.py repair); one held by live migrt processes is said to be temporary."""
    out, held = [], []
    name = "gpu checkpoint THP window"
    try:
        found = thp_mod.repair()
    except OSError as exc:
        out.append(_check(name, "fail", f"{thp_mod.state_path()}: {exc}",
                          f"run 'migrt doctor' as root: it puts back the value of {thp_mod.ENABLED} a migrt that "
                          "died during a GPU checkpoint left at always"))
    else:
        held = [h.get("pid") for h in found["holders"]]
        dead = ", ".join(str(h.get("pid")) for h in found["dropped"])
        if found["put_back"]:
            out.append(_check(name, "warn", f"THP left at always by a migrt that died (pid {dead}) during a GPU "
                                             f"checkpoint: put back to {found['put_back']} now",
                               "nothing left to do; the checkpoint of that migrt failed ('migrt recover')"))
        elif found["dropped"]:
            out.append(_check(name, "ok", f"dropped the record of migrt pid {dead} (died during a GPU checkpoint)"))
        if found.get("damaged"):
            out.append(_check(name, "warn", found["damaged"], "check the THP setting by hand (see the detail)"))
    setting = thp_setting()
    measured = ("measured on an H200 with 16 GB on the GPU: the driver's checkpoint 5.75 s instead of 8-10 s; with "
                "always node-wide the whole GPU round trip was 1.57x faster (37.4 s -> 23.8 s)")
    if held:
        out.append(_check("transparent huge pages", "ok",
                          f"always while migrt pid {', '.join(map(str, held))} checkpoints GPU processes "
                          f"(gpu_checkpoint_thp), {found['before']} otherwise"))
    elif setting == "always":
        out.append(_check("transparent huge pages", "ok", "always"))
    elif mode == "always" and not os.access(thp_mod.ENABLED, os.W_OK):
        out.append(_check("transparent huge pages", "warn", f"{setting or 'unknown'}; gpu_checkpoint_thp: always, "
                          f"but {thp_mod.ENABLED} is not writable here: checkpoints run at {setting or 'this setting'}",
                          "run migrt as root with /sys writable (not read-only, as in a container), or set THP to "
                          "always on the node"))
    elif mode == "always":
        out.append(_check("transparent huge pages", "ok", f"{setting or 'unknown'}; always while the NVIDIA driver "
                          "writes a checkpoint (gpu_checkpoint_thp: always)"))
    else:
        out.append(_check("transparent huge pages", "warn", f"{setting or 'unknown'}",
                          "set 'gpu_checkpoint_thp: always' in the migrt config: migrt then switches THP to always "
                          "node-wide only while the driver writes its checkpoint and puts the value back (docs/gpu.md, "
                          f"Faster driver checkpoints); {measured}"))
    return out


def _target_check(found: list[dict], inv: inventory.Inventory, version: tuple) -> dict:
    """One line for `migrt migrate`'s sender and for people: can this node take GPU containers?"""
    name = "gpu containers (restore and migrate here)"
    blocking = [c for c in found if c["name"] in ("gpu driver", "gpu checkpoint API") and c["status"] == "fail"]
    if blocking:
        return _check(name, "fail", "no: " + "; ".join(f"{c['name']}: {c['detail']}" for c in blocking),
                      blocking[0]["fix"])
    free = ", ".join(f"GPU {g.index} {g.name} {g.memory_free / (1 << 30):.1f} GiB free" for g in inv.gpus
                     if g.memory_free is not None) or "free memory unknown (no NVML: the preflight cannot check it)"
    remap = ("onto any GPU of the same model (UUID remap)" if version >= REMAP_DRIVER
             else "only onto the GPUs they left (driver < r580: no UUID remap)")
    return _check(name, "ok" if inv.source == "nvml" else "warn", f"yes, {remap}; {free}",
                  "" if inv.source == "nvml" else "install nvidia-ml-py so that the preflight checks free memory")


def _runtime_check(runtime: str | None) -> dict:
    name = "gpu container runtime"
    base = os.path.basename(runtime or "")
    if "nvidia" in base:
        return _check(name, "ok", f"lower runtime {runtime} (the NVIDIA container runtime)")
    cdi = sorted(p for pattern in CDI_SPECS for p in glob.glob(pattern))
    if cdi:
        return _check(name, "ok", f"lower runtime {runtime or '?'}; CDI spec {cdi[0]} gives containers their GPUs")
    return _check(name, "warn", f"lower runtime {runtime or '?'}, no NVIDIA CDI spec",
                  "set 'runtime: nvidia-container-runtime' in the migrt config, or generate a CDI spec "
                  "('nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml'), so containers get their GPUs")


def _hook_check() -> dict:
    name = "gpu CRIU hook"
    found = action_script()
    if found is None:
        return _check(name, "ok", "not installed: migrt drives the GPU on its own paths (migrt, migrt-runc)",
                      "")
    conf, script = found
    wrapped = (read_installed(script) or {}).get("hook")  # migrt's wrapper runs this script with its Python
    untrusted = trust.problem(conf) or trust.problem(script) or (trust.problem(wrapped) if wrapped else None)
    if untrusted:  # CRIU runs it as root at every dump and restore (and this check would run it too)
        return _check(name, "fail", f"{script} (from {conf}): {untrusted}",
                      "CRIU runs the action script as root: only root may be able to change it and its config")
    if not os.access(script, os.X_OK):
        return _check(name, "fail", f"{conf} names action-script {script}, which is not executable",
                      "install hooks/cuda-criu-action there (docs/gpu.md) or remove the line: CRIU fails without it")
    problem = script_problem(script)
    if problem:
        return _check(name, "fail", f"{script} (from {conf}) cannot start: {problem}",
                      f"{SETUP} (it installs the hook bound to migrt's interpreter), or fix the action-script line")
    return _check(name, "ok", f"{script} (from {conf}): plain runc/criu/podman dumps handle GPU state too")

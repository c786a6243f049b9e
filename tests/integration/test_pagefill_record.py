"""The manifest's survey of the images (`pagefill`) with the real runc and CRIU: `migrt checkpoint`
records what the page filler would have to copy; a restoring `migrt-runc create` under `auto` takes
the lazy figure from there instead of planning the images before its first CRIU call; a checkpoint
without the record (written by an older migrt) is planned as before; and images the guard refuses
although the record said they could be filled fail the restore before the container ever ran, with
the guard's reason, the checkpoint untouched."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import struct
import subprocess
import time
import uuid

import pytest

from migrt.criu import protobuf as protobuf_mod
from migrt.pagefill import images as images_mod
from tests.integration.conftest import SHIM, run_cli
from tests.integration.test_pagefill import Lines, _bundle, _gone, binaries, runc_root  # noqa: F401 (fixtures)

pytestmark = pytest.mark.integration
MIB = 320  # above fill_min_mib's default (256): auto picks the filler


def _uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("MIGRT_RESTORE_PAGES", "MIGRT_FILL_FAULT",
                                                               "MIGRT_FILL_PACE_MIBS")}


def _checkpoint(runc_root: str, binaries: dict, tmp_path, name: str) -> str:
    """memhog MIB checkpointed as `name`; returns memhog's checksum."""
    sid = _uid("rs")
    r, w = os.pipe()
    subprocess.run(["runc", "--root", runc_root, "run", "-d", sid],
                   cwd=_bundle(str(tmp_path / f"src-{name}"), ["/bin/memhog", str(MIB)], binaries),
                   stdin=subprocess.DEVNULL, stdout=w, stderr=w, check=True, timeout=60)
    os.close(w)
    ready = Lines(r).wait_for(lambda ls: any(ln.startswith("ready") for ln in ls))
    run_cli("checkpoint", sid, "--root", runc_root, "--name", name)
    return next(ln.split()[1] for ln in ready if ln.startswith("ready"))


def _create(runc_root: str, bundle: str, cid: str, log: str) -> tuple[int, Lines]:
    r, w = os.pipe()
    res = subprocess.run([SHIM, "--root", runc_root, "--log", log, "--log-format", "json", "create", "--bundle",
                          bundle, "--pid-file", os.path.join(bundle, "init.pid"), cid], cwd=bundle,
                         stdin=subprocess.DEVNULL, stdout=w, stderr=w, timeout=120, env=_env())
    os.close(w)
    return res.returncode, Lines(r)


def _restored(log_file: str, cid: str) -> dict:
    return [json.loads(ln) for ln in open(log_file) if '"restored"' in ln and cid in ln][-1]


def _sum_after_usr1(pid: int, out: Lines) -> str:
    os.kill(pid, signal.SIGUSR1)
    lines = out.wait_for(lambda ls: any(ln.startswith("sum") for ln in ls))
    return next(ln.split()[1] for ln in lines if ln.startswith("sum"))


def _manifest(store: str, name: str) -> tuple[str, dict]:
    path = os.path.join(store, name, "manifest.json")
    with open(path) as fh:
        return path, json.load(fh)


def test_create_takes_the_lazy_figure_from_the_manifest(runc_root, migrt_config, binaries, tmp_path):
    name = _uid("rec")
    want = _checkpoint(runc_root, binaries, tmp_path, name)
    path, data = _manifest(migrt_config["store"], name)
    images = os.path.join(migrt_config["store"], name, "images")
    planned = images_mod.plan(images).lazy_bytes
    assert planned >= MIB << 20
    assert data["pagefill"] == {"rules": images_mod.RULES, "fillable": True, "lazy_bytes": planned}
    assert data["timings"]["pagefill_s"] >= 0

    # 1. recorded: decided from the manifest; the tree waited at the gate for the guard's own plan
    did = _uid("rec-d")
    dst = _bundle(str(tmp_path / "d1"), ["true"], binaries, env=[f"MIGRT_RESTORE={name}"])
    rc, out = _create(runc_root, dst, did, str(tmp_path / "log1.json"))
    assert rc == 0, open(tmp_path / "log1.json").read()
    ev = _restored(migrt_config["log"], did)
    assert ev["pages"]["mode"] == "lazy" and ev["pages"]["requested"] == "auto"
    assert ev["pages"]["lazy_bytes_from"] == "manifest" and ev["pages"]["lazy_bytes"] == planned
    assert "decided_on_lazy_bytes" not in ev["pages"]  # the guard planned what the record said
    assert ev["restore_gate"] == "held" and ev["timings"]["pages_plan_s"] is not None
    assert _sum_after_usr1(int(open(os.path.join(dst, "init.pid")).read()), out) == want
    subprocess.run(["runc", "--root", runc_root, "delete", "--force", did], check=True, timeout=60)

    # 2. a checkpoint from before the record: the images are planned, as they always were
    del data["pagefill"]
    with open(path, "w") as fh:
        json.dump(data, fh)
    did = _uid("old-d")
    dst = _bundle(str(tmp_path / "d2"), ["true"], binaries, env=[f"MIGRT_RESTORE={name}"])
    rc, out = _create(runc_root, dst, did, str(tmp_path / "log2.json"))
    assert rc == 0, open(tmp_path / "log2.json").read()
    ev = _restored(migrt_config["log"], did)
    assert ev["pages"]["mode"] == "lazy" and ev["pages"]["lazy_bytes_from"] == "images"
    assert ev["pages"]["lazy_bytes"] == planned
    assert _sum_after_usr1(int(open(os.path.join(dst, "init.pid")).read()), out) == want
    subprocess.run(["runc", "--root", runc_root, "delete", "--force", did], check=True, timeout=60)
    run_cli("rm", name)


def _flag_a_lazy_entry_in_parent(path: str) -> None:
    """Set PE_PARENT on the first lazy entry of a pagemap image, in place (flags is a one-byte varint
    before and after): the filler refuses such images (a pre-dump chain)."""
    data = bytearray(open(path, "rb").read())
    i = 8 if struct.unpack_from("<I", data)[0] in (protobuf_mod.MAGIC_COMMON, protobuf_mod.MAGIC_SERVICE) else 4
    first = True
    while i < len(data):
        (n,) = struct.unpack_from("<I", data, i)
        j, end = i + 4, i + 4 + n
        i = end
        if first:  # the header (pages_id)
            first = False
            continue
        while j < end:
            key = data[j]
            j += 1
            assert key & 7 == 0, "PagemapEntry holds varints only"
            start = j
            while data[j] & 0x80:
                j += 1
            j += 1
            if key >> 3 == 4 and j - start == 1 and data[start] & images_mod.PE_LAZY:
                data[start] |= images_mod.PE_PARENT
                with open(path, "wb") as fh:
                    fh.write(data)
                return
    raise AssertionError(f"no lazy entry in {path}")


def _digests(top: str) -> dict[str, str]:
    out = {}
    for d, _dirs, files in os.walk(top):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                out[os.path.relpath(os.path.join(d, f), top)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def _guards_of(cid: str) -> list[int]:
    pids = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            cmd = open(f"/proc/{p}/cmdline", "rb").read().decode(errors="replace")
        except OSError:
            continue
        if "migrt.pagefill.guard" in cmd and cid in cmd:
            pids.append(int(p))
    return pids


def test_images_the_guard_refuses_stop_the_restore_before_the_container_runs(runc_root, migrt_config, binaries,
                                                                              tmp_path):
    """The images were altered after the checkpoint (hashes made to match, as an attacker with the store's
    write access could): the record still says fillable, so auto chooses the filler without reading the
    images; the guard's own plan refuses them, the gate never lets the restored tree run, the create
    fails with the reason (exit 4), and nothing is left but the checkpoint, byte for byte as it was."""
    name = _uid("bad")
    _checkpoint(runc_root, binaries, tmp_path, name)
    top = _tamper(migrt_config["store"], name)
    assert _manifest(migrt_config["store"], name)[1]["pagefill"]["fillable"] is True  # the record still says so
    run_cli("inspect", name, "--verify")  # consistent: only the filler can tell
    with pytest.raises(images_mod.ImageError, match="parent image"):
        images_mod.plan(os.path.join(top, "images"))
    before = _digests(top)

    did = _uid("bad-d")
    dst = _bundle(str(tmp_path / "d"), ["true"], binaries, env=[f"MIGRT_RESTORE={name}"])
    log = str(tmp_path / "log.json")
    rc, out = _create(runc_root, dst, did, log)
    errors = [json.loads(ln)["msg"] for ln in open(log) if '"error"' in ln]
    assert rc == 4, errors
    assert any(f"checkpoint {name}: the page filler cannot fill its images (process" in m and "parent image" in m
               and "though its manifest records them as fillable" in m and "MIGRT_RESTORE_PAGES=eager" in m
               for m in errors), errors
    failed = [json.loads(ln) for ln in open(migrt_config["log"]) if '"restore_failed"' in ln and did in ln]
    assert failed and "the page filler cannot fill its images" in failed[-1]["error"]
    assert _gone(runc_root, did) and not os.path.exists(os.path.join(runc_root, did))
    time.sleep(0.5)
    lines = out.wait_for(lambda ls: True, timeout=1)
    assert not [ln for ln in lines if ln.startswith("tick")], "the restored memhog ran"
    assert not [f for f in os.listdir(dst) if f.startswith(".migrt")]
    end = time.monotonic() + 15
    while _guards_of(did) and time.monotonic() < end:
        time.sleep(0.1)
    assert not _guards_of(did), "the guard outlived the failed restore"
    assert _digests(top) == before  # the checkpoint is untouched
    run_cli("inspect", name, "--verify")
    run_cli("rm", name)


def _tree_of(cid: str) -> list[int]:
    """memhog processes in the container's cgroup (runc names it after the container). Never read
    their cmdline: it lives in their memory, which faults on a userfaultfd nobody serves yet."""
    pids = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if open(f"/proc/{p}/comm").read().strip() == "memhog" and cid in open(f"/proc/{p}/cgroup").read():
                    pids.append(int(p))
            except OSError:
                continue
    return pids


def _dead(pid: int) -> bool:
    """Gone, or a zombie waiting to be reaped (by the node's init: CRIU's restored tree is reparented)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _tamper(store: str, name: str) -> str:
    """Make the images unfillable (PE_PARENT on a lazy entry), hashes and record left consistent."""
    path, data = _manifest(store, name)
    top = os.path.join(store, name)
    pagemap = next(f for f in sorted(os.listdir(os.path.join(top, "images"))) if f.startswith("pagemap-")
                   and images_mod.plan(os.path.join(top, "images")).processes[int(f[8:-4])].segments)
    _flag_a_lazy_entry_in_parent(os.path.join(top, "images", pagemap))
    with open(os.path.join(top, "images", pagemap), "rb") as fh:
        data["files"][f"images/{pagemap}"]["sha256"] = hashlib.sha256(fh.read()).hexdigest()
    with open(path, "w") as fh:
        json.dump(data, fh)
    return top


def test_a_late_guard_refusing_the_images_finds_the_tree_held_at_the_gate(runc_root, migrt_config, binaries,
                                                                          tmp_path):
    """The guard plans 3 s late (test seam), so CRIU connects, restores the whole tree and reaches
    post-restore first. Without the gate waiting for the guard's plan, CRIU would finish and the tree
    would run on userfaultfds nobody serves. The tree exists, held, until the guard refuses; then it is
    killed without ever having run, and the create fails with the guard's reason."""
    name = _uid("late")
    _checkpoint(runc_root, binaries, tmp_path, name)
    top = _tamper(migrt_config["store"], name)
    before = _digests(top)
    did = _uid("late-d")
    dst = _bundle(str(tmp_path / "d"), ["true"], binaries, env=[f"MIGRT_RESTORE={name}"])
    log = str(tmp_path / "log.json")
    r, w = os.pipe()
    t0 = time.monotonic()
    proc = subprocess.Popen([SHIM, "--root", runc_root, "--log", log, "--log-format", "json", "create", "--bundle",
                             dst, did], cwd=dst, stdin=subprocess.DEVNULL, stdout=w, stderr=w,
                            env={**_env(), "MIGRT_FILL_FAULT": "plan_after_s:3"})
    os.close(w)
    held = []
    while proc.poll() is None and not held and time.monotonic() - t0 < 60:
        held = _tree_of(did)
        time.sleep(0.05)
    assert held, "the restored tree never appeared (CRIU should reach the gate before the late plan)"
    assert proc.wait(60) == 4
    assert time.monotonic() - t0 >= 3
    errors = [json.loads(ln)["msg"] for ln in open(log) if '"error"' in ln]
    assert any("the page filler cannot fill its images" in m and "parent image" in m for m in errors), errors
    assert all(_dead(p) for p in held), "the held tree outlived the failed restore"
    lines = Lines(r).wait_for(lambda ls: True, timeout=1)
    assert not [ln for ln in lines if ln.startswith("tick")], "the restored memhog ran"
    assert _gone(runc_root, did) and not os.path.exists(os.path.join(runc_root, did))
    assert _digests(top) == before
    run_cli("rm", name)


def test_a_late_guard_that_plans_lets_the_held_tree_go_with_intact_memory(runc_root, migrt_config, binaries,
                                                                         tmp_path):
    name = _uid("slow")
    want = _checkpoint(runc_root, binaries, tmp_path, name)
    did = _uid("slow-d")
    dst = _bundle(str(tmp_path / "d"), ["true"], binaries, env=[f"MIGRT_RESTORE={name}"])
    r, w = os.pipe()
    res = subprocess.run([SHIM, "--root", runc_root, "--log", str(tmp_path / "log.json"), "--log-format", "json",
                          "create", "--bundle", dst, "--pid-file", os.path.join(dst, "init.pid"), did], cwd=dst,
                         stdin=subprocess.DEVNULL, stdout=w, stderr=w, timeout=120,
                         env={**_env(), "MIGRT_FILL_FAULT": "plan_after_s:2"})
    os.close(w)
    assert res.returncode == 0, open(tmp_path / "log.json").read()
    ev = _restored(migrt_config["log"], did)
    assert ev["pages"]["mode"] == "lazy" and ev["pages"]["lazy_bytes_from"] == "manifest"
    assert ev["restore_gate"] == "held" and ev["timings"]["pages_plan_s"] >= 1.9
    assert _sum_after_usr1(int(open(os.path.join(dst, "init.pid")).read()), Lines(r)) == want
    subprocess.run(["runc", "--root", runc_root, "delete", "--force", did], check=True, timeout=60)
    run_cli("rm", name)

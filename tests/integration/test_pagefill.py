"""Lazy restore through migrt's page filler, with the real runc and CRIU: images CRIU made, bit-identical
memory after a restore (one process, and a multi-process tree that forks, madvise(DONTNEED)s and
mremaps while its memory is still arriving), and a filler that dies mid-way (test seam
MIGRT_FILL_FAULT): the container never runs on missing pages, the error is clear, the checkpoint stays
usable."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import uuid

import pytest

from migrt.pagefill import images as images_mod
from tests.helpers.bundles import make_bundle
from tests.integration.conftest import SHIM, run_cli

pytestmark = pytest.mark.integration
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def _uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="module")
def binaries(tmp_path_factory) -> dict[str, str]:
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.fail("gcc is needed to build the test workloads (it is installed on CI)")
    d = tmp_path_factory.mktemp("fillbin")
    out = {}
    for name, src in (("churn", os.path.join(HERE, "churn.c")), ("memhog", os.path.join(REPO, "bench", "memhog.c"))):
        out[name] = str(d / name)
        subprocess.run([gcc, "-static", "-O2", "-o", out[name], src], check=True)
    return out


@pytest.fixture
def runc_root(stack, migrt_config, tmp_path):
    root = tmp_path / "runc-root"
    root.mkdir()
    yield str(root)
    for cid in os.listdir(root):
        subprocess.run(["runc", "--root", str(root), "delete", "--force", cid], capture_output=True)


class Lines:
    """A container's stdout (a pipe we read)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        os.set_blocking(fd, False)
        self.buf = b""

    def wait_for(self, pred, timeout: float = 60.0) -> list[str]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                chunk = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                chunk = None
            if chunk:
                self.buf += chunk
            lines = self.buf.decode(errors="replace").splitlines()
            if pred(lines):
                return lines
            if chunk is None:
                time.sleep(0.02)
        raise AssertionError(f"timed out; output so far: {self.buf[-2000:]!r}")


def _bundle(path: str, args: list[str], binaries: dict, env: list[str] | None = None) -> str:
    b = make_bundle(path, args, env=env)
    for name, src in binaries.items():
        shutil.copy2(src, os.path.join(b, "rootfs", "bin", name))
    return b


def _start(root: str, cid: str, bundle: str) -> Lines:
    r, w = os.pipe()
    subprocess.run(["runc", "--root", root, "run", "-d", cid], cwd=bundle, stdin=subprocess.DEVNULL, stdout=w,
                   stderr=w, check=True, timeout=60)
    os.close(w)
    return Lines(r)


def _readies(lines: list[str]) -> dict[str, str]:
    return {ln.split()[1]: ln.split()[2] for ln in lines if ln.startswith("ready ")}


def _sums(lines: list[str]) -> dict[str, tuple[str, str]]:
    """idx -> (hash, 'bad=..') from churn's sum lines."""
    return {p[1]: (p[2], p[3]) for p in (ln.split() for ln in lines) if p[0] == "sum" and len(p) >= 4}


def _gone(root: str, cid: str, timeout: float = 15.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        st = subprocess.run(["runc", "--root", root, "state", cid], capture_output=True, text=True)
        if st.returncode != 0 or json.loads(st.stdout).get("status") == "stopped":
            return True
        time.sleep(0.1)
    return False


def test_plan_of_real_criu_images_matches_pycriu(runc_root, migrt_config, binaries, tmp_path):
    """Images a normal runc/CRIU dump made: every private anonymous page is lazy, our reader agrees
    with pycriu on every entry and VMA, and the plan covers exactly the lazy entries."""
    import pycriu

    cid = _uid("plan")
    out = _start(runc_root, cid, _bundle(str(tmp_path / "p"), ["/bin/memhog", "64"], binaries))
    out.wait_for(lambda ls: any(ln.startswith("ready") for ln in ls))
    run_cli("checkpoint", cid, "--root", runc_root, "--name", "fill-plan")
    ins = json.loads(run_cli("inspect", "fill-plan", "--json").stdout)
    images = os.path.join(migrt_config["store"], "fill-plan", "images")
    pid = ins["images"]["processes"][0]["pid"]
    with open(os.path.join(images, f"pagemap-{pid}.img"), "rb") as fh:
        theirs = pycriu.images.load(fh)["entries"][1:]
    _, ours = images_mod.read_pagemap(images, pid)
    assert [(e.vaddr, e.nr_pages, e.flags) for e in ours] == [(e["vaddr"], e["nr_pages"], e["flags"]) for e in theirs]
    lazy = sum(e["nr_pages"] for e in theirs if e["flags"] & images_mod.PE_LAZY) * 4096
    assert lazy >= 64 << 20  # memhog's buffer is private anonymous memory: lazy
    plan = images_mod.plan(images)
    assert plan.processes[pid].lazy_bytes == lazy
    vmas = [v for v in images_mod.read_vmas(images, pid) if v.lazy]
    assert all(any(v.start <= s.start and s.end <= v.end for v in vmas) for s in plan.processes[pid].segments)
    run_cli("rm", "fill-plan")


def test_create_restores_lazily_and_bit_identical(runc_root, migrt_config, binaries, tmp_path):
    sid, did = _uid("fs"), _uid("fd")
    src = _start(runc_root, sid, _bundle(str(tmp_path / "s"), ["/bin/memhog", "256"], binaries))
    ready = src.wait_for(lambda ls: any(ln.startswith("ready") for ln in ls))
    want = next(ln.split()[1] for ln in ready if ln.startswith("ready"))
    run_cli("checkpoint", sid, "--root", runc_root, "--name", "fill-create")
    dst_bundle = _bundle(str(tmp_path / "d"), ["true"], binaries, env=["MIGRT_RESTORE=fill-create"])
    log = str(tmp_path / "log.json")
    r, w = os.pipe()
    res = subprocess.run([SHIM, "--root", runc_root, "--log", log, "--log-format", "json", "create", "--bundle",
                          dst_bundle, "--pid-file", os.path.join(dst_bundle, "init.pid"), did],
                         cwd=dst_bundle, stdin=subprocess.DEVNULL, stdout=w, stderr=w, timeout=120,
                         env={**os.environ, "MIGRT_RESTORE_PAGES": "lazy"})
    os.close(w)
    assert res.returncode == 0, open(log).read() if os.path.exists(log) else ""
    out = Lines(r)
    restored = [json.loads(ln) for ln in open(migrt_config["log"]) if '"restored"' in ln and did in ln]
    assert restored and restored[-1]["pages"]["mode"] == "lazy"
    pid = int(open(os.path.join(dst_bundle, "init.pid")).read())
    time.sleep(0.5)
    os.kill(pid, signal.SIGUSR1)
    lines = out.wait_for(lambda ls: any(ln.startswith("sum") for ln in ls))
    assert next(ln.split()[1] for ln in lines if ln.startswith("sum")) == want
    run_cli("rm", "fill-create")


def test_multiprocess_tree_forking_and_remapping_during_the_fill(runc_root, migrt_config, binaries, tmp_path):
    """Three processes that fork, madvise(DONTNEED) and mremap all the time: after a lazy restore every
    process's memory hashes as before, every check of the workload passed, and the filler saw the
    events (they happened while memory was still arriving)."""
    sid, did = _uid("cs"), _uid("cd")
    src = _start(runc_root, sid, _bundle(str(tmp_path / "s"), ["/bin/churn", "192", "3"], binaries))
    want = _readies(src.wait_for(lambda ls: len(_readies(ls)) == 3))
    time.sleep(0.5)
    run_cli("checkpoint", sid, "--root", runc_root, "--name", "fill-churn")
    out_file = tmp_path / "churn.out"
    # the background copy paced to 192 MiB/s (test seam): ~3 s of fill, while the workload churns
    res = run_cli("restore", "fill-churn", did, "--bundle", _bundle(str(tmp_path / "d"), ["true"], binaries),
                  "--root", runc_root, "--output", str(out_file), "--pages", "lazy", "--wait-pages", "--json",
                  env={**os.environ, "MIGRT_FILL_PACE_MIBS": "192"})
    data = json.loads(res.stdout)
    assert data["pages"]["mode"] == "lazy" and data["pages"]["threads"] >= 2
    counts = data["pages"]["fill"]["counts"]
    assert data["pages"]["fill"]["copied_bytes"] >= 3 * (192 << 20)
    assert counts["forks"] >= 1 and counts["removes"] >= 1 and counts["remaps"] >= 1, counts
    st = json.loads(subprocess.run(["runc", "--root", runc_root, "state", did], capture_output=True,
                                   text=True, check=True).stdout)
    os.kill(st["pid"], signal.SIGUSR1)
    end = time.monotonic() + 60
    while time.monotonic() < end and len(_sums(out_file.read_text().splitlines())) < 3:
        time.sleep(0.1)
    sums = _sums(out_file.read_text().splitlines())
    assert {k: v[0] for k, v in sums.items()} == want
    assert all(v[1] == "bad=0" for v in sums.values()), sums
    run_cli("rm", "fill-churn")


def test_filler_failure_fails_the_restore_and_keeps_the_checkpoint(runc_root, migrt_config, binaries, tmp_path):
    """The filler dies at its first copy: the restore fails with a clear error, no container is left,
    the checkpoint verifies, and the next restore gives the same memory."""
    sid, did = _uid("ks"), _uid("kd")
    src = _start(runc_root, sid, _bundle(str(tmp_path / "s"), ["/bin/memhog", "256"], binaries))
    want = next(ln.split()[1] for ln in src.wait_for(lambda ls: any(ln.startswith("ready") for ln in ls))
                if ln.startswith("ready"))
    run_cli("checkpoint", sid, "--root", runc_root, "--name", "fill-fault")
    dst = _bundle(str(tmp_path / "d"), ["true"], binaries)
    res = run_cli("restore", "fill-fault", did, "--bundle", dst, "--root", runc_root, "--pages", "lazy",
                  "--wait-pages", check=False, env={**os.environ, "MIGRT_FILL_FAULT": "after_bytes:0"})
    assert res.returncode == 5, res.stderr
    assert "page filler failed" in res.stderr and "SIGKILL" in res.stderr, res.stderr
    assert _gone(runc_root, did)
    assert not os.path.exists(os.path.join(runc_root, did))
    assert not [f for f in os.listdir(dst) if f.startswith(".migrt")]
    run_cli("inspect", "fill-fault", "--verify")
    out_file = tmp_path / "again.out"
    run_cli("restore", "fill-fault", did, "--bundle", dst, "--root", runc_root, "--output", str(out_file),
            "--pages", "lazy", "--wait-pages")
    st = json.loads(subprocess.run(["runc", "--root", runc_root, "state", did], capture_output=True,
                                   text=True, check=True).stdout)
    os.kill(st["pid"], signal.SIGUSR1)
    end = time.monotonic() + 30
    while time.monotonic() < end and "sum " not in out_file.read_text():
        time.sleep(0.1)
    assert f"sum {want}" in out_file.read_text()
    run_cli("rm", "fill-fault")


def test_filler_dying_after_create_kills_the_container(runc_root, migrt_config, binaries, tmp_path):
    """Through migrt-runc create (which returns before the memory is in): the filler dies after 64 MiB;
    the container must not run on (killed, the error in runc's log for containerd), and the
    checkpoint still restores with the same memory."""
    sid, did = _uid("as"), _uid("ad")
    src = _start(runc_root, sid, _bundle(str(tmp_path / "s"), ["/bin/memhog", "512"], binaries))
    want = next(ln.split()[1] for ln in src.wait_for(lambda ls: any(ln.startswith("ready") for ln in ls))
                if ln.startswith("ready"))
    run_cli("checkpoint", sid, "--root", runc_root, "--name", "fill-late")
    dst = _bundle(str(tmp_path / "d"), ["true"], binaries, env=["MIGRT_RESTORE=fill-late"])
    log = str(tmp_path / "log.json")
    subprocess.run([SHIM, "--root", runc_root, "--log", log, "--log-format", "json", "create", "--bundle", dst,
                    "--pid-file", os.path.join(dst, "init.pid"), did], cwd=dst, stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120,
                   env={**os.environ, "MIGRT_RESTORE_PAGES": "lazy", "MIGRT_FILL_FAULT": f"after_bytes:{64 << 20}"})
    assert _gone(runc_root, did, timeout=30), "the container kept running after its page filler died"
    end = time.monotonic() + 15
    errors = []
    while time.monotonic() < end and not errors:
        errors = [json.loads(ln)["msg"] for ln in open(log) if '"error"' in ln]
        time.sleep(0.1)
    assert any("page filler failed" in m for m in errors), errors
    subprocess.run(["runc", "--root", runc_root, "delete", "--force", did], capture_output=True)
    run_cli("inspect", "fill-late", "--verify")
    out_file = tmp_path / "again.out"
    run_cli("restore", "fill-late", did, "--bundle", dst, "--root", runc_root, "--output", str(out_file),
            "--pages", "lazy", "--wait-pages")
    st = json.loads(subprocess.run(["runc", "--root", runc_root, "state", did], capture_output=True,
                                   text=True, check=True).stdout)
    os.kill(st["pid"], signal.SIGUSR1)
    end = time.monotonic() + 30
    while time.monotonic() < end and "sum " not in out_file.read_text():
        time.sleep(0.1)
    assert f"sum {want}" in out_file.read_text()
    run_cli("rm", "fill-late")


def test_doctor_says_whether_the_filler_can_work(stack, migrt_config):
    res = run_cli("doctor", "--json", check=False)
    checks = {c["name"]: c for c in json.loads(res.stdout)["checks"]}
    filler = checks["page filler (lazy restore)"]
    # this node (and CI) has userfaultfd with the fork/remap/remove/unmap events
    assert filler["status"] == "ok" and filler["detail"].startswith("usable"), filler


def test_guard_killed_mid_fill_the_filler_finishes_alone(runc_root, migrt_config, binaries, tmp_path):
    """The other half of the two-holder design: SIGKILL the guard while the (paced) fill runs; the
    filler still holds every userfaultfd, completes, and the memory is intact."""
    sid, did = _uid("gs"), _uid("gd")
    src = _start(runc_root, sid, _bundle(str(tmp_path / "s"), ["/bin/memhog", "384"], binaries))
    want = next(ln.split()[1] for ln in src.wait_for(lambda ls: any(ln.startswith("ready") for ln in ls))
                if ln.startswith("ready"))
    run_cli("checkpoint", sid, "--root", runc_root, "--name", "fill-guard")
    dst = _bundle(str(tmp_path / "d"), ["true"], binaries, env=["MIGRT_RESTORE=fill-guard"])
    r, w = os.pipe()
    res = subprocess.run([SHIM, "--root", runc_root, "--log", str(tmp_path / "log.json"), "--log-format", "json",
                          "create", "--bundle", dst, "--pid-file", os.path.join(dst, "init.pid"), did], cwd=dst,
                         stdin=subprocess.DEVNULL, stdout=w, stderr=w, timeout=120,
                         env={**os.environ, "MIGRT_RESTORE_PAGES": "lazy", "MIGRT_FILL_PACE_MIBS": "96"})
    os.close(w)
    assert res.returncode == 0
    procs = [p for p in subprocess.run(["pgrep", "-f", "migrt.pagefill.guard"], capture_output=True,
                                       text=True).stdout.split() if did in open(f"/proc/{p}/cmdline").read()]
    # the guard and the filler it forked (same command line): the guard is the filler's parent
    parents = {p: open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1] for p in procs}
    guards = [p for p in procs if parents[p] not in procs]
    assert len(procs) == 2 and len(guards) == 1, parents
    args = json.loads(open(f"/proc/{guards[0]}/cmdline").read().split("\0")[3])
    status = json.load(open(args["status"]))
    os.kill(int(guards[0]), signal.SIGKILL)
    filler = status["filler_pid"]
    end = time.monotonic() + 60
    while os.path.exists(f"/proc/{filler}") and time.monotonic() < end:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{filler}"), "the filler did not finish after its guard died"
    st = json.load(open(args["status"]))
    assert st["state"] == "done" and st["copied_bytes"] >= 384 << 20
    out = Lines(r)
    os.kill(int(open(os.path.join(dst, "init.pid")).read()), signal.SIGUSR1)
    lines = out.wait_for(lambda ls: any(ln.startswith("sum") for ln in ls))
    assert next(ln.split()[1] for ln in lines if ln.startswith("sum")) == want
    shutil.rmtree(args["run_dir"], ignore_errors=True)  # its guard, which removes it, was killed
    run_cli("rm", "fill-guard")

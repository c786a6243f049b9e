"""migrt's parallel memory dump (dump_pages: parallel, migrt/pagedump) with the real runc and CRIU: CRIU's
lazy dump writes every image but the private anonymous memory, migrt writes that memory from the frozen
tasks. The checkpoint must be a normal CRIU checkpoint: restored eagerly by CRIU and through the page
filler with bit-identical memory (one process, a tree of three, --leave-running), and the same pagemaps
and pages files as `runc checkpoint` writes for the same frozen memory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.integration.conftest import CLI, run_cli
from tests.integration.test_gpu_pause import driver, fake_gpu  # noqa: F401 - fixtures
from tests.integration.test_gpu_restore_start import checkpoint_marked, create, gpu_calls
from tests.integration.test_pagefill import _bundle, _readies, _start, _sums, _uid, binaries, runc_root  # noqa: F401
from tests.integration.workloads import parse_ticks

pytestmark = pytest.mark.integration
PE_LAZY, PE_PRESENT = 2, 4


def _parallel_env() -> dict:
    return {**os.environ, "MIGRT_DUMP_PAGES": "parallel", "MIGRT_DUMP_THREADS": "3"}


def _manifest(migrt_config, name: str) -> dict:
    with open(os.path.join(migrt_config["store"], name, "manifest.json")) as fh:
        return json.load(fh)


def _state(root: str, cid: str) -> dict:
    return json.loads(subprocess.run(["runc", "--root", root, "state", cid], capture_output=True, text=True,
                                     check=True).stdout)


def _restore_and_sum(runc_root, name: str, did: str, binaries, tmp_path, pages: str, procs: int = 1) -> dict:
    """Restore `name` as `did` (--pages eager|lazy, every page in before it returns), ask for the sums."""
    out_file = tmp_path / f"{did}.out"
    res = run_cli("restore", name, did, "--bundle", _bundle(str(tmp_path / did), ["true"], binaries), "--root",
                  runc_root, "--output", str(out_file), "--pages", pages, "--wait-pages", "--json")
    assert json.loads(res.stdout)["pages"]["mode"] == pages
    os.kill(_state(runc_root, did)["pid"], signal.SIGUSR1)
    end = time.monotonic() + 60
    while time.monotonic() < end:
        lines = out_file.read_text().splitlines()
        sums = _sums(lines) if procs > 1 else {"0": (ln.split()[1], "bad=0") for ln in lines if ln.startswith("sum")}
        if len(sums) >= procs:
            return sums
        time.sleep(0.1)
    raise AssertionError(f"no sums from {did}: {out_file.read_text()[-2000:]}")


def _no_lazy_only_entries(images: str) -> None:
    import pycriu

    for name in os.listdir(images):
        if name.startswith("pagemap-") and not name.startswith("pagemap-shmem"):
            with open(os.path.join(images, name), "rb") as fh:
                entries = pycriu.images.load(fh)["entries"][1:]
            assert all(e["flags"] & PE_PRESENT for e in entries), name


def test_parallel_dump_restores_eagerly_and_through_the_filler(runc_root, migrt_config, binaries, tmp_path):
    sid = _uid("pd")
    src = _start(runc_root, sid, _bundle(str(tmp_path / "s"), ["/bin/memhog", "320"], binaries))
    want = next(ln.split()[1] for ln in src.wait_for(lambda ls: any(ln.startswith("ready") for ln in ls))
                if ln.startswith("ready"))
    run_cli("checkpoint", sid, "--root", runc_root, "--name", "pd-one", env=_parallel_env())
    data = _manifest(migrt_config, "pd-one")
    rec = data["dump_pages"]
    assert rec["mode"] == "parallel" and rec["requested"] == "parallel" and "fallback" not in rec, rec
    assert rec["lazy_bytes"] >= 320 << 20 and rec["processes"] == 1 and rec["threads"] >= 1
    assert data["timings"]["pages_s"] > 0 and data["timings"]["lazy_dump_s"] > 0
    images = os.path.join(migrt_config["store"], "pd-one", "images")
    _no_lazy_only_entries(images)
    assert not [n for n in os.listdir(images) if n.endswith(".migrt-new")]
    run_cli("inspect", "pd-one", "--verify")
    assert _restore_and_sum(runc_root, "pd-one", _uid("pe"), binaries, tmp_path, "eager") == {"0": (want, "bad=0")}
    assert _restore_and_sum(runc_root, "pd-one", _uid("pl"), binaries, tmp_path, "lazy") == {"0": (want, "bad=0")}
    run_cli("rm", "pd-one")


def test_parallel_dump_of_a_process_tree(runc_root, migrt_config, binaries, tmp_path):
    """Three processes (each with a DONTFORK and a WIPEONFORK area and fork children coming and going):
    every process's memory hashes as before the checkpoint after an eager restore."""
    sid = _uid("pt")
    src = _start(runc_root, sid, _bundle(str(tmp_path / "s"), ["/bin/churn", "96", "3"], binaries))
    want = _readies(src.wait_for(lambda ls: len(_readies(ls)) == 3))
    time.sleep(0.3)
    run_cli("checkpoint", sid, "--root", runc_root, "--name", "pd-tree", env=_parallel_env())
    rec = _manifest(migrt_config, "pd-tree")["dump_pages"]
    assert rec["mode"] == "parallel" and rec["processes"] >= 3 and rec["lazy_bytes"] >= 3 * (96 << 20), rec
    sums = _restore_and_sum(runc_root, "pd-tree", _uid("pte"), binaries, tmp_path, "eager", procs=3)
    assert {k: v[0] for k, v in sums.items()} == want
    assert all(v[1] == "bad=0" for v in sums.values()), sums
    run_cli("rm", "pd-tree")


def test_parallel_dump_with_leave_running(runc_root, migrt_config, binaries, tmp_path):
    """The source is thawed right after the memory is written and keeps running with its memory; the
    checkpoint restores beside it with the same memory."""
    sid = _uid("lr")
    src = _start(runc_root, sid, _bundle(str(tmp_path / "s"), ["/bin/memhog", "256"], binaries))
    want = next(ln.split()[1] for ln in src.wait_for(lambda ls: any(ln.startswith("ready") for ln in ls))
                if ln.startswith("ready"))
    run_cli("checkpoint", sid, "--root", runc_root, "--name", "pd-lr", "--leave-running", env=_parallel_env())
    assert _state(runc_root, sid)["status"] == "running"
    assert _manifest(migrt_config, "pd-lr")["dump_pages"]["mode"] == "parallel"
    os.kill(_state(runc_root, sid)["pid"], signal.SIGUSR1)
    lines = src.wait_for(lambda ls: any(ln.startswith("sum") for ln in ls))
    assert next(ln.split()[1] for ln in lines if ln.startswith("sum")) == want  # the source's memory intact
    ticks = len([ln for ln in src.wait_for(lambda ls: True) if ln.startswith("tick")])
    time.sleep(0.3)
    assert len([ln for ln in src.wait_for(lambda ls: True) if ln.startswith("tick")]) > ticks  # it runs
    assert _restore_and_sum(runc_root, "pd-lr", _uid("lrd"), binaries, tmp_path, "eager") == {"0": (want, "bad=0")}
    run_cli("rm", "pd-lr")


def _canonical(images: str) -> dict[str, list[tuple[int, int, int]]]:
    """Per pagemap file: (first page, pages, flags) runs, adjacent entries of equal flags merged (CRIU cuts
    entries at its pipe size, fs.pipe-max-size, which may differ between two dumps)."""
    import pycriu

    out = {}
    for name in sorted(os.listdir(images)):
        if not name.startswith("pagemap-"):
            continue
        with open(os.path.join(images, name), "rb") as fh:
            img = pycriu.images.load(fh)["entries"]
        runs: list[list[int]] = []
        for e in img[1:]:
            page = e["vaddr"] // 4096
            if runs and runs[-1][0] + runs[-1][1] == page and runs[-1][2] == e["flags"]:
                runs[-1][1] += e["nr_pages"]
            else:
                runs.append([page, e["nr_pages"], e["flags"]])
        out[name] = [tuple(r) for r in runs] + [("head", img[0])]
    return out


def test_pagemaps_and_pages_equal_a_normal_criu_dump(runc_root, migrt_config, binaries, tmp_path):
    """The same frozen tree dumped by `runc checkpoint` and by migrt's parallel dump: the same pagemap
    entries (lazy ones PE_PRESENT|PE_LAZY), the same pages files byte for byte."""
    sid = _uid("eq")
    bundle = _bundle(str(tmp_path / "s"), ["/bin/churn", "48", "2"], binaries)
    with open(os.path.join(bundle, "config.json")) as fh:
        spec = json.load(fh)
    # one CPU: the kernel writes the CPU a task last ran on into its rseq area (its memory), and each
    # dump runs CRIU's parasite in the tasks; on one CPU that number is the same for both dumps
    spec["linux"].setdefault("resources", {})["cpu"] = {"cpus": "0"}
    with open(os.path.join(bundle, "config.json"), "w") as fh:
        json.dump(spec, fh)
    src = _start(runc_root, sid, bundle)
    src.wait_for(lambda ls: len(_readies(ls)) == 2)
    subprocess.run(["runc", "--root", runc_root, "pause", sid], check=True)
    criu_dir, work = tmp_path / "criu", tmp_path / "work"
    criu_dir.mkdir()
    work.mkdir()
    subprocess.run(["runc", "--root", runc_root, "checkpoint", "--leave-running", "--image-path", str(criu_dir),
                    "--work-path", str(work), sid], check=True, capture_output=True)
    # migrt leaves a container it found paused as it was: the memory is the same for both dumps
    run_cli("checkpoint", sid, "--root", runc_root, "--name", "pd-eq", "--leave-running", env=_parallel_env())
    assert _state(runc_root, sid)["status"] == "paused"
    ours = os.path.join(migrt_config["store"], "pd-eq", "images")
    assert _manifest(migrt_config, "pd-eq")["dump_pages"]["mode"] == "parallel"
    theirs = _canonical(str(criu_dir))
    assert theirs and _canonical(ours) == theirs
    assert any(flags == PE_LAZY | PE_PRESENT for runs in theirs.values() for _p, _n, flags in runs[:-1])
    pages = sorted(n for n in os.listdir(criu_dir) if n.startswith("pages-"))
    assert pages == sorted(n for n in os.listdir(ours) if n.startswith("pages-"))
    for name in pages:
        with open(criu_dir / name, "rb") as a, open(os.path.join(ours, name), "rb") as b:
            assert a.read() == b.read(), name
    subprocess.run(["runc", "--root", runc_root, "resume", sid], check=True)
    run_cli("rm", "pd-eq")


def test_auto_keeps_criu_below_the_threshold(runc_root, migrt_config, binaries, tmp_path):
    sid = _uid("au")
    src = _start(runc_root, sid, _bundle(str(tmp_path / "s"), ["/bin/memhog", "16"], binaries))
    src.wait_for(lambda ls: any(ln.startswith("ready") for ln in ls))
    env = {k: v for k, v in os.environ.items() if k != "MIGRT_DUMP_PAGES"}
    run_cli("checkpoint", sid, "--root", runc_root, "--name", "pd-auto", env=env)
    rec = _manifest(migrt_config, "pd-auto")["dump_pages"]
    assert rec["mode"] == "criu" and rec["requested"] == "auto" and "below" in rec["reason"], rec
    run_cli("rm", "pd-auto")


def test_parallel_dump_of_a_gpu_container(runc_root, fake_gpu, migrt_config, tmp_path, monkeypatch):  # noqa: F811
    """On the simulated GPU node: the driver's lock and checkpoint once each (MIGRT_GPU_HANDLED keeps the
    CRIU hook out of the lazy dump as out of CRIU's), the memory written by migrt, and the restore by
    migrt-runc create gives the GPU restore and the counter back."""
    monkeypatch.setenv("MIGRT_DUMP_PAGES", "parallel")
    tick, digest = checkpoint_marked(runc_root, tmp_path, fake_gpu, "pd-gpu")
    assert gpu_calls(fake_gpu) == ["lock", "checkpoint"]
    data = _manifest(migrt_config, "pd-gpu")
    assert data["dump_pages"]["mode"] == "parallel" and data["dump_pages"]["lazy_bytes"] > 0, data["dump_pages"]
    assert data["gpu"]
    dst, did, log = create(runc_root, tmp_path, "pd-gpu")
    try:
        assert dst.rc == 0, open(log).read() if os.path.exists(log) else ""
        assert gpu_calls(fake_gpu) == ["lock", "checkpoint", "restore", "unlock"]
        after = parse_ticks(dst.read_for(1.0))
        assert after and after[0][0] == tick + 1 and all(t[2] == digest for t in after)
    finally:
        dst.close()
    run_cli("rm", "pd-gpu")


def test_export_of_a_parallel_checkpoint_is_read_by_checkpointctl(runc_root, migrt_config, binaries, tmp_path):
    """The exported archive of a parallel checkpoint: checkpointctl reads it, and `migrt import` gives back
    the same image files, which restore with the same memory."""
    import shutil

    if not shutil.which("checkpointctl"):
        if os.environ.get("CI") == "true":
            pytest.fail("checkpointctl missing (run packaging/setup-host.sh)")
        pytest.skip("checkpointctl missing")
    sid = _uid("ex")
    src = _start(runc_root, sid, _bundle(str(tmp_path / "s"), ["/bin/memhog", "64"], binaries))
    want = next(ln.split()[1] for ln in src.wait_for(lambda ls: any(ln.startswith("ready") for ln in ls))
                if ln.startswith("ready"))
    run_cli("checkpoint", sid, "--root", runc_root, "--name", "pd-export", env=_parallel_env())
    src_manifest = _manifest(migrt_config, "pd-export")
    assert src_manifest["dump_pages"]["mode"] == "parallel"
    tar = tmp_path / "pd.tar"
    run_cli("export", "pd-export", "-o", str(tar))
    for argv in (["show", str(tar)], ["inspect", "--ps-tree", "--format", "json", str(tar)]):
        res = subprocess.run(["checkpointctl", *argv], capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
    assert "memhog" in res.stdout
    assert run_cli("import", str(tar), "--name", "pd-back").stdout.strip() == "pd-back"
    back = _manifest(migrt_config, "pd-back")["files"]
    imgs = {k: v for k, v in src_manifest["files"].items() if k.startswith("images/pag")}
    assert imgs and all(back.get(k) == v for k, v in imgs.items())
    assert _restore_and_sum(runc_root, "pd-back", _uid("exd"), binaries, tmp_path, "eager") == {"0": (want, "bad=0")}
    run_cli("rm", "pd-export")
    run_cli("rm", "pd-back")


_RAW_LAZY_DUMP = """
import sys
from migrt.criu.options import CriuOptions
from migrt.errors import RuntimeFailed
from migrt.runtime import control
root, cid, images, work = sys.argv[1:5]
dump = control.LazyCheckpoint("runc", root, cid, image_path=images, work_path=work, options=CriuOptions(),
                              page_server=control.loopback_page_server())
try:
    dump.wait_ready(300)
    dump.finish(60)
except RuntimeFailed as exc:
    print("FAILED", exc)
    sys.exit(3)
print("DUMPED")
"""


def test_parallel_dump_under_a_low_descriptor_limit(runc_root, migrt_config, binaries, tmp_path):
    """A lazy dump held two descriptors per CRIU page pipe (min(fs.pipe-max-size, 3.2 MiB) of memory
    each): 32 GiB under the GPU machine's hard limit of 20000 could not be dumped in parallel. Scaled
    down here: migrt, runc and CRIU under a hard limit of 1024, without CAP_SYS_RESOURCE to raise it,
    and memory that CRIU's page pipes would need 1.3 times as many descriptors for. CRIU's own way
    (MIGRT_CRIU_LAZY_NO_PIPES=0) runs out of descriptors, and migrt refuses it before the freeze; migrt's
    CRIU (packaging/criu/patches/0001) keeps no page pipes: the dump runs, and restores the same memory."""
    from migrt.criu import lazy as lazy_mod
    from migrt.criu.binary import choose

    assert lazy_mod.unpiped_lazy_dump(os.environ.get("MIGRT_CRIU") or None), \
        "the CRIU in use is not migrt's build with its patches (packaging/build-criu.sh)"
    # an ordinary hard limit, and the memory that takes 1.3 times as many descriptors in CRIU's pipes
    # (1 MiB pipes: 666 MiB; 3.2 MiB pipes, fs.pipe-max-size 4 MiB: 2130 MiB)
    limit = 1024
    pipe = max(4096, min(lazy_mod.pipe_max_size(), lazy_mod.CRIU_PIPE_MAX))
    mib = int(1.3 * limit * pipe / 2) >> 20
    low = ["prlimit", f"--nofile={limit}:{limit}", "--"]
    sid = _uid("fd")
    src = _start(runc_root, sid, _bundle(str(tmp_path / "s"), ["/bin/memhog", str(mib)], binaries))
    want = next(ln.split()[1] for ln in src.wait_for(lambda ls: any(ln.startswith("ready") for ln in ls), 120)
                if ln.startswith("ready"))
    old = {**_parallel_env(), "MIGRT_CRIU_LAZY_NO_PIPES": "0"}
    criu = choose()[0]  # the raw dump's runc finds the CRIU migrt uses first on PATH, as migrt's own calls do
    raw_env = {**old, "PATH": os.path.dirname(criu) + os.pathsep + os.environ.get("PATH", "")}
    # CRIU's own way: the raw lazy dump runs out of descriptors (the container is left running)
    images, work = tmp_path / "raw-images", tmp_path / "raw-work"
    images.mkdir()
    work.mkdir()
    raw = subprocess.run([*low, sys.executable, "-c", _RAW_LAZY_DUMP, runc_root, sid, str(images), str(work)],
                         capture_output=True, text=True, timeout=300, env=raw_env)
    assert raw.returncode == 3 and "Too many open files" in raw.stdout, raw.stdout + raw.stderr
    assert _state(runc_root, sid)["status"] == "running"
    # ... which migrt refuses before freezing anything
    res = subprocess.run([*low, CLI, "checkpoint", sid, "--root", runc_root, "--name", "fd-old"], capture_output=True,
                         text=True, timeout=300, env=old)
    assert res.returncode == 8 and "open files" in res.stderr, res.stderr
    assert _state(runc_root, sid)["status"] == "running"
    # migrt's CRIU: the same dump under the same limit
    res = subprocess.run([*low, CLI, "checkpoint", sid, "--root", runc_root, "--name", "fd-new", "--json"],
                         capture_output=True, text=True, timeout=300, env=_parallel_env())
    assert res.returncode == 0, res.stderr
    rec = _manifest(migrt_config, "fd-new")["dump_pages"]
    assert rec["mode"] == "parallel" and rec["lazy_bytes"] >= mib << 20, rec
    with open(os.path.join(migrt_config["store"], "fd-new", "logs", "dump.log"), errors="replace") as fh:
        assert "not kept in page pipes" in fh.read()
    assert _restore_and_sum(runc_root, "fd-new", _uid("fdr"), binaries, tmp_path, "eager") == {"0": (want, "bad=0")}
    run_cli("rm", "fd-new")

"""migrt-runc and the CLI with the real runc and CRIU, no containerd (private runc root)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import time

import uuid

import pytest

from tests.helpers.bundles import make_bundle
from tests.integration.conftest import SHIM, run_cli
from tests.integration.workloads import COUNTER, parse_ticks

pytestmark = pytest.mark.integration


class Piped:
    """A runc call with fresh pipes as stdio (what containerd's shim does); keeps the read end."""

    def __init__(self, argv: list[str], cwd: str) -> None:
        r_in, self.w_in = os.pipe()
        self.r_out, w_out = os.pipe()
        self.rc = subprocess.run(argv, cwd=cwd, stdin=r_in, stdout=w_out, stderr=w_out, timeout=120).returncode
        os.close(r_in)
        os.close(w_out)
        self.buf = b""

    def read_for(self, seconds: float) -> str:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            ready, _, _ = select.select([self.r_out], [], [], 0.1)
            if ready:
                chunk = os.read(self.r_out, 65536)
                if not chunk:
                    break
                self.buf += chunk
        return self.buf.decode(errors="replace")

    def close(self) -> None:
        for fd in (self.w_in, self.r_out):
            try:
                os.close(fd)
            except OSError:
                pass


@pytest.fixture
def runc_root(stack, migrt_config, tmp_path):
    root = tmp_path / "runc-root"
    root.mkdir()
    yield str(root)
    for cid in os.listdir(root):
        subprocess.run(["runc", "--root", str(root), "delete", "--force", cid], capture_output=True)


def _uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def _state(root: str, cid: str) -> dict:
    out = subprocess.run(["runc", "--root", root, "state", cid], capture_output=True, text=True)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def test_restore_via_migrt_runc_create(runc_root, migrt_config, tmp_path):
    sid, did = _uid("src"), _uid("dst")
    src_bundle = make_bundle(str(tmp_path / "src"), ["sh", "-c", COUNTER])
    src = Piped(["runc", "--root", runc_root, "create", sid], src_bundle)
    assert src.rc == 0, src.read_for(0.5)
    assert subprocess.run(["runc", "--root", runc_root, "start", sid]).returncode == 0
    before = parse_ticks(src.read_for(1.5))
    assert len(before) >= 3
    name = "runc-direct"
    assert run_cli("checkpoint", sid, "--root", runc_root, "--name", name).stdout.strip() == name
    assert _state(runc_root, sid).get("status") in (None, "stopped")  # runc destroys it after the dump
    last = parse_ticks(src.read_for(0.3))[-1]
    src.close()

    dst_bundle = make_bundle(str(tmp_path / "dst"), ["sh", "-c", "echo fresh"], env=[f"MIGRT_RESTORE={name}"])
    log = str(tmp_path / "log.json")
    pid_file = os.path.join(dst_bundle, "init.pid")
    dst = Piped([SHIM, "--root", runc_root, "--log", log, "--log-format", "json", "create", "--bundle",
                 dst_bundle, "--pid-file", pid_file, did], dst_bundle)
    try:
        assert dst.rc == 0, open(log).read() if os.path.exists(log) else ""
        raw = open(pid_file).read()
        assert raw.isdigit()  # decimal digits, no newline: what the shim parses
        st = _state(runc_root, did)
        assert st["status"] == "running" and st["pid"] == int(raw)
        assert subprocess.run([SHIM, "--root", runc_root, "start", did]).returncode == 0  # no-op
        after = parse_ticks(dst.read_for(1.5))
        assert after and after[0][0] == last[0] + 1  # continues exactly after the last tick
        assert all(t[2] == last[2] for t in after)
        assert "fresh" not in dst.buf.decode()
        subprocess.run(["runc", "--root", runc_root, "kill", did, "KILL"], check=True)
        for _ in range(50):
            if _state(runc_root, did).get("status") == "stopped":
                break
            time.sleep(0.1)
        assert subprocess.run([SHIM, "--root", runc_root, "delete", did]).returncode == 0
        assert not os.path.exists(os.path.join(runc_root, did))  # marker gone with runc's state
        assert not [f for f in os.listdir(dst_bundle) if f.startswith(".migrt")]
    finally:
        dst.close()


def test_cli_restore_ls_inspect_rm(runc_root, migrt_config, tmp_path):
    aid, bid = _uid("a"), _uid("b")
    bundle = make_bundle(str(tmp_path / "a"), ["sh", "-c", COUNTER])
    a = Piped(["runc", "--root", runc_root, "create", aid], bundle)
    subprocess.run(["runc", "--root", runc_root, "start", aid], check=True)
    a.read_for(1.0)
    res = run_cli("checkpoint", aid, "--root", runc_root, "--name", "cli-ck", "--leave-running", "--json")
    data = json.loads(res.stdout)
    assert data["name"] == "cli-ck" and data["options"]["leave_running"] is True
    assert set(data["timings"]) >= {"dump_s", "commit_s", "total_s"}
    assert _state(runc_root, aid)["status"] == "running"
    a.close()

    ls = json.loads(run_cli("ls", "--json").stdout)
    entry = next(c for c in ls if c["name"] == "cli-ck")
    assert entry["container_id"] == aid and entry["size_bytes"] > 0
    ins = json.loads(run_cli("inspect", "cli-ck", "--json", "--verify").stdout)
    assert ins["verified"] is True
    procs = ins["images"]["processes"]
    assert procs[0]["pid"] == 1 and procs[0]["comm"] == "sh"
    assert ins["images"]["dumped_bytes"] > 0
    assert any(f["type"] == "pipe" for f in procs[0]["files"])
    assert ins["manifest"]["versions"]["criu"].startswith("4.")

    b_bundle = make_bundle(str(tmp_path / "b"), ["sh", "-c", "exit 1"])
    out = tmp_path / "b.out"
    res = run_cli("restore", "cli-ck", bid, "--bundle", b_bundle, "--root", runc_root, "--output", str(out), "--json")
    assert json.loads(res.stdout)["pid"] > 0
    time.sleep(1.0)
    assert _state(runc_root, bid)["status"] == "running"
    assert parse_ticks(out.read_text())
    # an existing container id is refused before anything is touched
    res = run_cli("restore", "cli-ck", bid, "--bundle", b_bundle, "--root", runc_root, check=False)
    assert res.returncode == 6 and "already exists" in res.stderr

    run_cli("rm", "cli-ck")
    assert "cli-ck" not in [c["name"] for c in json.loads(run_cli("ls", "--json").stdout)]
    res = run_cli("inspect", "cli-ck", check=False)
    assert res.returncode == 3 and "not found" in res.stderr


def test_checkpoint_errors(runc_root, migrt_config):
    res = run_cli("checkpoint", "no-such-container", "--root", runc_root, check=False)
    assert res.returncode == 3 and "no-such-container" in res.stderr
    res = run_cli("checkpoint", "x", "--name", "../bad", "--root", runc_root, check=False)
    assert res.returncode in (2, 3)


def test_doctor_json(stack, migrt_config):
    res = run_cli("doctor", "--json", check=False)
    data = json.loads(res.stdout)
    names = {c["name"]: c for c in data["checks"]}
    assert names["criu"]["status"] == "ok"
    assert names["lower runtime"]["status"] == "ok"
    assert names["pre-dump (soft-dirty)"]["status"] in ("ok", "warn")
    assert all(c["status"] == "ok" or c["fix"] for c in data["checks"])
    assert res.returncode == (0 if data["ok"] else 1)


def test_criu_failure_keeps_checkpoint(runc_root, migrt_config, tmp_path):
    """CRIU itself fails (a file the process holds open is missing from the new rootfs, which is a plain
    directory: no writable-layer diff): the error quotes CRIU, nothing is left, and once the file is
    there the same checkpoint restores."""
    bundle = make_bundle(str(tmp_path / "h"), ["sh", "-c", "echo x > /held; exec 3</held; " + COUNTER])
    hid, nid = _uid("h"), _uid("n")
    h = Piped(["runc", "--root", runc_root, "create", hid], bundle)
    subprocess.run(["runc", "--root", runc_root, "start", hid], check=True)
    h.read_for(1.0)
    run_cli("checkpoint", hid, "--root", runc_root, "--name", "held-ck")
    h.close()
    new = make_bundle(str(tmp_path / "n"), ["true"])
    res = run_cli("restore", "held-ck", nid, "--bundle", new, "--root", runc_root, check=False)
    assert res.returncode == 5, res.stderr
    assert "criu failed" in res.stderr and "held" in res.stderr, res.stderr
    assert not os.path.exists(os.path.join(runc_root, nid))
    assert not [f for f in os.listdir(new) if f.startswith(".migrt")]
    run_cli("inspect", "held-ck", "--verify")
    with open(os.path.join(new, "rootfs", "held"), "w") as fh:
        fh.write("x\n")
    out = tmp_path / "n.out"
    run_cli("restore", "held-ck", nid, "--bundle", new, "--root", runc_root, "--output", str(out))
    time.sleep(1.0)
    assert _state(runc_root, nid)["status"] == "running"
    assert parse_ticks(out.read_text())


def test_tampered_pages_caught_while_criu_restores_never_resume(runc_root, migrt_config, tmp_path):
    """The large page images are hashed while CRIU restores (ops/restore_checks.py); a flipped byte in
    one makes CRIU's post-restore gate abort the restore: the restored process never runs one more
    step, the error names the file, no container is left, the checkpoint stays. Put right, the same
    checkpoint restores, held at the gate until the hashes matched."""
    from migrt.ops import restore_checks

    data = tmp_path / "data"
    data.mkdir()
    mount = [{"destination": "/data", "type": "bind", "source": str(data), "options": ["rbind", "rw"]}]
    hog = ("x=$(head -c 3000000 /dev/urandom | od -An -tx1); i=0; "
           "while true; do i=$((i+1)); echo $i > /data/tick; sleep 0.05; done")
    sid = _uid("tp")
    src = Piped(["runc", "--root", runc_root, "create", sid], make_bundle(str(tmp_path / "s"), ["sh", "-c", hog],
                                                                          extra_mounts=mount))
    assert src.rc == 0, src.read_for(0.5)
    subprocess.run(["runc", "--root", runc_root, "start", sid], check=True)
    def ticks() -> int:  # the loop rewrites the file: an empty read is a write in progress
        for _ in range(50):
            text = (data / "tick").read_text().strip() if (data / "tick").exists() else ""
            if text:
                return int(text)
            time.sleep(0.01)
        return 0

    for _ in range(100):
        if ticks() > 3:
            break
        time.sleep(0.1)
    name = _uid("tpck")
    run_cli("checkpoint", sid, "--root", runc_root, "--name", name)
    src.close()
    tick = ticks()
    images = os.path.join(migrt_config["store"], name, "images")
    pages = max((f for f in os.listdir(images) if f.startswith("pages-")),
                key=lambda f: os.path.getsize(os.path.join(images, f)))
    target = os.path.join(images, pages)
    size = os.path.getsize(target)
    assert size >= restore_checks.BACKGROUND_MIN_BYTES  # hashed in the background, not up front

    def flip() -> None:
        with open(target, "r+b") as fh:
            fh.seek(size // 2)
            b = fh.read(1)
            fh.seek(size // 2)
            fh.write(bytes([b[0] ^ 0xFF]))

    def create(cid: str) -> tuple[Piped, str, str]:
        bundle = make_bundle(str(tmp_path / cid), ["sh", "-c", "echo fresh"], env=[f"MIGRT_RESTORE={name}"],
                             extra_mounts=mount)
        log = str(tmp_path / f"{cid}.json")
        return Piped([SHIM, "--root", runc_root, "--log", log, "--log-format", "json", "create", "--bundle", bundle,
                      cid], bundle), log, bundle

    flip()
    bad, log, bundle = create(_uid("tpbad"))
    bad.close()
    assert bad.rc != 0
    text = open(log).read()
    assert f"sha256 mismatch in images/{pages}" in text, text
    assert not [c for c in os.listdir(runc_root) if c.startswith("tpbad")]
    assert not [f for f in os.listdir(bundle) if f.startswith(".migrt")]
    time.sleep(0.5)
    assert ticks() == tick  # the restored tree was killed before it ran a step
    assert os.path.exists(target)

    flip()  # put right: the same checkpoint restores
    good, log, _ = create(_uid("tpok"))
    try:
        assert good.rc == 0, open(log).read() if os.path.exists(log) else ""
        for _ in range(50):
            if ticks() > tick:
                break
            time.sleep(0.1)
        assert ticks() > tick
        restored = [json.loads(ln) for ln in open(migrt_config["log"]) if '"restored"' in ln]
        assert restored[-1]["restore_gate"] == "held"
        assert "verify_background_s" in restored[-1]["timings"]
    finally:
        good.close()

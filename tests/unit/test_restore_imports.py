"""What the restore path (migrt-runc create -> restore swap) imports before its first CRIU call: the
standard library and migrt (PyYAML only for a config that is not flat `key: value` lines). Each
third-party package or heavy stdlib package listed here cost the shim's start measurably on the GPU
machine (bench/restore_start.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from migrt.store import Store

# structlog pulled in asyncio; pycriu pulls in protobuf; click, psutil, pynvml, zstandard, yaml are not
# needed before CRIU runs. The GPU steps (NVML, ctypes, thread pools) run in threads while CRIU restores,
# and only for checkpoints with GPU state; recovery only when the journal holds a stale entry; the page
# filler only for checkpoints whose page images reach fill_min_mib; a thread pool only for large hashes.
NOT_BEFORE_CRIU = ("click", "structlog", "asyncio", "pycriu", "google.protobuf", "psutil", "pynvml", "zstandard", "yaml",
                   "ssl", "http", "email", "migrt.ops.gpu_steps", "migrt.ops.recover", "migrt.pagefill",
                   "concurrent.futures", "ctypes", "uuid", "logging", "typing")

PROBE = textwrap.dedent("""\
    import json, sys
    import migrt.shim.__main__
    from migrt.ops import restore
    from migrt import config, log
    cfg = config.load({config!r})
    log.setup(cfg.log_file, cfg.log_level, component="migrt-runc").info("probe")
    print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))
    """)


def test_restore_path_imports_stay_light(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(f"runtime: runc\nstore: {tmp_path / 'store'}\nlog_file: {tmp_path / 'migrt.log'}\n")
    out = subprocess.run([sys.executable, "-c", PROBE.format(config=str(config), heavy=NOT_BEFORE_CRIU)],
                         capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stdout) == []
    line = json.loads((tmp_path / "migrt.log").read_text().splitlines()[-1])
    assert line["event"] == "probe" and line["component"] == "migrt-runc" and line["timestamp"].endswith("Z")


def test_the_probe_sees_a_heavy_import(tmp_path):
    """Positive control: the same probe reports a package the restore path does not import."""
    config = tmp_path / "config.yaml"
    config.write_text("runtime: runc\n")
    probe = PROBE.replace("import migrt.shim.__main__", "import migrt.shim.__main__, click")
    out = subprocess.run([sys.executable, "-c", probe.format(config=str(config), heavy=NOT_BEFORE_CRIU)],
                         capture_output=True, text=True, timeout=60, check=True)
    assert "click" in json.loads(out.stdout)  # (with what click itself imports)


RESTORE_PROBE = textwrap.dedent("""\
    import json, sys
    from migrt.errors import RuntimeFailed
    from migrt.runtime import runc

    def at_criu(self, spec, **kw):  # the first CRIU call: runc restore
        print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))
        raise RuntimeFailed("stop here")
    runc.LowerRuntime.restore = at_criu
    import migrt.shim.__main__
    from migrt import config, log
    from migrt.oci.bundle import Bundle
    from migrt.ops import restore
    cfg = config.load({config!r})
    log.setup(cfg.log_file, cfg.log_level, component="migrt-runc")
    target = restore.RestoreTarget(container_id="c2", bundle=Bundle.load({bundle!r}), root={root!r})
    try:
        restore.restore_checkpoint(cfg, "ck1", target)
    except RuntimeFailed:
        pass
    """)


def test_a_restore_reaches_criu_without_heavy_imports(tmp_path):
    """A whole restore up to `runc restore`: manifest, verify, the writable layer, the image view, the
    UTS hostname and root-mode checks (no rewrite needed: no pycriu)."""
    import pycriu

    root = tmp_path / "bundle" / "rootfs"
    root.mkdir(parents=True, mode=0o755)
    mode = os.stat(root).st_mode
    store = Store(str(tmp_path / "store"))
    store.ensure()
    with store.writer("ck1") as staging:
        with open(os.path.join(staging.images, "utsns-12.img"), "wb") as fh:
            pycriu.images.dump({"magic": "UTSNS", "entries": [{"nodename": "web-7", "domainname": "(none)"}]}, fh)
        with open(os.path.join(staging.images, "files.img"), "wb") as fh:
            fh.write(b"whatever: not read when root_mode matches")
        with open(os.path.join(staging.images, "pages-1.img"), "wb") as fh:
            fh.write(os.urandom(2 << 20))  # hashed while CRIU restores
        staging.commit({"created": "2026-11-24T00:00:00Z", "root_mode": mode, "options": {}, "mounts": []})
    (tmp_path / "bundle" / "config.json").write_text(json.dumps({
        "ociVersion": "1.0.2", "hostname": "web-7", "root": {"path": "rootfs"},
        "process": {"args": ["sh"], "env": ["PATH=/bin"], "cwd": "/"},
        "linux": {"namespaces": [{"type": "uts"}, {"type": "mount"}]}}))
    config = tmp_path / "config.yaml"
    config.write_text(f"runtime: /bin/true\nstore: {tmp_path / 'store'}\nlog_file: {tmp_path / 'migrt.log'}\n")
    probe = RESTORE_PROBE.format(heavy=NOT_BEFORE_CRIU, config=str(config), bundle=str(tmp_path / "bundle"),
                                 root=str(tmp_path / "runc-root"))
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip(), out.stderr
    assert json.loads(out.stdout) == []

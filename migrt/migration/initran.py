"""A pod-level pull's init containers: one that already ran to completion on the source is not run
again on the target (issue 29).

kubelet runs a pod's regular init containers first, one at a time, each to completion, and starts
its application containers (native sidecars included) only once every init container succeeded.
Under the pod-level annotations (podpull.py) a container of the new pod that migrt.io/migrate-pod
does not list is such an init container. Its create (migrt-runc) asks the source's agent, over the
same connection as a pull (migrate_peers, the migration key, TLS; the agent's opt-in and namespace
rules and its one refusal text), whether the source pod's container of that name ran:

    yes   the source pod is there, opted in, bound to this namespace, and every container the new pod
          lists runs there under its name and image (kubelet started them, so every init container of
          the source pod had succeeded); the container of that name is not running there (a stopped
          one must have the same image). containerd deletes a container's runc state when its task
          exits, so a completed init container is usually not seen at all: the answer then rests on
          kubelet's order above, and on the new pod being the source's copy (its listed containers
          matching by name and image; `migrt k8s move-manifest` copies the init containers as they are).
    no    anything else (a listed container not running there, an image that differs, a container of
          that name that runs): the container starts fresh, as before.
    refused (the agent's one text: no such pod, not opted in, another namespace): starts fresh.
    the agent cannot be reached: the create fails as a pull's does (one line in runc's log).

"Yes" creates the container as an immediate exit 0 without running the image's program: a copy of
the bundle (the original config.json is left as it is) whose process runs a tiny static ELF that only
calls exit(0), bind-mounted read-only at EXIT0_PATH under the container's /dev (containerd's specs
mount a tmpfs there, so runc can make the mount point even on a read-only rootfs; a bundle without
that tmpfs starts fresh). The copy lives in RUN_BASE/<container id> until the container is gone.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import shutil
import struct

from migrt import log as log_mod
from migrt.errors import PreconditionFailed, UsageError
from migrt.oci.bundle import Bundle
from migrt.pods.members import Member, mismatch
from migrt.runtime.argv import Call

RUN_BASE = "/run/migrt/init-ran"  # test seam
EXIT0_PATH = "/dev/.migrt-exit0"  # inside the container
_BASE_ADDR = 0x400000
_CODE = {  # exit(0): x86_64 mov eax,60; xor edi,edi; syscall / aarch64 mov x8,#93; mov x0,#0; svc #0
    "x86_64": (62, bytes.fromhex("b83c000000" "31ff" "0f05")),
    "aarch64": (183, bytes.fromhex("a80b80d2" "000080d2" "010000d4")),
}
_ARCH = {"amd64": "x86_64", "arm64": "aarch64"}


def exit0_elf(arch: str) -> bytes:
    """A static ELF64 executable (little-endian, one PT_LOAD) whose only code calls exit(0)."""
    arch = _ARCH.get(arch, arch)
    if arch not in _CODE:
        raise UsageError(f"no exit(0) program for architecture {arch!r} (x86_64, aarch64)")
    machine, code = _CODE[arch]
    ehsize, phsize = 64, 56
    entry = _BASE_ADDR + ehsize + phsize
    size = ehsize + phsize + len(code)
    ident = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)  # 64-bit, little-endian, version 1, SysV
    header = ident + struct.pack("<HHIQQQIHHHHHH", 2, machine, 1, entry, ehsize, 0, 0, ehsize, phsize, 1, 0, 0, 0)
    phdr = struct.pack("<IIQQQQQQ", 1, 5, 0, _BASE_ADDR, _BASE_ADDR, size, size, 0x1000)  # PT_LOAD, R+X
    return header + phdr + code


def exit0_program(base: str = RUN_BASE) -> str:
    """The node's exit(0) program (root-owned, 0555), written once (atomically) under `base`."""
    path = os.path.join(base, f"exit0-{platform.machine()}")
    data = exit0_elf(platform.machine())
    try:
        with open(path, "rb") as fh:
            if fh.read() == data:
                return path
    except OSError:
        pass
    os.makedirs(base, mode=0o755, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.chmod(tmp, 0o555)
    os.replace(tmp, path)
    return path


def has_dev_tmpfs(bundle: Bundle) -> bool:
    return any(m.get("destination") == "/dev" and m.get("type") == "tmpfs" for m in bundle.mounts)


def exit0_config(bundle: Bundle, program: str) -> dict:
    """The bundle's config with the process replaced by the exit(0) program (bound read-only at
    EXIT0_PATH) and the rootfs made absolute (the copy lives elsewhere); the original is untouched."""
    cfg = copy.deepcopy(bundle.config)
    cfg.setdefault("root", {})["path"] = bundle.rootfs
    cfg.setdefault("process", {})["args"] = [EXIT0_PATH]
    cfg["mounts"] = [*(cfg.get("mounts") or []),
                     {"destination": EXIT0_PATH, "type": "bind", "source": program,
                      "options": ["bind", "ro", "nosuid", "nodev"]}]
    return cfg


def write_copy(bundle: Bundle, cid: str, program: str, base: str = RUN_BASE) -> str:
    """The bundle's exit(0) copy for container `cid`: its directory (config.json written atomically)."""
    if not cid or "/" in cid or cid.startswith("."):
        raise UsageError(f"container id {cid!r}: not one migrt can keep a bundle copy for")
    d = os.path.join(base, "bundles", cid)
    os.makedirs(d, mode=0o700, exist_ok=True)
    tmp = os.path.join(d, ".config.json.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(exit0_config(bundle, program), fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, os.path.join(d, "config.json"))
    return d


def sweep(root: str, base: str = RUN_BASE) -> None:
    """Bundle copies whose container runc no longer knows (state root `root`) go."""
    d = os.path.join(base, "bundles")
    for cid in os.listdir(d) if os.path.isdir(d) else []:
        if not os.path.exists(os.path.join(root, cid)):
            shutil.rmtree(os.path.join(d, cid), ignore_errors=True)


def with_bundle(args: list[str], bundle_dir: str) -> list[str]:
    """A create's subcommand arguments with --bundle (any spelling) replaced by `bundle_dir`."""
    out, skip = ["--bundle", bundle_dir], False
    for i, tok in enumerate(args):
        if skip:
            skip = False
        elif tok == "--":
            return out + args[i:]
        elif tok in ("-b", "--b", "-bundle", "--bundle"):
            skip = True
        elif not tok.startswith(("-b=", "--b=", "-bundle=", "--bundle=")):
            out.append(tok)
    return out


def ran(members: list[Member], name: str, image: str, parts: dict[str, str]) -> tuple[bool, str]:
    """The source's answer for container `name` (image as the new pod gives it) of a new pod listing
    `parts`: (ran to completion, why)."""
    same = [m for m in members if m.name == name]
    if any(m.running for m in same):
        return False, f"container {name} runs in the source pod: not an init container that completed"
    running = [m for m in members if m.running]
    problems = mismatch(running, parts, "the source pod") if running else ["no container of it runs"]
    if problems:
        return False, f"the source pod's running containers are not the new pod's list: {'; '.join(problems)}"
    if same and image and same[-1].image and same[-1].image != image:
        return False, f"container {name}: image {image!r}, the source pod's is {same[-1].image!r}"
    if same:
        return True, f"container {name} ran to completion in the source pod (stopped there)"
    return True, (f"container {name} is no longer in the source pod (containerd removes a container whose task "
                  "ended) and every listed container runs there, which kubelet allows only once every init "
                  "container succeeded")


def ask(cfg, bundle: Bundle, value: str, pod: str, cid: str) -> bool:
    """Asks the source's agent whether this create's container ran there (module doc)."""
    from migrt.migration.channel import RemoteError
    from migrt.migration.protocol import TransferError
    from migrt.migration.pull import PeerUnreachable, admit_peer, parse
    from migrt.migration.tls import TLSFiles
    from migrt.migration.wire import connect, load_key, parse_address
    from migrt.pods.members import parse_listed

    meta = bundle.cri_metadata()
    name = meta.get("container_name", "")
    address, source = parse(value, name)
    if "container_id" in source or len(value.split("/")) != 3:
        raise UsageError("a pod-level pull (migrt.io/migrate-pod) names the source pod, not a container: "
                         "migrt.io/migrate-from=<node>[:port]/<namespace>/<pod>")
    admit_peer(cfg, address)
    parts = parse_listed(pod)
    try:
        tls = TLSFiles(**cfg.migration_tls) if cfg.migration_tls else None
        ch = connect(address, load_key(cfg.migration_key_file), timeout=5.0, tls=tls,
                     stall=cfg.migration_stall_timeout)
    except TransferError as exc:
        log_mod.get().warning("init_ran_unreachable", address=address, detail=str(exc))
        raise PeerUnreachable(address) from exc
    try:
        ch.send({"type": "pull", "source": source, "namespace": meta.get("pod_namespace"),
                 "pod": meta.get("pod_name"), "container": name, "container_id": cid,
                 "agent_port": parse_address(cfg.agent_listen)[1],
                 "init_ran": {"image": meta.get("image_name", ""), "parts": parts}})
        answer = ch.recv("ran")
    except RemoteError as exc:  # the agent's refusal (one text whatever the reason): start fresh
        if exc.exit_code != PreconditionFailed.exit_code:
            raise
        log_mod.get().info("init_container_runs", container=name, source=value, reason=str(exc))
        return False
    finally:
        ch.close()
    log_mod.get().info("init_container_" + ("skipped" if answer.get("ran") is True else "runs"),
                       container=name, id=cid, source=value, reason=answer.get("why"))
    return answer.get("ran") is True


def on_create(call: Call, bundle: Bundle, value: str, pod: str) -> list[str] | None:
    """The create of a container a pod-level pull does not list: the lower runtime's argv that creates
    it as an exit(0) (it ran on the source), or None: it starts fresh."""
    from migrt import config as config_mod

    cfg = config_mod.load()
    log_mod.setup(cfg.log_file, cfg.log_level, component="migrt-runc")
    cid = call.container_id
    if not has_dev_tmpfs(bundle):
        log_mod.get().warning("init_container_runs", id=cid, reason="its bundle mounts no tmpfs at /dev")
        return None
    if not ask(cfg, bundle, value, pod, cid):
        return None
    sweep(call.root)
    copy_dir = write_copy(bundle, cid, exit0_program())
    argv = call.argv
    return [*[t for f in argv.global_flags for t in f.tokens], "create", *with_bundle(argv.rest, copy_dir)]

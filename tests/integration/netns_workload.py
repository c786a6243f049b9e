"""A stand-in CUDA process for tests/integration/test_migrate_gpu_netns.py, run by the host's Python
inside a rig bundle (tests/gpu/rig.py): it holds DATA_MIB of random data and a listening abstract unix
socket (the kind that clashed when a frozen source and its restored copy shared a network namespace),
counts in /data/status.json, and emulates the driver's checkpoint for the simulated GPU node
(migrt/gpu/fakenode.py host_copy): on SIGUSR1 it maps and fills COPY_MIB of private anonymous memory,
the "host copy of its GPU memory", records its address and hash in /data/copy.json and creates
/tmp/gpu-copy. /data/verify-<k> asks for the hashes of both, answered in /data/result-<k>.json.

    python netns_workload.py DATA_MIB COPY_MIB SOCKET_NAME
"""

import ctypes
import hashlib
import json
import mmap
import os
import signal
import socket
import sys
import time

DATA_MIB, COPY_MIB, NAME = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
copy = None


def write(name: str, obj: dict) -> None:
    tmp = f"/data/{name}.tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh)
    os.replace(tmp, f"/data/{name}")


def on_checkpoint(_sig, _frame) -> None:
    global copy
    m = mmap.mmap(-1, COPY_MIB << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.write(os.urandom(COPY_MIB << 20))
    copy = m
    write("copy.json", {"address": ctypes.addressof(ctypes.c_char.from_buffer(m)), "bytes": COPY_MIB << 20,
                        "sha256": hashlib.sha256(m).hexdigest()})
    open("/tmp/gpu-copy", "w").close()


def _name(raw) -> str:
    return (raw.decode(errors="replace") if isinstance(raw, bytes) else raw).lstrip("\0")


data = bytearray(os.urandom(DATA_MIB << 20))
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.bind("\0" + NAME)
sock.listen(1)
signal.signal(signal.SIGUSR1, on_checkpoint)
write("ready.json", {"sha256": hashlib.sha256(data).hexdigest()})
count, k = 0, 1
while True:
    count += 1
    write("status.json", {"count": count, "t": time.time()})
    if os.path.exists(f"/data/verify-{k}"):
        write(f"result-{k}.json", {"sha256": hashlib.sha256(data).hexdigest(),
                                   "copy": hashlib.sha256(copy).hexdigest() if copy is not None else None,
                                   "socket": _name(sock.getsockname())})
        k += 1
    time.sleep(0.1)

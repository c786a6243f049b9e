"""CudaDriverBackend against a stand-in libcuda built here with gcc (tests/unit/fakecuda.c): the exact
calls, the argument structs byte for byte, and how CUresult codes become migrt errors."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from migrt.gpu import cuda, session
from migrt.gpu.backend import (CHECKPOINTED, FAILED, LOCKED, RUNNING, GpuCannotRestore, GpuError, GpuUnavailable,
                                uuid_bytes)
from migrt.gpu.cuda import CudaDriverBackend

SOURCE = Path(__file__).with_name("fakecuda.c")
U0 = "GPU-00112233-4455-6677-8899-aabbccddeeff"
U1 = "GPU-ffeeddcc-bbaa-9988-7766-554433221100"


def _build(out: Path, *defines: str) -> Path:
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.fail("gcc is needed to build the stand-in libcuda (it is installed on CI)")
    subprocess.run([gcc, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", *defines, "-o", str(out), str(SOURCE),
                    "-lpthread"], check=True)
    return out


@pytest.fixture(scope="module")
def libs(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("fakecuda")
    return {"full": _build(d / "libfakecuda.so"), "old": _build(d / "libfakecuda-old.so", "-DNO_CHECKPOINT_API")}


class Fake:
    """The stand-in's controls (the same loaded library as the backend's: dlopen of one path)."""

    def __init__(self, path: Path) -> None:
        self.lib = ctypes.CDLL(str(path))
        self.lib.fakecuda_log.restype = ctypes.c_char_p
        self.lib.fakecuda_layout.restype = ctypes.c_long
        self.lib.fakecuda_layout.argtypes = [ctypes.c_char_p]
        self.lib.fakecuda_set_result.argtypes = [ctypes.c_char_p, ctypes.c_int]
        self.lib.fakecuda_reset()

    def log(self) -> list[str]:
        return self.lib.fakecuda_log().decode().splitlines()

    def result(self, call: str, code: int) -> None:
        assert self.lib.fakecuda_set_result(call.encode(), code) == 0

    def layout(self, what: str) -> int:
        return self.lib.fakecuda_layout(what.encode())


@pytest.fixture
def fake(libs) -> Fake:
    return Fake(libs["full"])


@pytest.fixture
def backend(libs, fake) -> CudaDriverBackend:
    return CudaDriverBackend(library=str(libs["full"]))


def test_struct_layout_matches_the_c_compiler(fake):
    for name, struct in (("lock", cuda.CUcheckpointLockArgs), ("checkpoint", cuda.CUcheckpointCheckpointArgs),
                         ("restore", cuda.CUcheckpointRestoreArgs), ("unlock", cuda.CUcheckpointUnlockArgs),
                         ("pair", cuda.CUcheckpointGpuPair)):
        assert ctypes.sizeof(struct) == fake.layout(f"sizeof {name}"), name
    assert fake.layout("sizeof restore") == 64 and fake.layout("sizeof pair") == 32
    offsets = {
        "lock.timeoutMs": cuda.CUcheckpointLockArgs.timeoutMs.offset,
        "lock.reserved1": cuda.CUcheckpointLockArgs.reserved1.offset,
        "restore.gpuPairs": cuda.CUcheckpointRestoreArgs.gpuPairs.offset,
        "restore.gpuPairsCount": cuda.CUcheckpointRestoreArgs.gpuPairsCount.offset,
        "restore.reserved": cuda.CUcheckpointRestoreArgs.reserved.offset,
        "restore.reserved1": cuda.CUcheckpointRestoreArgs.reserved1.offset,
        "pair.newUuid": cuda.CUcheckpointGpuPair.newUuid.offset,
    }
    for what, off in offsets.items():
        assert off == fake.layout(f"offset {what}"), what
    assert offsets["lock.timeoutMs"] == 0 and offsets["restore.gpuPairsCount"] == 8
    assert offsets["restore.reserved1"] == 56


def test_cuinit_first_then_the_calls_with_their_arguments(backend, fake):
    assert backend.available()
    backend.lock(1234, 7500)
    backend.checkpoint(1234)
    backend.restore(1234)
    backend.unlock(1234)
    assert fake.log() == [
        "cuInit flags=0",
        "lock pid=1234 timeoutMs=7500 reserved_zero=1",
        "checkpoint pid=1234 args_zero=1",
        "restore pid=1234 count=0 pairs_null=1 reserved_zero=1",
        "unlock pid=1234 args_zero=1",
    ]


def test_cuinit_runs_once_per_backend(backend, fake):
    backend.lock(1)
    backend.unlock(1)
    assert [line for line in fake.log() if line.startswith("cuInit")] == ["cuInit flags=0"]


def test_restore_passes_the_uuid_pairs(backend, fake):
    remap = [(uuid_bytes(U0), uuid_bytes(U1)), (uuid_bytes(U1), uuid_bytes(U0))]
    backend.restore(42, remap)
    assert fake.log()[-1] == (
        "restore pid=42 count=2 pairs_null=0 reserved_zero=1"
        " 00112233445566778899aabbccddeeff->ffeeddccbbaa99887766554433221100"
        " ffeeddccbbaa99887766554433221100->00112233445566778899aabbccddeeff"
    )


def test_a_malformed_pair_is_refused_before_the_call(backend, fake):
    with pytest.raises(ValueError, match="16 bytes"):
        backend.restore(42, [(b"short", uuid_bytes(U1))])
    assert not any(line.startswith("restore") for line in fake.log())


@pytest.mark.parametrize("value, state", [(0, RUNNING), (1, LOCKED), (2, CHECKPOINTED), (3, FAILED)])
def test_state_values(backend, fake, value, state):
    fake.lib.fakecuda_set_state(value)
    assert backend.state(77) == state
    assert fake.log()[-1] == "state pid=77"


def test_unknown_state_value_is_an_error(backend, fake):
    fake.lib.fakecuda_set_state(9)
    with pytest.raises(GpuError, match="unknown state 9"):
        backend.state(77)


def test_restore_thread_id(backend, fake):
    assert backend.restore_thread_id(5) == 4242
    assert fake.log()[-1] == "tid pid=5"


def test_driver_api_version(backend):
    assert backend.driver_api_version() == 13000


def test_error_codes_become_migrt_errors_with_the_drivers_words(backend, fake):
    fake.result("lock", 909)
    with pytest.raises(GpuError) as info:
        backend.lock(5, 100)
    exc = info.value
    assert str(exc).startswith("cuCheckpointProcessLock (pid 5) failed: CUDA_ERROR_TIMEOUT: the operation timed out")
    assert "raise the lock timeout" in str(exc)
    assert (exc.call, exc.pid, exc.code, exc.exit_code) == ("cuCheckpointProcessLock", 5, 909, 5)


def test_invalid_value_at_restore_explains_the_pairs(backend, fake):
    fake.result("restore", 1)
    with pytest.raises(GpuError, match="CUDA_ERROR_INVALID_VALUE: invalid argument; .*cover every GPU"):
        backend.restore(5, [(uuid_bytes(U0), uuid_bytes(U1))])


def test_not_supported_is_a_precondition(backend, fake):
    fake.result("checkpoint", 801)
    with pytest.raises(GpuUnavailable, match="CUDA_ERROR_NOT_SUPPORTED") as info:
        backend.checkpoint(5)
    assert info.value.exit_code == 8


def test_not_supported_at_restore_is_no_old_driver(backend, fake):
    """Measured on driver 580 with a NCCL job: the checkpoint worked, the restore said NOT_SUPPORTED.
    That is a process the driver cannot bring back, not a driver without checkpoints."""
    fake.result("restore", 801)
    fake.lib.fakecuda_set_state(2)  # the driver leaves it checkpointed
    with pytest.raises(GpuCannotRestore) as info:
        backend.restore(5)
    msg = str(info.value)
    assert "r570" not in msg and "does not support process checkpoints" not in msg
    assert "checkpointed this process but cannot restore it" in msg and "peer-to-peer or CUDA IPC" in msg
    assert "NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1" in msg and "610" in msg
    assert msg.endswith("(the driver now reports the process checkpointed)")
    assert (info.value.exit_code, info.value.code) == (5, 801)


@pytest.mark.parametrize("call, method, words", [
    ("lock", lambda b: b.lock(5), "not running on the GPU"),
    ("restore", lambda b: b.restore(5), "not checkpointed"),
    ("unlock", lambda b: b.unlock(5), "not locked"),
])
def test_illegal_state_is_explained_by_the_operation(backend, fake, call, method, words):
    fake.result(call, 401)
    with pytest.raises(GpuError, match=words):
        method(backend)


def test_not_supported_elsewhere_still_names_the_driver(backend, fake):
    fake.result("state", 801)
    with pytest.raises(GpuUnavailable, match="driver r570\\+ needed"):
        backend.state(5)


def test_a_code_the_driver_cannot_name(backend, fake):
    fake.result("unlock", 12345)
    with pytest.raises(GpuError, match="cuCheckpointProcessUnlock \\(pid 5\\) failed: CUresult 12345: unknown error"):
        backend.unlock(5)


def test_cuinit_failure_makes_the_backend_unavailable(libs, fake):
    fake.result("cuInit", 100)
    b = CudaDriverBackend(library=str(libs["full"]))
    assert not b.available()
    assert "cuInit failed: CUDA_ERROR_NO_DEVICE" in b.unavailable_reason()
    with pytest.raises(GpuUnavailable, match="CUDA_ERROR_NO_DEVICE"):
        b.lock(1)
    assert fake.log() == ["cuInit flags=0"]  # tried once, remembered


def test_a_driver_without_the_checkpoint_api(libs):
    b = CudaDriverBackend(library=str(libs["old"]))
    assert not b.available()
    assert "lacks cuCheckpointProcessLock" in b.unavailable_reason() and "r570" in b.unavailable_reason()


def test_no_library_at_all(tmp_path):
    b = CudaDriverBackend(library=str(tmp_path / "libcuda.so.1"))
    assert not b.available()
    with pytest.raises(GpuUnavailable, match="cannot load"):
        b.state(1)


def test_suspend_all_through_the_driver_backend(backend, fake):
    session.suspend_all([11, 12], backend, 3000)
    calls = [line for line in fake.log() if not line.startswith("cuInit")]
    assert sorted(calls[:2]) == ["lock pid=11 timeoutMs=3000 reserved_zero=1",
                                 "lock pid=12 timeoutMs=3000 reserved_zero=1"]
    assert sorted(calls[2:]) == ["checkpoint pid=11 args_zero=1", "checkpoint pid=12 args_zero=1"]


def test_suspend_all_undo_through_the_driver_backend(backend, fake):
    """checkpoint fails for everyone; the stand-in reports 'locked', so undo unlocks each."""
    fake.result("checkpoint", 401)
    fake.lib.fakecuda_set_state(1)
    with pytest.raises(GpuError, match="CUDA_ERROR_ILLEGAL_STATE"):
        session.suspend_all([11, 12], backend, parallel=False)
    assert [line for line in fake.log() if line.startswith("unlock")] == [
        "unlock pid=11 args_zero=1", "unlock pid=12 args_zero=1"]

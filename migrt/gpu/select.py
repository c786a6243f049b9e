"""Choosing the GPU backend: config `gpu_backend` (auto | cuda | none); auto is the CUDA driver
backend when libcuda.so.1 loads with the checkpoint API, else NoGpuBackend. MIGRT_CUDA_LIBRARY
names another library (a driver outside the loader's path). Tests set `override`, or MIGRT_FAKE_GPU
(a simulated node shared by processes: migrt/gpu/fakenode.py)."""

from __future__ import annotations

import os

from migrt.gpu import fakenode
from migrt.gpu.backend import GpuBackend
from migrt.gpu.cuda import LIBCUDA, CudaDriverBackend
from migrt.gpu.nogpu import NoGpuBackend

CHOICES = ("auto", "cuda", "none")
override: GpuBackend | None = None  # test seam: every get_backend() returns it when set


def get_backend(choice: str = "auto") -> GpuBackend:
    if override is not None:
        return override
    fake = fakenode.path()
    if fake:
        from migrt.gpu.fake import FileFakeGpuBackend

        return FileFakeGpuBackend(fake)
    if choice == "none":
        return NoGpuBackend("GPU support is off (config gpu_backend: none)")
    backend = CudaDriverBackend(os.environ.get("MIGRT_CUDA_LIBRARY") or LIBCUDA)
    if choice == "cuda" or backend.available():
        return backend
    return NoGpuBackend(backend.unavailable_reason() or "libcuda.so.1 not usable")


def unavailable_reason(backend: GpuBackend) -> str:
    fn = getattr(backend, "unavailable_reason", None)
    return (fn() if fn else None) or f"GPU backend {backend.name} is not available"

"""The tests' private containerd: scripts/lab/containerd.py's (shared with the demo), started with the
version the tests run by default and able to import the busybox test image.
MIGRT_TEST_CONTAINERD picks the versions the CRI tests run: unset runs "2" and "1.7", "all" adds
"1.6", or one name.
"""

from __future__ import annotations

import os

from scripts.lab import containerd as lab
from scripts.lab.containerd import DEPS, RELEASE_BIN, RELEASE_PATH, SYSTEM, VERSIONS, bin_dir, config_version, missing
from tests.helpers.oci_image import IMAGE_REF, build_image_tar

__all__ = ["DEPS", "RELEASE_BIN", "RELEASE_PATH", "SYSTEM", "VERSIONS", "DEFAULT_VERSIONS", "Containerd", "bin_dir",
           "config_version", "default_version", "missing", "test_versions"]
DEFAULT_VERSIONS = (SYSTEM, "1.7")


def test_versions() -> list[str]:
    """The containerd versions the tests run against (MIGRT_TEST_CONTAINERD, default all)."""
    want = os.environ.get("MIGRT_TEST_CONTAINERD", "").strip()
    if not want:
        return list(DEFAULT_VERSIONS)
    if want == "all":
        return list(VERSIONS)
    if want not in VERSIONS:
        raise ValueError(f"MIGRT_TEST_CONTAINERD={want!r}: expected one of {', '.join(VERSIONS)} or 'all'")
    return [want]


test_versions.__test__ = False  # a helper, not a test


def default_version() -> str:
    """The version of tests that run one containerd (the system's unless MIGRT_TEST_CONTAINERD names one)."""
    versions = test_versions()
    return versions[0] if len(versions) == 1 else SYSTEM


class Containerd(lab.Containerd):
    def __init__(self, base: str, namespace: str = "migrt-test", extra_config: str = "", cri: bool = False,
                 version: str | None = None) -> None:
        super().__init__(base, namespace=namespace, extra_config=extra_config, cri=cri,
                         version=version or default_version())

    def import_busybox(self) -> str:
        return self.import_image(build_image_tar(os.path.join(self.base, "busybox-oci.tar")), IMAGE_REF)

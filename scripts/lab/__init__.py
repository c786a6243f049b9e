"""What the demo (scripts/demo.py) and the tests share, and nothing either takes from the test set-up:
a private containerd (containerd.py), an OCI image written from a root directory (oci_image.py), a
root directory made of this host's own programs (host_rootfs.py), the counter workload (workloads.py)."""

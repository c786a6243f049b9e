"""GPU state of CUDA processes: one backend interface (CUDA driver API, none, fake), the inventory
(NVML, or /proc/driver/nvidia), finding a container's CUDA processes, and suspend/resume of all of
them. Standard library only, except the optional pynvml in `inventory`: the CRIU action script in
hooks/ and migrt-runc's hot path import these modules.
"""

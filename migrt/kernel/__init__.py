"""The kernel interface, on the lowest floor beside errors and log: libc through ctypes with its
prototypes (libc.py), the mmap/madvise/userfaultfd numbers (mm.py), durable files: the one atomic
write and the 64 MiB unit of large-file work (files.py). Standard library only; ctypes only in libc.py,
which the restore path does not import before CRIU runs."""

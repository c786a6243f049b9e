"""Seccomp filters compared by what they do: a restored process keeps the BPF programs its checkpoint
recorded (CRIU restores them; runc applies no linux.seccomp to restored tasks), so a restore proves
that those programs, stacked as the kernel stacks them, deny at least what the new bundle's profile
denies, for every input the kernel can hand them (ops/restore_privileges.py).

  bpf.py      classic BPF as seccomp runs it: a decoder, a concrete interpreter and a symbolic
              reading that splits the inputs (struct seccomp_data) into regions of equal outcome
  profile.py  linux.seccomp compiled as runc compiles it (libseccomp, then runc's -ENOSYS stub)
  compare.py  the image's filter chain against the profile's program, region by region
"""

# Sourced by build-payload.sh and install-host.sh (POSIX sh; od and dd only, no patchelf on a node).
#
# The payload's executables (python/bin/python3.X, criu/sbin/criu) name the payload's own dynamic loader,
# PREFIX/libc/ld-linux-*.so.*, as their ELF interpreter (PT_INTERP): an absolute path, the one thing the
# kernel reads before any RPATH or $ORIGIN applies. The build gives that segment room for INTERP_ROOM
# bytes; a copy installed under another prefix gets its loader's path written into the same bytes, in
# place (the rest NUL: the kernel reads the string up to its first NUL and checks the segment ends in one).
# ELF64 little-endian only (x86_64 and aarch64, the payload's two architectures).

INTERP_ROOM=256

# elf_u FILE OFFSET SIZE: the unsigned little-endian integer of SIZE bytes at OFFSET.
elf_u() { od -An -v -t "u$3" -j "$2" -N "$3" "$1" | tr -d ' \n'; }

# elf_interp_at FILE: "OFFSET SIZE" of FILE's PT_INTERP segment; fails for anything else.
elf_interp_at() {
    [ "$(od -An -v -t u1 -N 6 "$1" | tr -d ' \n')" = 12769767021 ] || return 1  # \177ELF, 64-bit, little-endian
    _ph=$(elf_u "$1" 32 8) _phsize=$(elf_u "$1" 54 2) _phnum=$(elf_u "$1" 56 2) _i=0
    while [ "$_i" -lt "$_phnum" ]; do
        _at=$((_ph + _i * _phsize))
        if [ "$(elf_u "$1" "$_at" 4)" = 3 ]; then  # PT_INTERP
            echo "$(elf_u "$1" $((_at + 8)) 8) $(elf_u "$1" $((_at + 32)) 8)"
            return 0
        fi
        _i=$((_i + 1))
    done
    return 1
}

# set_elf_interp FILE PATH: PATH as FILE's interpreter, in place; fails (FILE unchanged) where it does
# not fit or FILE has no interpreter.
set_elf_interp() {
    _seg=$(elf_interp_at "$1") || { echo "$1: not an ELF64 little-endian executable with an interpreter" >&2; return 1; }
    _off=${_seg% *} _size=${_seg#* } _len=$(printf '%s' "$2" | wc -c)
    [ "$_len" -lt "$_size" ] || { echo "$1: interpreter path $2 longer than the $((_size - 1)) bytes it has room for" >&2; return 1; }
    { printf '%s' "$2"; head -c $((_size - _len)) /dev/zero; } | dd of="$1" bs=1 seek="$_off" conv=notrunc 2>/dev/null
}

# elf_interp FILE: FILE's interpreter path.
elf_interp() {
    _seg=$(elf_interp_at "$1") || return 1
    dd if="$1" bs=1 skip="${_seg% *}" count="${_seg#* }" 2>/dev/null | tr -d '\000'
}

# Sourced by the GPU machine's run scripts (tests/gpu/run_on_device.sh, bench/run_warm_start_on_device.sh).
# CRIU locks a container's own network namespace with iptables-restore. Debian's iptables package
# names it only through update-alternatives (not run by dpkg -x): point the names at the nft build.
for _t in iptables ip6tables; do
    _d=/opt/migrt-deps/usr/sbin
    if ! command -v $_t-restore >/dev/null 2>&1 && [ -x $_d/xtables-nft-multi ]; then
        ln -sf xtables-nft-multi $_d/$_t-restore; ln -sf xtables-nft-multi $_d/$_t-save; ln -sf xtables-nft-multi $_d/$_t
    fi
done
unset _t _d
# The extensions (libxt_standard.so: ACCEPT/DROP, ...) unpacked beside the binary, not where the build
# looks for them: without this, `iptables -j DROP` (the pod hold's loopback lock, pods/netlock.py) reads
# as a jump to a chain named DROP.
_x=/opt/migrt-deps/usr/lib/x86_64-linux-gnu/xtables
if [ -d $_x ] && [ ! -e /usr/lib/x86_64-linux-gnu/xtables/libxt_standard.so ]; then
    export XTABLES_LIBDIR=$_x
fi
unset _x

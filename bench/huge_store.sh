# Sourced by the GPU runners (bench/run_gpu_*_on_device.sh) after $OUT/environment.txt exists.
# GPU_STORE_HUGE_GIB=N: the nodes' directories (stores, images, rootfs) on a private tmpfs of N GiB
# mounted huge=within_size (the per-mount setting docs/install.md recommends for migrt's store on GPU
# nodes: dumps and receives land in 2 MiB pages), exported as MIGRT_GPU_TEST_DIR; unmounted on exit
# together with HUGE_DIR (the roundtrip runner's raw@hugetmpfs mount), when set. Nothing node-wide.
if [ -n "${GPU_STORE_HUGE_GIB:-}" ]; then
    STORE_DIR=$(mktemp -d /tmp/migrt-store-huge.XXXXXX)
    if mount -t tmpfs -o "huge=within_size,size=${GPU_STORE_HUGE_GIB}G,mode=0755" migrt-store "$STORE_DIR"; then
        export MIGRT_GPU_TEST_DIR="$STORE_DIR"
        echo "store: private tmpfs huge=within_size ${GPU_STORE_HUGE_GIB}G at $STORE_DIR" >> "$OUT/environment.txt"
    else
        echo "store: mounting a huge=within_size tmpfs failed; /dev/shm" >> "$OUT/environment.txt"
    fi
    trap '[ -n "${HUGE_DIR:-}" ] && { umount "$HUGE_DIR"; rmdir "$HUGE_DIR"; } 2>/dev/null; umount -l "$STORE_DIR" 2>/dev/null; rmdir "$STORE_DIR" 2>/dev/null' EXIT
fi

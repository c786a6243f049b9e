/* A container process holding N MiB of checksummed data in memory, for bench/migration.py.
 *
 *   memhog MIB [GAP]
 *
 * Fills MIB MiB of anonymous memory with xorshift64 data (every page touched), prints
 * "ready <fnv1a-64 of the data>", then every 10 ms "tick <n> <CLOCK_REALTIME seconds>" (the gaps
 * in these timestamps show how long the process was frozen). On SIGUSR1 it hashes the whole buffer
 * again and prints "sum <hash>": equal to the ready line when the memory came through intact.
 * Built static at bench time (gcc -static -O2) into a busybox rootfs.
 * GAP (bench/restore_start.py): every GAP-th page is never written (no huge pages), so the dump has
 * a hole there and CRIU's pagemap one entry per GAP-1 pages, as for a fragmented heap (the planning
 * of a lazy restore grows with the entries, not with the bytes).
 */
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static volatile sig_atomic_t want_sum;

static void on_usr1(int sig) { (void)sig; want_sum = 1; }

static uint64_t fnv(const uint64_t *p, size_t n)
{
	uint64_t h = 1469598103934665603ULL;
	for (size_t i = 0; i < n; i++)
		h = (h ^ p[i]) * 1099511628211ULL;
	return h;
}

int main(int argc, char **argv)
{
	if (argc != 2 && argc != 3) {
		fprintf(stderr, "usage: memhog MIB [GAP]\n");
		return 2;
	}
	size_t words = (size_t)strtoull(argv[1], NULL, 10) << 17; /* MiB / 8 bytes */
	size_t gap = argc == 3 ? (size_t)strtoull(argv[2], NULL, 10) : 0;
	uint64_t *p = mmap(NULL, words * 8, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (p == MAP_FAILED) {
		perror("mmap");
		return 1;
	}
	if (gap)
		madvise(p, words * 8, MADV_NOHUGEPAGE);
	uint64_t x = 88172645463325252ULL;
	for (size_t i = 0; i < words; i++) {
		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		if (!gap || (i >> 9) % gap != gap - 1) /* 512 words a page */
			p[i] = x;
	}
	struct sigaction sa;
	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = on_usr1;
	sa.sa_flags = SA_RESTART;
	sigaction(SIGUSR1, &sa, NULL);
	printf("ready %016llx\n", (unsigned long long)fnv(p, words));
	fflush(stdout);
	for (unsigned long n = 1;; n++) {
		struct timespec ts, nap = {0, 10 * 1000 * 1000};
		clock_gettime(CLOCK_REALTIME, &ts);
		printf("tick %lu %lld.%09ld\n", n, (long long)ts.tv_sec, ts.tv_nsec);
		if (want_sum) {
			want_sum = 0;
			printf("sum %016llx\n", (unsigned long long)fnv(p, words));
		}
		fflush(stdout);
		nanosleep(&nap, NULL);
	}
}

/* A workload that keeps changing its address space, for the page filler's tests.
 *
 *   churn MIB [PROCS]
 *
 * PROCS processes (the first forks the others) each fill MIB MiB of anonymous memory with
 * xorshift data (a seed per process) and print "ready <i> <fnv1a-64>". Then, every few ms, each:
 *   - forks a child that checks 64 slices of the data against their hashes (exit 0 if equal),
 *   - madvise(MADV_DONTNEED)s a 1 MiB scratch area and checks it reads as zeros, then refills it,
 *   - mremap()s a 2 MiB area to another place and back, checking its hash each time;
 * and it keeps a 1 MiB MADV_WIPEONFORK area (each fork child checks it reads as zeros) and a 1 MiB
 * MADV_DONTFORK area (checked by the process itself), both full of data.
 * Any mismatch is counted. On SIGUSR1 each process hashes its data again and prints
 * "sum <i> <fnv> bad=<n> forks=<n> loops=<n>" (the first process passes the signal on).
 * Built static at test time (gcc -static -O2) into a busybox rootfs.
 */
#define _GNU_SOURCE
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define SLICES 64
#define SLICE (64 << 10)
#define SCRATCH (1 << 20)
#define MOVER (2 << 20)
#define SIDE (1 << 20)

static volatile sig_atomic_t want_sum;
static pid_t kids[64];
static int nkids;

static void on_usr1(int sig) { (void)sig; want_sum = 1; }

static uint64_t fnv(const unsigned char *p, size_t n)
{
	uint64_t h = 1469598103934665603ULL;
	for (size_t i = 0; i < n; i++)
		h = (h ^ p[i]) * 1099511628211ULL;
	return h;
}

static void fill(uint64_t *p, size_t words, uint64_t x)
{
	for (size_t i = 0; i < words; i++) {
		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		p[i] = x;
	}
}

static void *map(size_t n)
{
	void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (p == MAP_FAILED) {
		perror("mmap");
		exit(1);
	}
	return p;
}

static void run(int idx, size_t mib)
{
	size_t bytes = mib << 20;
	unsigned char *data = map(bytes);
	fill((uint64_t *)data, bytes / 8, 88172645463325252ULL + (uint64_t)idx * 7919);
	uint64_t slice_hash[SLICES];
	size_t stride = bytes / SLICES;
	for (int s = 0; s < SLICES; s++)
		slice_hash[s] = fnv(data + s * stride, SLICE < stride ? SLICE : stride);
	unsigned char *scratch = map(SCRATCH);
	unsigned char *mover = map(MOVER);
	unsigned char *spare = map(MOVER); /* where mover goes and comes back from */
	fill((uint64_t *)mover, MOVER / 8, 12345 + idx);
	uint64_t mover_hash = fnv(mover, MOVER);
	unsigned char *wipe = map(SIDE), *nofork = map(SIDE);
	fill((uint64_t *)wipe, SIDE / 8, 777 + idx);
	fill((uint64_t *)nofork, SIDE / 8, 999 + idx);
	uint64_t nofork_hash = fnv(nofork, SIDE);
	if (madvise(wipe, SIDE, MADV_WIPEONFORK) || madvise(nofork, SIDE, MADV_DONTFORK))
		perror("madvise");
	printf("ready %d %016llx\n", idx, (unsigned long long)fnv(data, bytes));
	fflush(stdout);
	unsigned long bad = 0, forks = 0, loops = 0;
	for (;;) {
		loops++;
		pid_t c = fork();
		if (c == 0) {
			for (int s = 0; s < SLICES; s++)
				if (fnv(data + s * stride, SLICE < stride ? SLICE : stride) != slice_hash[s])
					_exit(1);
			for (size_t i = 0; i < SIDE; i += 4096)
				if (wipe[i] != 0)
					_exit(2);
			_exit(0);
		}
		if (c > 0) {
			int st = 0;
			forks++;
			waitpid(c, &st, 0);
			if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
				bad++;
		}
		if (fnv(nofork, SIDE) != nofork_hash)
			bad++;
		memset(scratch, 0xab, SCRATCH);
		madvise(scratch, SCRATCH, MADV_DONTNEED);
		for (size_t i = 0; i < SCRATCH; i += 4096)
			if (scratch[i] != 0)
				bad++;
		/* over the spare mapping (unmapping it) and back: the spare address stays free after */
		void *moved = mremap(mover, MOVER, MOVER, MREMAP_MAYMOVE | MREMAP_FIXED, spare);
		if (moved == MAP_FAILED || fnv(moved, MOVER) != mover_hash)
			bad++;
		if (moved != MAP_FAILED && mremap(moved, MOVER, MOVER, MREMAP_MAYMOVE | MREMAP_FIXED, mover) != mover)
			bad++;
		if (want_sum) {
			want_sum = 0;
			for (int k = 0; k < nkids; k++)
				kill(kids[k], SIGUSR1);
			printf("sum %d %016llx bad=%lu forks=%lu loops=%lu\n", idx, (unsigned long long)fnv(data, bytes),
			       bad, forks, loops);
			fflush(stdout);
		}
		struct timespec nap = {0, 2 * 1000 * 1000};
		nanosleep(&nap, NULL);
	}
}

int main(int argc, char **argv)
{
	if (argc < 2) {
		fprintf(stderr, "usage: churn MIB [PROCS]\n");
		return 2;
	}
	size_t mib = strtoull(argv[1], NULL, 10);
	int procs = argc > 2 ? atoi(argv[2]) : 1;
	struct sigaction sa;
	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = on_usr1;
	sa.sa_flags = SA_RESTART;
	sigaction(SIGUSR1, &sa, NULL);
	setvbuf(stdout, NULL, _IOLBF, 0);
	for (int i = 1; i < procs && i < 64; i++) {
		pid_t p = fork();
		if (p == 0) {
			nkids = 0;
			run(i, mib);
		}
		kids[nkids++] = p;
	}
	run(0, mib);
	return 0;
}

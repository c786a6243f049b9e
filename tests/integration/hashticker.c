/* A pod container's process holding MIB MiB of random data, for the CRI page-filler test.
 *
 *   hashticker MIB
 *
 * Fills MIB MiB of anonymous memory with xorshift64 data from a random seed (getrandom: every run
 * holds other data), then every 0.5 s prints "tick <n> <fnv1a-64 at start> <fnv1a-64 now>", hashing
 * the whole buffer again each time: the format of COUNTER in workloads.py, so parse_ticks() reads it.
 * After a restore the first tick touches every page, while the page filler may still be copying.
 * SIGTERM (CRI StopContainer) makes it print "term <n>" and exit with status 7.
 * Built static at test time (gcc -static -O2) and bind-mounted into the busybox container.
 */
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <time.h>

static volatile sig_atomic_t stop;

static void on_term(int sig) { (void)sig; stop = 1; }

static uint64_t fnv(const uint64_t *p, size_t n)
{
	uint64_t h = 1469598103934665603ULL;
	for (size_t i = 0; i < n; i++)
		h = (h ^ p[i]) * 1099511628211ULL;
	return h;
}

int main(int argc, char **argv)
{
	if (argc != 2) {
		fprintf(stderr, "usage: hashticker MIB\n");
		return 2;
	}
	size_t words = (size_t)strtoull(argv[1], NULL, 10) << 17; /* MiB / 8 bytes */
	uint64_t *p = mmap(NULL, words * 8, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (p == MAP_FAILED) {
		perror("mmap");
		return 1;
	}
	uint64_t x = 0;
	while (x == 0)
		if (getrandom(&x, sizeof(x), 0) != sizeof(x)) {
			perror("getrandom");
			return 1;
		}
	for (size_t i = 0; i < words; i++) {
		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		p[i] = x;
	}
	struct sigaction sa;
	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = on_term;
	sigaction(SIGTERM, &sa, NULL);
	uint64_t h0 = fnv(p, words);
	for (unsigned long n = 1;; n++) {
		printf("tick %lu %016llx %016llx\n", n, (unsigned long long)h0, (unsigned long long)fnv(p, words));
		fflush(stdout);
		struct timespec nap = {0, 500 * 1000 * 1000};
		nanosleep(&nap, NULL); /* EINTR on SIGTERM */
		if (stop) {
			printf("term %lu\n", n);
			fflush(stdout);
			return 7;
		}
	}
}

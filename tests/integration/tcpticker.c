/* Two ends of one TCP connection over a pod's loopback, for the pod-level pull's test.
 *
 *   tcpticker serve PORT     listens on 127.0.0.1:PORT, takes ONE connection, echoes every line
 *   tcpticker client PORT [MS]  connects (retrying until the server listens), then every MS ms
 *                            (default 250) sends
 *                            "<n>\n", reads the echo, and prints "tick <n> <port> <port now>": its
 *                            local port at connect and now (getsockname), so parse_ticks() reads it
 *                            and one unchanged port means one connection, never re-made.
 *
 * A broken connection is never re-made: the client prints "broken <n> <errno>" and exits 3, the
 * server exits 4. Built static at test time and bind-mounted into the busybox containers.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static int line(int fd, char *buf, size_t size)
{
	size_t n = 0;
	while (n + 1 < size) {
		ssize_t r = read(fd, buf + n, 1);
		if (r <= 0)
			return -1;
		if (buf[n] == '\n')
			break;
		n++;
	}
	buf[n] = 0;
	return (int)n;
}

static struct sockaddr_in loopback(int port)
{
	struct sockaddr_in a;
	memset(&a, 0, sizeof(a));
	a.sin_family = AF_INET;
	a.sin_port = htons(port);
	a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	return a;
}

static int serve(int port)
{
	struct sockaddr_in a = loopback(port);
	int one = 1, s = socket(AF_INET, SOCK_STREAM, 0);
	setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	if (bind(s, (struct sockaddr *)&a, sizeof(a)) || listen(s, 1))
		return 2;
	int c = accept(s, NULL, NULL);
	char buf[64];
	while (line(c, buf, sizeof(buf)) >= 0) {
		size_t n = strlen(buf);
		buf[n] = '\n';
		if (write(c, buf, n + 1) != (ssize_t)n + 1)
			break;
	}
	return 4;
}

static int local_port(int fd)
{
	struct sockaddr_in a;
	socklen_t len = sizeof(a);
	return getsockname(fd, (struct sockaddr *)&a, &len) ? -1 : ntohs(a.sin_port);
}

static int client(int port, long ms)
{
	struct sockaddr_in a = loopback(port);
	int s;
	for (;;) {
		s = socket(AF_INET, SOCK_STREAM, 0);
		if (!connect(s, (struct sockaddr *)&a, sizeof(a)))
			break;
		close(s);
		usleep(100000);
	}
	int first = local_port(s);
	char buf[64];
	for (unsigned long n = 1;; n++) {
		int len = snprintf(buf, sizeof(buf), "%lu\n", n);
		if (write(s, buf, len) != len || line(s, buf, sizeof(buf)) < 0 || strtoul(buf, NULL, 10) != n) {
			printf("broken %lu %d\n", n, errno);
			fflush(stdout);
			return 3;
		}
		printf("tick %lu %d %d\n", n, first, local_port(s));
		fflush(stdout);
		struct timespec ts = {ms / 1000, (ms % 1000) * 1000000};
		nanosleep(&ts, NULL);
	}
}

int main(int argc, char **argv)
{
	if (argc != 3 && argc != 4) {
		fprintf(stderr, "usage: tcpticker serve|client PORT [MS]\n");
		return 2;
	}
	int port = atoi(argv[2]);
	return strcmp(argv[1], "serve") == 0 ? serve(port) : client(port, argc == 4 ? atol(argv[3]) : 250);
}

/*
 * A stand-in for libcuda.so.1 for tests/unit/test_gpu_ctypes.py: exports the symbols migrt's
 * CudaDriverBackend calls, records every call with what it received (argument structs decoded, and
 * whether their reserved bytes were zero) in a text log, and returns the CUresult a test asks for.
 * The argument structs are declared as the CUDA 13.0 driver API reference declares them; the
 * _Static_asserts pin the 64-byte ABI, and fakecuda_layout() lets the test compare ctypes' layout
 * with this compiler's.
 * Built by the test with: gcc -shared -fPIC [-DNO_CHECKPOINT_API] -o libfakecuda.so fakecuda.c
 */
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long cuuint64_t;

typedef struct { unsigned char bytes[16]; } CUuuid;
typedef struct {
	unsigned int timeoutMs;
	unsigned int reserved0;
	cuuint64_t reserved1[7];
} CUcheckpointLockArgs;
typedef struct { cuuint64_t reserved[8]; } CUcheckpointCheckpointArgs;
typedef struct { CUuuid oldUuid; CUuuid newUuid; } CUcheckpointGpuPair;
typedef struct {
	CUcheckpointGpuPair *gpuPairs;
	unsigned int gpuPairsCount;
	char reserved[52 - sizeof(CUcheckpointGpuPair *)];
	cuuint64_t reserved1;
} CUcheckpointRestoreArgs;
typedef struct { cuuint64_t reserved[8]; } CUcheckpointUnlockArgs;

_Static_assert(sizeof(CUcheckpointLockArgs) == 64, "lock args");
_Static_assert(sizeof(CUcheckpointCheckpointArgs) == 64, "checkpoint args");
_Static_assert(sizeof(CUcheckpointRestoreArgs) == 64, "restore args");
_Static_assert(sizeof(CUcheckpointUnlockArgs) == 64, "unlock args");
_Static_assert(sizeof(CUcheckpointGpuPair) == 32, "gpu pair");

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static char logbuf[1 << 16];
static size_t loglen;
static int initialized;
static int state_value;
static int restore_tid __attribute__((unused)) = 4242;

#define NCALLS 8
static const char *call_names[NCALLS] = {"cuInit", "lock", "checkpoint", "restore", "unlock", "state", "tid", "version"};
static int results[NCALLS];

static int call_index(const char *name)
{
	for (int i = 0; i < NCALLS; i++)
		if (strcmp(call_names[i], name) == 0)
			return i;
	return -1;
}

static void record(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	if (loglen < sizeof(logbuf) - 1) {
		int n = vsnprintf(logbuf + loglen, sizeof(logbuf) - loglen, fmt, ap);
		if (n > 0)
			loglen += (size_t)n < sizeof(logbuf) - loglen ? (size_t)n : sizeof(logbuf) - loglen - 1;
	}
	va_end(ap);
}

__attribute__((unused)) static int zero(const void *p, size_t n)
{
	const unsigned char *c = p;
	for (size_t i = 0; i < n; i++)
		if (c[i])
			return 0;
	return 1;
}

__attribute__((unused)) static void hex(char *out, const unsigned char *p, size_t n)
{
	for (size_t i = 0; i < n; i++)
		sprintf(out + 2 * i, "%02x", p[i]);
	out[2 * n] = 0;
}

/* -- test controls --------------------------------------------------------------------------- */
void fakecuda_reset(void)
{
	pthread_mutex_lock(&mu);
	loglen = 0;
	logbuf[0] = 0;
	initialized = 0;
	state_value = 0;
	memset(results, 0, sizeof(results));
	pthread_mutex_unlock(&mu);
}

int fakecuda_set_result(const char *call, int code)
{
	int i = call_index(call);
	if (i < 0)
		return -1;
	results[i] = code;
	return 0;
}

void fakecuda_set_state(int s) { state_value = s; }

const char *fakecuda_log(void) { return logbuf; }

/* sizes and offsets as this compiler lays the structs out */
long fakecuda_layout(const char *what)
{
	if (!strcmp(what, "sizeof lock")) return sizeof(CUcheckpointLockArgs);
	if (!strcmp(what, "sizeof checkpoint")) return sizeof(CUcheckpointCheckpointArgs);
	if (!strcmp(what, "sizeof restore")) return sizeof(CUcheckpointRestoreArgs);
	if (!strcmp(what, "sizeof unlock")) return sizeof(CUcheckpointUnlockArgs);
	if (!strcmp(what, "sizeof pair")) return sizeof(CUcheckpointGpuPair);
	if (!strcmp(what, "offset lock.timeoutMs")) return offsetof(CUcheckpointLockArgs, timeoutMs);
	if (!strcmp(what, "offset lock.reserved1")) return offsetof(CUcheckpointLockArgs, reserved1);
	if (!strcmp(what, "offset restore.gpuPairs")) return offsetof(CUcheckpointRestoreArgs, gpuPairs);
	if (!strcmp(what, "offset restore.gpuPairsCount")) return offsetof(CUcheckpointRestoreArgs, gpuPairsCount);
	if (!strcmp(what, "offset restore.reserved")) return offsetof(CUcheckpointRestoreArgs, reserved);
	if (!strcmp(what, "offset restore.reserved1")) return offsetof(CUcheckpointRestoreArgs, reserved1);
	if (!strcmp(what, "offset pair.newUuid")) return offsetof(CUcheckpointGpuPair, newUuid);
	return -1;
}

/* -- the driver API ---------------------------------------------------------------------------- */
static const struct { int code; const char *name, *text; } errors[] = {
	{0, "CUDA_SUCCESS", "no error"},
	{1, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
	{3, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
	{100, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
	{401, "CUDA_ERROR_ILLEGAL_STATE", "the operation cannot be performed in the present state"},
	{500, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
	{801, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
	{909, "CUDA_ERROR_TIMEOUT", "the operation timed out"},
};

CUresult cuGetErrorName(CUresult e, const char **s)
{
	for (size_t i = 0; i < sizeof(errors) / sizeof(errors[0]); i++)
		if (errors[i].code == e) {
			*s = errors[i].name;
			return 0;
		}
	*s = NULL;
	return 1;
}

CUresult cuGetErrorString(CUresult e, const char **s)
{
	for (size_t i = 0; i < sizeof(errors) / sizeof(errors[0]); i++)
		if (errors[i].code == e) {
			*s = errors[i].text;
			return 0;
		}
	*s = NULL;
	return 1;
}

CUresult cuInit(unsigned int flags)
{
	pthread_mutex_lock(&mu);
	record("cuInit flags=%u\n", flags);
	if (!results[0])
		initialized = 1;
	pthread_mutex_unlock(&mu);
	return results[0];
}

CUresult cuDriverGetVersion(int *v)
{
	*v = 13000;
	return results[7];
}

#ifndef NO_CHECKPOINT_API
#define ENTER(i)                               \
	pthread_mutex_lock(&mu);               \
	if (!initialized) {                    \
		record("%s before cuInit\n", call_names[i]); \
		pthread_mutex_unlock(&mu);     \
		return 3;                      \
	}

CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *a)
{
	ENTER(1)
	record("lock pid=%d timeoutMs=%u reserved_zero=%d\n", pid, a ? a->timeoutMs : 0,
	       a ? (a->reserved0 == 0 && zero(a->reserved1, sizeof(a->reserved1))) : -1);
	pthread_mutex_unlock(&mu);
	return results[1];
}

CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *a)
{
	ENTER(2)
	record("checkpoint pid=%d args_zero=%d\n", pid, a ? zero(a, sizeof(*a)) : -1);
	pthread_mutex_unlock(&mu);
	return results[2];
}

CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *a)
{
	ENTER(3)
	record("restore pid=%d count=%u pairs_null=%d reserved_zero=%d", pid, a ? a->gpuPairsCount : 0,
	       a ? a->gpuPairs == NULL : -1,
	       a ? (zero(a->reserved, sizeof(a->reserved)) && a->reserved1 == 0) : -1);
	if (a && a->gpuPairs) {
		for (unsigned int i = 0; i < a->gpuPairsCount; i++) {
			char o[33], n[33];
			hex(o, a->gpuPairs[i].oldUuid.bytes, 16);
			hex(n, a->gpuPairs[i].newUuid.bytes, 16);
			record(" %s->%s", o, n);
		}
	}
	record("\n");
	pthread_mutex_unlock(&mu);
	return results[3];
}

CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *a)
{
	ENTER(4)
	record("unlock pid=%d args_zero=%d\n", pid, a ? zero(a, sizeof(*a)) : -1);
	pthread_mutex_unlock(&mu);
	return results[4];
}

CUresult cuCheckpointProcessGetState(int pid, int *state)
{
	ENTER(5)
	record("state pid=%d\n", pid);
	*state = state_value;
	pthread_mutex_unlock(&mu);
	return results[5];
}

CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid)
{
	ENTER(6)
	record("tid pid=%d\n", pid);
	*tid = restore_tid;
	pthread_mutex_unlock(&mu);
	return results[6];
}
#endif

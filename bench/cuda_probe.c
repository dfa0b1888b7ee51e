/* A task that really uses its GPU: through the CUDA driver API (libcuda.so.1, which the NVIDIA
 * runtime mounts into the container), it creates a context on each GPU it can see, allocates
 * MIB mebibytes there, prints the GPU's UUID, and holds on until it is stopped, so that the
 * tasks sharing a GPU run CUDA work at the same time; with `once` it exits then (a new client's
 * whole start, for the MPS bench's timings). Nothing else is needed in the image.
 *
 *   cuda-probe [MIB [once]]      (default 1024)
 *
 * Exit 0 on success, 2 when libcuda is missing, 3 when a CUDA call fails. Build: cc -O2 -o cuda-probe cuda_probe.c -ldl
 */
#include <dlfcn.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;
typedef struct { unsigned char bytes[16]; } CUuuid;

static volatile sig_atomic_t stop;
static void on_signal(int sig) { (void)sig; stop = 1; }

#define LOAD(name) name##_t name = (name##_t)dlsym(cuda, #name); \
    if (!name) { fprintf(stderr, "cuda-probe: libcuda lacks %s\n", #name); return 2; }
#define CHECK(call) do { CUresult r = (call); if (r != 0) { \
    fprintf(stderr, "cuda-probe: %s failed with CUDA error %d\n", #call, r); return 3; } } while (0)

typedef CUresult (*cuInit_t)(unsigned int);
typedef CUresult (*cuDeviceGetCount_t)(int *);
typedef CUresult (*cuDeviceGet_t)(CUdevice *, int);
typedef CUresult (*cuDeviceGetUuid_t)(CUuuid *, CUdevice);
typedef CUresult (*cuCtxCreate_v2_t)(CUcontext *, unsigned int, CUdevice);
typedef CUresult (*cuMemAlloc_v2_t)(CUdeviceptr *, size_t);
typedef CUresult (*cuMemsetD8_v2_t)(CUdeviceptr, unsigned char, size_t);
typedef CUresult (*cuCtxSynchronize_t)(void);

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

int main(int argc, char **argv) {
    double started = now_ms();
    size_t mib = argc > 1 ? strtoul(argv[1], NULL, 10) : 1024;
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW);
    if (!cuda) { fprintf(stderr, "cuda-probe: no libcuda.so.1 (%s): this container got no GPU\n", dlerror()); return 2; }
    LOAD(cuInit) LOAD(cuDeviceGetCount) LOAD(cuDeviceGet) LOAD(cuDeviceGetUuid) LOAD(cuCtxCreate_v2)
    LOAD(cuMemAlloc_v2) LOAD(cuMemsetD8_v2) LOAD(cuCtxSynchronize)
    CHECK(cuInit(0));
    int count = 0;
    CHECK(cuDeviceGetCount(&count));
    printf("cuda-probe: %d GPU(s) visible\n", count);
    for (int i = 0; i < count; i++) {
        CUdevice dev; CUuuid id; CUcontext ctx; CUdeviceptr ptr;
        CHECK(cuDeviceGet(&dev, i));
        CHECK(cuDeviceGetUuid(&id, dev));
        CHECK(cuCtxCreate_v2(&ctx, 0, dev));
        CHECK(cuMemAlloc_v2(&ptr, mib << 20));
        CHECK(cuMemsetD8_v2(ptr, 0x5a, mib << 20));  /* touch it: the memory is really in use */
        CHECK(cuCtxSynchronize());
        unsigned char *b = id.bytes;
        printf("GPU %d: allocated %zu MiB (UUID: GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-"
               "%02x%02x%02x%02x%02x%02x)\n", i, mib, b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9],
               b[10], b[11], b[12], b[13], b[14], b[15]);
    }
    printf("cuda-probe: ready in %.0f ms\n", now_ms() - started);  /* a new client's whole start */
    fflush(stdout);
    if (argc > 2 && strcmp(argv[2], "once") == 0) return 0;
    signal(SIGTERM, on_signal);
    signal(SIGINT, on_signal);
    while (!stop) pause();
    return 0;
}

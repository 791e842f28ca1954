/* The OpenMP team the kernels (and PyTorch, whose libgomp they share) run on: how many threads, and each pinned to
 * one CPU, as vLLM-CPU pins its OpenMP threads (VLLM_CPU_OMP_THREADS_BIND). OpenMP keeps the thread count per
 * calling thread, and libgomp reuses one team per calling thread, so both are set from the thread that runs the
 * steps (cpu_threads.py). Linux only: elsewhere binding says it cannot.
 */
#define _GNU_SOURCE
#include <omp.h>
#include <stdint.h>

#ifdef __linux__
#include <sched.h>
#endif

/* The calling thread's parallel regions run `n` threads from now on. */
void tm_set_num_threads(int64_t n) { omp_set_num_threads((int)n); }

/* How many threads the calling thread's next parallel region runs. */
int64_t tm_max_threads(void) { return omp_get_max_threads(); }

/* Run `n` threads from now on, thread i of the calling thread's team pinned to CPU cpus[i]: 0, or -1 where a CPU
 * could not be taken (not this process's, or not Linux). */
int tm_bind_threads(const int32_t *cpus, int64_t n) {
    int failed = 0;
    omp_set_num_threads((int)n);
#ifdef __linux__
    #pragma omp parallel num_threads((int)n) reduction(|: failed)
    {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpus[omp_get_thread_num()], &set);
        failed |= sched_setaffinity(0, sizeof(set), &set) != 0;
    }
#else
    (void)cpus;
    failed = 1;
#endif
    return failed ? -1 : 0;
}

/* What the calling thread's team runs on: out[i] = the one CPU thread i may run on, -1 where it may run on several
 * (or not Linux); returns the team's size (at most `capacity` entries written). */
int64_t tm_thread_cpus(int32_t *out, int64_t capacity) {
    int64_t size = 0;
    #pragma omp parallel
    {
        int32_t cpu = -1;
#ifdef __linux__
        cpu_set_t set;
        if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) == 1)
            for (int c = 0; c < CPU_SETSIZE; c++)
                if (CPU_ISSET(c, &set)) cpu = c;
#endif
        const int i = omp_get_thread_num();
        if (i < capacity) out[i] = cpu;
        #pragma omp single
        size = omp_get_num_threads();
    }
    return size;
}

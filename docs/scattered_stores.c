/* What writing a step's scattered 4 KiB pages costs the CPU, whatever code
 * writes them: the attention group of the benchmark's allocated step (12
 * layers, 8 of every 11 blocks of the pool, sorted, in random positions)
 * against a contiguous write of as many bytes, best of 15 runs.
 *
 *     gcc -O2 -mavx2 -fopenmp -o scattered_stores docs/scattered_stores.c
 *     OMP_NUM_THREADS=1 ./scattered_stores 1024    # requests
 *
 * Ordinary stores must read each cache line before writing it; to pages in
 * random places the hardware cannot fetch those lines ahead. Non-temporal
 * stores do not read them. docs/benchmark.md has the numbers. */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { LAYERS = 12, PAGE = 4096, RUNS = 15 };

static double seconds(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return now.tv_sec + now.tv_nsec * 1e-9;
}

static int ascending(const void *a, const void *b) {
    return *(const int *)a - *(const int *)b;
}

static void ordinary(char *page) {
    __m256i value = _mm256_set1_epi8(1);
    for (int k = 0; k < PAGE / 32; k++) _mm256_store_si256((__m256i *)page + k, value);
}

static void non_temporal(char *page) {
    __m256i value = _mm256_set1_epi8(1);
    for (int k = 0; k < PAGE / 32; k++) _mm256_stream_si256((__m256i *)page + k, value);
}

/* Every layer's page of each block in `blocks`, layer by layer (as the
 * overlay's view walks them), the layers shared among the threads. */
static void write_pages(char *pool, long pool_blocks, const int *blocks, int count,
                        void (*write)(char *)) {
#pragma omp parallel for
    for (int layer = 0; layer < LAYERS; layer++)
        for (int i = 0; i < count; i++)
            write(pool + ((long)layer * pool_blocks + blocks[i]) * PAGE);
    _mm_sfence();
}

int main(int argc, char **argv) {
    int requests = argc > 1 ? atoi(argv[1]) : 1024;
    long pool_blocks = 1 + requests * 11L;
    int count = requests * 8;
    char *pool = aligned_alloc(PAGE, LAYERS * pool_blocks * PAGE);
    char *dense = aligned_alloc(PAGE, (long)LAYERS * count * PAGE);
    int *order = malloc(sizeof(int) * (pool_blocks - 1));
    int *next = malloc(sizeof(int) * count);
    memset(pool, 0, LAYERS * pool_blocks * PAGE);
    memset(dense, 0, (long)LAYERS * count * PAGE);
    for (int i = 0; i < pool_blocks - 1; i++) order[i] = i + 1;
    srand(0);
    for (long i = pool_blocks - 2; i > 0; i--) {
        long j = rand() % (i + 1);
        int swap = order[i];
        order[i] = order[j];
        order[j] = swap;
    }
    qsort(order, count, sizeof(int), ascending);
    for (int i = 0; i < count; i++) next[i] = i;  /* the same pages, side by side */

    const char *names[] = {"contiguous, ordinary stores", "scattered, ordinary stores",
                           "scattered, non-temporal stores", "side by side, ordinary stores"};
    double best[4] = {1e9, 1e9, 1e9, 1e9};
    for (int run = 0; run < RUNS; run++) {
        double times[4];
        double start = seconds();
#pragma omp parallel for
        for (long k = 0; k < (long)LAYERS * count * PAGE / 32; k++)
            _mm256_store_si256((__m256i *)dense + k, _mm256_set1_epi8(1));
        times[0] = seconds() - start;
        start = seconds();
        write_pages(pool, pool_blocks, order, count, ordinary);
        times[1] = seconds() - start;
        start = seconds();
        write_pages(pool, pool_blocks, order, count, non_temporal);
        times[2] = seconds() - start;
        start = seconds();
        write_pages(dense, count, next, count, ordinary);
        times[3] = seconds() - start;
        for (int i = 0; i < 4; i++)
            if (times[i] < best[i]) best[i] = times[i];
    }
    printf("%d requests, %.0f MiB of pages\n", requests, (double)LAYERS * count * PAGE / (1 << 20));
    for (int i = 0; i < 4; i++)
        printf("%-32s %8.2f ms  %.2fx\n", names[i], best[i] * 1e3, best[i] / best[0]);
    return 0;
}

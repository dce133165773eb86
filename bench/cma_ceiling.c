/*
 * The ceiling of cross-process copies (CMA) for scattered pieces on this host,
 * without UCX or NIXL: what any transport that copies one descriptor per
 * process_vm_readv() call could reach at best.
 *
 *     gcc -O2 -pthread -o /tmp/cma_ceiling bench/cma_ceiling.c && /tmp/cma_ceiling [piece_bytes]
 *
 * A child process owns a 256 MiB source buffer; the parent reads it into its own
 * 256 MiB buffer in pieces of piece_bytes (default 16 KiB, the default
 * `kvbridge demo` shape) taken in a random order, as a TP 2 -> 1 READ takes
 * them. Rows: 4 KiB pages or transparent huge pages (MADV_HUGEPAGE on both
 * buffers, as kvbridge's `huge_pages` does); 1 or 2 threads; 1 piece per call
 * (what UCX does for each NIXL descriptor) or 16 pieces per call (an iovec
 * gather, which NIXL 1.5.1 does not do for READs). Each figure is the best of 5
 * passes, against the best of 5 sequential memcpy() calls of 128 MiB in the same
 * process. Prints figures only.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define TOTAL (256UL << 20)
#define HUGE (2UL << 20)
#define MAX_PER_CALL 16

static pid_t child;
static char *src, *dst;
static int *order, pieces, per_call, threads;
static size_t piece;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static char *buffer(int huge) {
    char *p = mmap(NULL, TOTAL + HUGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        perror("mmap");
        exit(1);
    }
    p = (char *)(((unsigned long)p + HUGE - 1) & ~(HUGE - 1));
    madvise(p, TOTAL, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    memset(p, 1, TOTAL);
    return p;
}

static void *reader(void *arg) {
    long t = (long)arg;
    struct iovec local[MAX_PER_CALL], remote[MAX_PER_CALL];
    for (int i = t * per_call; i < pieces; i += per_call * threads) {
        int k = 0;
        for (; k < per_call && i + k < pieces; k++) {
            size_t off = (size_t)order[i + k] * piece;
            local[k] = (struct iovec){dst + off, piece};
            remote[k] = (struct iovec){src + off, piece};
        }
        if (process_vm_readv(child, local, k, remote, k, 0) < 0) {
            perror("process_vm_readv");
            exit(1);
        }
    }
    return NULL;
}

static double memcpy_best(void) {
    double best = 0;
    for (int rep = 0; rep < 5; rep++) {
        double t0 = now();
        memcpy(dst, dst + TOTAL / 2, TOTAL / 2);
        double gbs = (TOTAL / 2) / (now() - t0) / 1e9;
        if (gbs > best) best = gbs;
    }
    return best;
}

static double cma_best(void) {
    double best = 0;
    for (int rep = 0; rep < 5; rep++) {
        pthread_t th[2];
        double t0 = now();
        for (long t = 0; t < threads; t++) pthread_create(&th[t], NULL, reader, (void *)t);
        for (int t = 0; t < threads; t++) pthread_join(th[t], NULL);
        double gbs = TOTAL / (now() - t0) / 1e9;
        if (gbs > best) best = gbs;
    }
    return best;
}

int main(int argc, char **argv) {
    piece = argc > 1 ? strtoul(argv[1], NULL, 10) : 16384;
    if (piece < 64 || piece > TOTAL || TOTAL % piece) {
        fprintf(stderr, "piece_bytes must divide %lu and be at least 64\n", TOTAL);
        return 2;
    }
    pieces = TOTAL / piece;
    order = malloc(pieces * sizeof *order);
    for (int i = 0; i < pieces; i++) order[i] = i;
    srand(1);
    for (int i = pieces - 1; i > 0; i--) {
        int j = rand() % (i + 1), x = order[i];
        order[i] = order[j];
        order[j] = x;
    }
    printf("pieces of %zu bytes, 256 MiB in random order\n", piece);
    printf("pages      threads  pieces/call  CMA GB/s  memcpy GB/s  CMA / memcpy\n");
    for (int huge = 0; huge < 2; huge++) {
        int pipefd[2];
        if (pipe(pipefd)) return 1;
        child = fork();
        if (child == 0) {
            char *s = buffer(huge);
            if (write(pipefd[1], &s, sizeof s) != sizeof s) _exit(1);
            pause();
            _exit(0);
        }
        if (read(pipefd[0], &src, sizeof src) != sizeof src) return 1;
        dst = buffer(huge);
        for (threads = 1; threads <= 2; threads++) {
            for (per_call = 1; per_call <= MAX_PER_CALL; per_call *= MAX_PER_CALL) {
                double c = cma_best(), m = memcpy_best();
                printf("%-9s  %7d  %11d  %8.2f  %11.2f  %11.0f %%\n", huge ? "2 MiB" : "4 KiB",
                       threads, per_call, c, m, 100 * c / m);
            }
        }
        kill(child, SIGKILL);
        waitpid(child, NULL, 0);
        munmap(dst, TOTAL);
        close(pipefd[0]);
        close(pipefd[1]);
    }
    return 0;
}

/* The ceiling of the staging benchmarks: write the same files (same names, folders and sizes)
 * from one reused in-memory buffer, with N threads, as fast as the file system takes them.
 * No source is read and nothing is hashed.
 *
 *   ceiling_writer ROOT LIST THREADS [SRC]
 *
 * LIST has one "SIZE RELPATH" per line (no spaces in RELPATH), sorted so that files of a
 * folder are together.  Folders are created first (by the main thread, inside the timing);
 * thread t writes files t, t+N, t+2N, ... with write(2) calls of up to 8 MiB.
 *
 * With SRC, the copy floor instead: each file is read from SRC/RELPATH into the thread's own
 * reused buffer of FLOOR_BUF bytes, a chunk at a time, hashed (xxh3-128, streaming, as stagingloader
 * hashes) and written from there: the least work any copy that verifies can do, in C, with no
 * start-up.  The buffer is small enough to stay in the core's cache between the read, the hash and
 * the write (a floor through an 8 MiB buffer also writes and reads it back from memory): 4 x 1 GiB
 * into tmpfs took 1.86 s with 128 KiB against 2.38 s with 8 MiB, median of eight each, alternating
 * (docs/benchmarks.md).  The environment's BUF_KIB sets either buffer's size, for such comparisons.
 * Built with -I stagingloader/engine/_vendor/xxhash (benchmarks/bench_stage.py does).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

static long BUF_SIZE = 8L << 20; /* the ceiling's writes */
#define FLOOR_BUF (128L << 10)

typedef struct {
    char *path;
    long long size;
} item_t;

static item_t *items;
static long n_items;
static int n_threads;
static const char *root;
static const char *src_root; /* the copy floor's source, or NULL: the ceiling */
static char *buf;

static void mkdirs(char *path) { /* mkdir -p of path's parent */
    char *slash = strrchr(path, '/');
    if (!slash) return;
    *slash = 0;
    if (mkdir(path, 0755) != 0 && errno != EEXIST) {
        if (errno == ENOENT) {
            mkdirs(path);
            if (mkdir(path, 0755) != 0 && errno != EEXIST) { perror(path); exit(1); }
        } else { perror(path); exit(1); }
    }
    *slash = '/';
}

static void copy_one(const char *from, int out, long long size, char *own) {
    int in = open(from, O_RDONLY | O_CLOEXEC);
    if (in < 0) { perror(from); exit(1); }
    XXH3_state_t *h = XXH3_createState();
    XXH3_128bits_reset(h);
    long long left = size;
    while (left > 0) {
        ssize_t r = read(in, own, left < BUF_SIZE ? (size_t)left : (size_t)BUF_SIZE);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) { perror(from); exit(1); }
        XXH3_128bits_update(h, own, (size_t)r);
        for (ssize_t put = 0; put < r;) {
            ssize_t w = write(out, own + put, (size_t)(r - put));
            if (w < 0) { if (errno == EINTR) continue; perror(from); exit(1); }
            put += w;
        }
        left -= r;
    }
    volatile XXH128_hash_t digest = XXH3_128bits_digest(h); /* computed, as a verifying copy must */
    (void)digest;
    XXH3_freeState(h);
    close(in);
}

static void *worker(void *arg) {
    long t = (long)arg;
    char p[8192], from[8192];
    char *own = src_root ? malloc(BUF_SIZE) : NULL;
    for (long i = t; i < n_items; i += n_threads) {
        snprintf(p, sizeof p, "%s/%s", root, items[i].path);
        int fd = open(p, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        if (fd < 0) { perror(p); exit(1); }
        if (src_root) {
            snprintf(from, sizeof from, "%s/%s", src_root, items[i].path);
            copy_one(from, fd, items[i].size, own);
            if (close(fd) != 0) { perror(p); exit(1); }
            continue;
        }
        long long left = items[i].size;
        while (left > 0) {
            ssize_t w = write(fd, buf, left < BUF_SIZE ? (size_t)left : (size_t)BUF_SIZE);
            if (w < 0) { if (errno == EINTR) continue; perror(p); exit(1); }
            left -= w;
        }
        if (close(fd) != 0) { perror(p); exit(1); }
    }
    free(own);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 4 && argc != 5) { fprintf(stderr, "usage: %s ROOT LIST THREADS [SRC]\n", argv[0]); return 2; }
    root = argv[1];
    src_root = argc == 5 ? argv[4] : NULL;
    if (src_root) BUF_SIZE = FLOOR_BUF;
    if (getenv("BUF_KIB")) BUF_SIZE = atol(getenv("BUF_KIB")) << 10;
    if (BUF_SIZE < 4096) { fprintf(stderr, "BUF_KIB: at least 4\n"); return 2; }
    n_threads = atoi(argv[3]);
    if (n_threads < 1) n_threads = 1;
    FILE *f = fopen(argv[2], "r");
    if (!f) { perror(argv[2]); return 1; }
    long cap = 1024;
    items = malloc(cap * sizeof *items);
    char *line = NULL;
    size_t len = 0;
    while (getline(&line, &len, f) > 0) {
        long long size;
        char rel[4096];
        if (sscanf(line, "%lld %4095s", &size, rel) != 2) continue;
        if (n_items == cap) { cap *= 2; items = realloc(items, cap * sizeof *items); }
        items[n_items].path = strdup(rel);
        items[n_items].size = size;
        n_items++;
    }
    fclose(f);
    buf = malloc(BUF_SIZE);
    unsigned long long x = 0x9E3779B97F4A7C15ULL; /* xorshift: incompressible, deterministic */
    for (long i = 0; i < BUF_SIZE / 8; i++) {
        x ^= x << 13; x ^= x >> 7; x ^= x << 17;
        ((unsigned long long *)buf)[i] = x;
    }
    if (mkdir(root, 0755) != 0 && errno != EEXIST) { perror(root); return 1; }
    char p[8192], last[8192] = "";
    for (long i = 0; i < n_items; i++) {
        snprintf(p, sizeof p, "%s/%s", root, items[i].path);
        char *slash = strrchr(p, '/');
        size_t dlen = slash - p;
        if (strlen(last) == dlen && strncmp(last, p, dlen) == 0) continue;
        mkdirs(p);
        memcpy(last, p, dlen);
        last[dlen] = 0;
    }
    pthread_t th[64];
    if (n_threads > 64) n_threads = 64;
    for (long t = 0; t < n_threads; t++) pthread_create(&th[t], NULL, worker, (void *)t);
    for (long t = 0; t < n_threads; t++) pthread_join(th[t], NULL);
    return 0;
}

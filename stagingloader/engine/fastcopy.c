/* The copy worker's quick path for a small local file, in C: the system calls `cp` makes, plus the hash.
 *
 * copy_small(src, dev, ino, tmp, final, buffer, as_root, sync) -> (size, mtime_ns, digest) | None
 *
 * Opens `src` as the regular file the listing saw (device and inode `dev`, `ino` unless `ino` is 0), reads it
 * whole into `buffer` (a file larger than the buffer is not for this path), hashes it (xxh3-128, the digest
 * written as "xxh3_128:<32 hex digits>", as stagingloader.digest does), writes it to the new file `tmp`
 * (O_EXCL, O_NOFOLLOW), checks that the source did not change meanwhile (size, mtime, ctime, device, inode),
 * gives `tmp` the source's mtime, fsyncs it with `sync`, and renames it to `final` unless `final` is None.
 *
 * None means "something is unusual": the source is gone, replaced, not a regular file, grew past the buffer or
 * changed while it was read, or a call failed.  Nothing is left behind (`tmp` removed), and the caller copies the
 * file the careful way, which retries or says what is wrong.  Only a failed rename raises (OSError naming
 * `final`): the file was copied and verified, and the staging root refused it.
 *
 * As root, the source is opened with O_PATH first and checked before it is opened for reading through
 * /proc/self/fd, so a FIFO or a device swapped in for a listed file is never opened (see sources/stable.py, the
 * same steps in Python).  The interpreter lock is released for the whole copy.
 *
 * The Python fallback is Worker._quick_write in copyops.py; tests/engine/test_fastcopy.py runs both on the same
 * files.
 */
#define PY_SSIZE_T_CLEAN
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

#define PREFIX "xxh3_128:"

/* The listed regular file at `path`, open for reading, and its stat; -1 if it is not that (or any error). */
static int open_listed(const char *path, unsigned long long dev, unsigned long long ino, int as_root,
                       struct stat *st) {
    int fd;
#ifdef O_PATH
    if (as_root) {
        char proc[64];
        int pfd = open(path, O_PATH | O_CLOEXEC);
        if (pfd < 0) return -1;
        if (fstat(pfd, st) != 0 || !S_ISREG(st->st_mode) ||
            (ino && ((unsigned long long)st->st_dev != dev || (unsigned long long)st->st_ino != ino))) {
            close(pfd);
            return -1;
        }
        snprintf(proc, sizeof proc, "/proc/self/fd/%d", pfd);
        fd = open(proc, O_RDONLY | O_CLOEXEC); /* the same inode, never a new lookup; no /proc: -1, the careful way */
        close(pfd);
        return fd;
    }
#else
    (void)as_root;
#endif
    fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) return -1;
    if (fstat(fd, st) != 0 || !S_ISREG(st->st_mode) ||
        (ino && ((unsigned long long)st->st_dev != dev || (unsigned long long)st->st_ino != ino))) {
        close(fd);
        return -1;
    }
    return fd;
}

static int same_state(const struct stat *a, const struct stat *b) {
    return a->st_size == b->st_size && a->st_mtim.tv_sec == b->st_mtim.tv_sec &&
           a->st_mtim.tv_nsec == b->st_mtim.tv_nsec && a->st_ctim.tv_sec == b->st_ctim.tv_sec &&
           a->st_ctim.tv_nsec == b->st_ctim.tv_nsec && a->st_ino == b->st_ino && a->st_dev == b->st_dev;
}

enum { COPIED, UNUSUAL, RENAME_FAILED };

static PyObject *digest_string(XXH128_hash_t hash);

/* The copy itself, without the interpreter lock. */
static int copy(const char *src, unsigned long long dev, unsigned long long ino, const char *tmp, const char *final,
                char *buf, Py_ssize_t cap, int as_root, int sync, struct stat *before, XXH128_hash_t *hash,
                int *rename_errno) {
    struct stat after;
    int ok = 0, out, in = open_listed(src, dev, ino, as_root, before);
    if (in < 0) return UNUSUAL;
    if (before->st_size > cap) {
        close(in);
        return UNUSUAL;
    }
    out = open(tmp, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (out >= 0) {
        size_t size = (size_t)before->st_size, got = 0, put = 0;
        while (got < size) {
            ssize_t n = read(in, buf + got, size - got);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) break;
            got += (size_t)n;
        }
        if (got == size) {
            *hash = XXH3_128bits(buf, size);
            while (put < size) {
                ssize_t n = write(out, buf + put, size - put);
                if (n < 0 && errno == EINTR) continue;
                if (n <= 0) break;
                put += (size_t)n;
            }
            ok = put == size && fstat(in, &after) == 0 && same_state(before, &after);
        }
        if (ok && (before->st_mtim.tv_sec || before->st_mtim.tv_nsec)) {
            struct timespec times[2] = {before->st_mtim, before->st_mtim};
            ok = futimens(out, times) == 0;
        }
        if (ok && sync) ok = fsync(out) == 0;
        if (close(out) != 0) ok = 0;
        if (ok && final && rename(tmp, final) != 0) {
            *rename_errno = errno;
            unlink(tmp);
            close(in);
            return RENAME_FAILED;
        }
        if (!ok) unlink(tmp);
    }
    close(in);
    return ok ? COPIED : UNUSUAL;
}

static PyObject *copy_small(PyObject *self, PyObject *args) {
    PyObject *src_o, *tmp_o, *final_o, *src_b = NULL, *tmp_b = NULL, *final_b = NULL, *result = NULL;
    unsigned long long dev, ino;
    int as_root, sync, rc, rename_errno = 0;
    Py_buffer buf;
    struct stat before;
    XXH128_hash_t hash;
    (void)self;

    if (!PyArg_ParseTuple(args, "OKKOOw*pp:copy_small", &src_o, &dev, &ino, &tmp_o, &final_o, &buf, &as_root, &sync))
        return NULL;
    if (!PyUnicode_FSConverter(src_o, &src_b) || !PyUnicode_FSConverter(tmp_o, &tmp_b) ||
        (final_o != Py_None && !PyUnicode_FSConverter(final_o, &final_b)))
        goto done;

    Py_BEGIN_ALLOW_THREADS
    rc = copy(PyBytes_AS_STRING(src_b), dev, ino, PyBytes_AS_STRING(tmp_b),
              final_b ? PyBytes_AS_STRING(final_b) : NULL, (char *)buf.buf, buf.len, as_root, sync, &before, &hash,
              &rename_errno);
    Py_END_ALLOW_THREADS

    if (rc == RENAME_FAILED) {
        errno = rename_errno;
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, final_o);
    } else if (rc == UNUSUAL) {
        result = Py_NewRef(Py_None);
    } else {
        long long mtime_ns = (long long)before.st_mtim.tv_sec * 1000000000LL + before.st_mtim.tv_nsec;
        PyObject *digest = digest_string(hash);
        result = digest ? Py_BuildValue("(LLN)", (long long)before.st_size, mtime_ns, digest) : NULL;
    }
done:
    PyBuffer_Release(&buf);
    Py_XDECREF(src_b);
    Py_XDECREF(tmp_b);
    Py_XDECREF(final_b);
    return result;
}

static PyObject *digest_string(XXH128_hash_t hash) {
    XXH128_canonical_t canon;
    char digest[sizeof PREFIX + 32];
    static const char hex[] = "0123456789abcdef";
    XXH128_canonicalFromHash(&canon, hash);
    memcpy(digest, PREFIX, sizeof PREFIX - 1);
    for (int i = 0; i < 16; i++) {
        digest[sizeof PREFIX - 1 + 2 * i] = hex[canon.digest[i] >> 4];
        digest[sizeof PREFIX + 2 * i] = hex[canon.digest[i] & 15];
    }
    return PyUnicode_FromStringAndSize(digest, (Py_ssize_t)(sizeof PREFIX - 1 + 32));
}

static PyMethodDef methods[] = {
    {"copy_small", copy_small, METH_VARARGS,
     "copy_small(src, dev, ino, tmp, final, buffer, as_root, sync) -> (size, mtime_ns, digest) | None\n\n"
     "Copy and hash one small local file in one read and one write (see the module's source for the checks)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "fastcopy", "The copy worker's quick path for small local files, in C.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit_fastcopy(void) { return PyModule_Create(&module); }

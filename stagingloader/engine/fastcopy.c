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
 * copy_rows(src_prefix, final_prefix, tmp_prefix, first_name, blob, offsets, sizes, devs, inos, buffer, as_root,
 *           sync) -> (status, sizes, mtimes, digests, journal)
 *
 * A batch of small files as columns, with no Python object per file: file i's relative path is
 * blob[offsets[i]:offsets[i + 1]] (offsets: int64, one more than the files; sizes, devs, inos: int64, the
 * listing's), read from src_prefix + path, written as tmp_prefix + "<first_name + i>.tmp" and renamed to
 * final_prefix + path, as copy_small does each; with `sync`, every file is written first, then one syncfs of
 * the staging file system (else an fsync each) makes them durable, and only then are they renamed (a file under
 * its final name has durable bytes).  Returned, one row a file: `status` (bytes: COPIED, UNUSUAL as
 * copy_small's None, nothing left; WRITTEN, the temp file is whole and verified but the rename failed (a folder
 * not made yet), left for the caller to publish; COPIED_UNQUOTED, renamed, its journal line left to the caller
 * (a path JSON must escape)), the sizes and mtimes copied (int64 bytes), the digests (16 canonical bytes each) and
 * the journal lines of the COPIED files, '\n' between them: ["path", size, mtime_ns, "", "xxh3_128:..."], as
 * copyops.journal_line writes them.  A listed size above the buffer is UNUSUAL without a system call.
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
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
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

enum { COPIED, UNUSUAL, RENAME_FAILED, WRITTEN, COPIED_UNQUOTED };

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

/* A path JSON writes as it is: printable ASCII but the quote and the backslash. */
static int plain(const char *s, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        if (s[i] < 0x20 || s[i] > 0x7e || s[i] == '"' || s[i] == '\\') return 0;
    return 1;
}

/* prefix + the n bytes at rel (+ suffix) into out[PATH_MAX]; 0 if it does not fit or rel holds a NUL. */
static int join(char *out, const char *prefix, Py_ssize_t plen, const char *rel, Py_ssize_t n) {
    if (plen + n + 1 > PATH_MAX || memchr(rel, 0, (size_t)n)) return 0;
    memcpy(out, prefix, (size_t)plen);
    memcpy(out + plen, rel, (size_t)n);
    out[plen + n] = 0;
    return 1;
}

/* tmp_prefix + "<number>.tmp" into out[PATH_MAX]; nonzero if it does not fit. */
static int tmp_name(char *out, const Py_buffer *prefix, long long number) {
    if (prefix->len + 32 > PATH_MAX) return 1;
    memcpy(out, prefix->buf, (size_t)prefix->len);
    snprintf(out + prefix->len, 32, "%lld.tmp", number);
    return 0;
}

/* Make the WRITTEN temp files durable: one syncfs of their file system, else an fsync each; 1 if done. */
static int synced(const Py_buffer *prefix, const char *status, Py_ssize_t n, long long first) {
    char dir[PATH_MAX], tmp[PATH_MAX];
    if (prefix->len + 1 > PATH_MAX) return 0;
    memcpy(dir, prefix->buf, (size_t)prefix->len);
    dir[prefix->len] = 0;
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
        int ok = syncfs(fd) == 0;
        close(fd);
        if (ok) return 1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (status[i] != WRITTEN) continue;
        tmp_name(tmp, prefix, first + i);
        fd = open(tmp, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
        if (fd < 0) return 0;
        int ok = fsync(fd) == 0;
        close(fd);
        if (!ok) return 0;
    }
    return 1;
}

static int int64s(Py_buffer *b, Py_ssize_t n, const char *what) {
    if (b->len != n * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_Format(PyExc_ValueError, "copy_rows: %s must hold %zd int64 values", what, n);
        return 0;
    }
    return 1;
}

static PyObject *copy_rows(PyObject *self, PyObject *args) {
    Py_buffer srcp, finp, tmpp, blob, offs, sizes, devs, inos, buf;
    long long first;
    int as_root, sync;
    PyObject *result = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*Ly*y*y*y*y*w*pp:copy_rows", &srcp, &finp, &tmpp, &first, &blob, &offs, &sizes,
                          &devs, &inos, &buf, &as_root, &sync))
        return NULL;
    Py_ssize_t n = offs.len / (Py_ssize_t)sizeof(int64_t) - 1;
    PyObject *status_o = NULL, *size_o = NULL, *mtime_o = NULL, *digest_o = NULL, *journal_o = NULL;
    char *journal = NULL;
    if (n < 0 || !int64s(&offs, n + 1, "offsets") || !int64s(&sizes, n, "sizes") || !int64s(&devs, n, "devs") ||
        !int64s(&inos, n, "inos"))
        goto done;
    const int64_t *off = offs.buf, *size = sizes.buf, *dev = devs.buf, *ino = inos.buf;
    for (Py_ssize_t i = 0; i < n; i++)
        if (off[i] < 0 || off[i] > off[i + 1] || off[i + 1] > blob.len) {
            PyErr_SetString(PyExc_ValueError, "copy_rows: offsets outside the blob");
            goto done;
        }
    status_o = PyBytes_FromStringAndSize(NULL, n);
    size_o = PyBytes_FromStringAndSize(NULL, n * 8);
    mtime_o = PyBytes_FromStringAndSize(NULL, n * 8);
    digest_o = PyBytes_FromStringAndSize(NULL, n * 16);
    size_t cap = (size_t)blob.len + (size_t)n * 128 + 1, used = 0;
    journal = malloc(cap);
    if (!status_o || !size_o || !mtime_o || !digest_o || !journal) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        goto done;
    }
    char *status = PyBytes_AS_STRING(status_o);
    int64_t *got_size = (int64_t *)PyBytes_AS_STRING(size_o), *got_mtime = (int64_t *)PyBytes_AS_STRING(mtime_o);
    unsigned char *digest = (unsigned char *)PyBytes_AS_STRING(digest_o);
    memset(got_size, 0, (size_t)n * 8);
    memset(got_mtime, 0, (size_t)n * 8);
    memset(digest, 0, (size_t)n * 16);

    Py_BEGIN_ALLOW_THREADS
    char src[PATH_MAX], fin[PATH_MAX], tmp[PATH_MAX];
    int written = 0;
    for (Py_ssize_t i = 0; i < n; i++) { /* each file whole under its temp name */
        const char *rel = (const char *)blob.buf + off[i];
        Py_ssize_t len = (Py_ssize_t)(off[i + 1] - off[i]);
        struct stat before;
        XXH128_hash_t hash;
        int rename_errno = 0;
        status[i] = UNUSUAL;
        if (size[i] > buf.len || !join(src, srcp.buf, srcp.len, rel, len) || tmp_name(tmp, &tmpp, first + i) ||
            copy(src, (unsigned long long)dev[i], (unsigned long long)ino[i], tmp, NULL, (char *)buf.buf, buf.len,
                 as_root, 0, &before, &hash, &rename_errno) != COPIED)
            continue;
        XXH128_canonical_t canon;
        XXH128_canonicalFromHash(&canon, hash);
        memcpy(digest + 16 * i, canon.digest, 16);
        got_size[i] = (int64_t)before.st_size;
        got_mtime[i] = (int64_t)before.st_mtim.tv_sec * 1000000000LL + before.st_mtim.tv_nsec;
        status[i] = WRITTEN;
        written = 1;
    }
    if (written && sync && !synced(&tmpp, status, n, first)) { /* not durable: none is renamed; Python retries */
        for (Py_ssize_t i = 0; i < n; i++)
            if (status[i] == WRITTEN) {
                tmp_name(tmp, &tmpp, first + i);
                unlink(tmp);
                status[i] = UNUSUAL;
            }
    }
    for (Py_ssize_t i = 0; i < n; i++) { /* then renamed into place and journaled */
        const char *rel = (const char *)blob.buf + off[i];
        Py_ssize_t len = (Py_ssize_t)(off[i + 1] - off[i]);
        if (status[i] != WRITTEN || !join(fin, finp.buf, finp.len, rel, len)) continue;
        tmp_name(tmp, &tmpp, first + i);
        if (rename(tmp, fin) != 0) continue; /* WRITTEN: whole and verified, the caller makes the folder */
        if (!plain(rel, len)) {
            status[i] = COPIED_UNQUOTED;
            continue;
        }
        static const char hex[] = "0123456789abcdef";
        const unsigned char *d = digest + 16 * i;
        char *o = journal + used;
        if (used) *o++ = '\n';
        *o++ = '[';
        *o++ = '"';
        memcpy(o, rel, (size_t)len);
        o += len;
        o += sprintf(o, "\", %lld, %lld, \"\", \"" PREFIX, (long long)got_size[i], (long long)got_mtime[i]);
        for (int k = 0; k < 16; k++) {
            *o++ = hex[d[k] >> 4];
            *o++ = hex[d[k] & 15];
        }
        *o++ = '"';
        *o++ = ']';
        used = (size_t)(o - journal);
        status[i] = COPIED;
    }
    Py_END_ALLOW_THREADS

    journal_o = PyBytes_FromStringAndSize(journal, (Py_ssize_t)used);
    if (journal_o)
        result = Py_BuildValue("(OOOOO)", status_o, size_o, mtime_o, digest_o, journal_o);
done:
    free(journal);
    Py_XDECREF(status_o);
    Py_XDECREF(size_o);
    Py_XDECREF(mtime_o);
    Py_XDECREF(digest_o);
    Py_XDECREF(journal_o);
    PyBuffer_Release(&srcp);
    PyBuffer_Release(&finp);
    PyBuffer_Release(&tmpp);
    PyBuffer_Release(&blob);
    PyBuffer_Release(&offs);
    PyBuffer_Release(&sizes);
    PyBuffer_Release(&devs);
    PyBuffer_Release(&inos);
    PyBuffer_Release(&buf);
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
    {"copy_rows", copy_rows, METH_VARARGS,
     "copy_rows(src_prefix, final_prefix, tmp_prefix, first_name, blob, offsets, sizes, devs, inos, buffer, as_root,\n"
     "          sync) -> (status, sizes, mtimes, digests, journal)\n\n"
     "copy_small for a batch of files given as columns (see the module's source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "fastcopy", "The copy worker's quick path for small local files, in C.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit_fastcopy(void) { return PyModule_Create(&module); }

/* The listing's hot path in C: one folder's entries, each stat'ed, in the order their paths sort.
 *
 * scan_dir(fd, prefix, staged) -> (paths, ends, kinds, size, mtime_ns, ino, mode, dev)
 *
 * Reads the folder open at `fd` (a descriptor the caller keeps; it is not consumed) and `fstatat`s its entries
 * by name under it without following links: every entry but a folder, which the directory entry's type names (as
 * os.DirEntry.is_dir() answers it; the walk opens it next, and checks what it opened), and, in a source, a FIFO,
 * socket or device, which is not listed.  The entries come back sorted by their key, the name's bytes with a
 * "/" appended for a folder (as a folder appears in its files' paths), in columns:
 *
 *   paths     bytes: `prefix` + name for each entry, one after the other
 *   ends      bytes: int64[n + 1], where each path ends in `paths` (ends[0] is 0)
 *   kinds     bytes: one letter an entry (below)
 *   size, mtime_ns, ino, mode, dev
 *             bytes: int64[n] each, from the entry's own stat (for "e", size holds the errno; 0 for an entry
 *             not stat'ed)
 *
 * Kinds, for a source's listing (`staged` false): "f" a regular file, "d" a folder, "l" a symbolic link, "L" one that
 * leads to a folder (its key takes the "/": the walk follows links inside the source), "x" anything else, or an
 * entry removed before it was stat'ed (not listed), "e" a stat that failed otherwise.  For a staged tree
 * (`staged` true) links are never followed: "o" is a link or anything but a regular file or folder, listed with
 * size and mtime -1 so that it matches no manifest entry.
 *
 * The interpreter lock is released while the folder is read and stat'ed.  The Python walk (sources/listing.py)
 * does everything else: it opens folders, follows links, checks names and owners; without this helper it reads
 * folders with os.scandir, to the same columns (tests/sources/test_fastscan.py compares the two).
 */
#define PY_SSIZE_T_CLEAN
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <Python.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct {
    const char *name; /* into the name pool, set once the pool stops moving */
    size_t at;        /* the name's offset in the pool */
    size_t len;       /* the name's length; the key is one longer when `slash` */
    int slash;
    char kind;
    int64_t size, mtime_ns, ino, mode, dev;
} entry;

typedef struct {
    entry *items;
    size_t n, cap;
    char *pool;
    size_t used, pool_cap;
} folder;

static void folder_free(folder *f) {
    free(f->items);
    free(f->pool);
}

static int grow(void **p, size_t *cap, size_t want, size_t unit) {
    size_t n = *cap ? *cap : 64;
    void *q;
    if (want <= *cap) return 0;
    while (n < want) n *= 2;
    q = realloc(*p, n * unit);
    if (!q) return -1;
    *p = q;
    *cap = n;
    return 0;
}

/* Compares the entries' keys: bytes, then length (as Python compares bytes); a key is the name, and a "/" after
 * it for a folder.  Names in one folder differ. */
static int by_key(const void *a, const void *b) {
    const entry *e = a, *o = b;
    size_t n = e->len < o->len ? e->len : o->len, el = e->len + (size_t)e->slash, ol = o->len + (size_t)o->slash, i;
    int c = memcmp(e->name, o->name, n);
    if (c) return c;
    for (i = n; i < el && i < ol; i++) { /* one name is the start of the other: past it, a "/" may stand */
        unsigned char x = i < e->len ? (unsigned char)e->name[i] : '/';
        unsigned char y = i < o->len ? (unsigned char)o->name[i] : '/';
        if (x != y) return x < y ? -1 : 1;
    }
    return (el > ol) - (el < ol);
}

static void classify(int fd, entry *e, const char *name, unsigned char type, int staged) {
    struct stat st;
#ifdef DT_DIR
    if (type == DT_DIR) { /* as os.DirEntry.is_dir() answers it: the walk opens the folder, and checks it then */
        e->kind = 'd';
        e->slash = 1;
        return;
    }
    if (!staged && type != DT_UNKNOWN && type != DT_REG && type != DT_LNK) { /* a FIFO, socket or device */
        e->kind = 'x';
        return;
    }
#else
    (void)type;
#endif
    if (fstatat(fd, name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
        e->kind = errno == ENOENT ? 'x' : 'e';
        e->size = errno;
        e->mtime_ns = e->ino = e->mode = e->dev = 0;
        return;
    }
    e->size = (int64_t)st.st_size;
    e->mtime_ns = (int64_t)st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec;
    e->ino = (int64_t)st.st_ino;
    e->mode = (int64_t)st.st_mode;
    e->dev = (int64_t)st.st_dev;
    if (S_ISREG(st.st_mode)) {
        e->kind = 'f';
    } else if (S_ISDIR(st.st_mode)) {
        e->kind = 'd';
        e->slash = 1;
    } else if (staged) {
        e->kind = 'o';
        e->size = e->mtime_ns = -1;
    } else if (S_ISLNK(st.st_mode)) {
        struct stat target;
        e->slash = fstatat(fd, name, &target, 0) == 0 && S_ISDIR(target.st_mode);
        e->kind = e->slash ? 'L' : 'l';
    } else {
        e->kind = 'x';
    }
}

/* Read and stat the folder, without the interpreter lock; 0, or an errno. */
static int read_folder(int fd, int staged, folder *f) {
    struct dirent *d;
    size_t i;
    int dup_fd = fcntl(fd, F_DUPFD_CLOEXEC, 0), err = 0;
    DIR *dir;
    if (dup_fd < 0) return errno;
    dir = fdopendir(dup_fd);
    if (!dir) {
        err = errno;
        close(dup_fd);
        return err;
    }
    rewinddir(dir); /* the duplicate shares the caller's offset */
    for (;;) {
        size_t len;
        entry *e;
        errno = 0;
        d = readdir(dir);
        if (!d) {
            err = errno;
            break;
        }
        if (d->d_name[0] == '.' && (!d->d_name[1] || (d->d_name[1] == '.' && !d->d_name[2]))) continue;
        len = strlen(d->d_name);
        if (grow((void **)&f->items, &f->cap, f->n + 1, sizeof(entry)) ||
            grow((void **)&f->pool, &f->pool_cap, f->used + len + 1, 1)) {
            err = ENOMEM;
            break;
        }
        e = &f->items[f->n++];
        memset(e, 0, sizeof *e);
        e->at = f->used;
        e->len = len;
        memcpy(f->pool + f->used, d->d_name, len + 1);
        f->used += len + 1;
#ifdef DT_DIR
        classify(fd, e, d->d_name, d->d_type, staged);
#else
        classify(fd, e, d->d_name, 0, staged);
#endif
    }
    rewinddir(dir); /* and left at the start, as os.scandir leaves it */
    closedir(dir);
    if (err) return err;
    for (i = 0; i < f->n; i++) f->items[i].name = f->pool + f->items[i].at;
    qsort(f->items, f->n, sizeof(entry), by_key);
    return 0;
}

static PyObject *int_column(const folder *f, size_t field) {
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(f->n * sizeof(int64_t)));
    int64_t *v;
    size_t i;
    if (!out) return NULL;
    v = (int64_t *)PyBytes_AS_STRING(out);
    for (i = 0; i < f->n; i++) memcpy(&v[i], (const char *)&f->items[i] + field, sizeof(int64_t));
    return out;
}

static PyObject *scan_dir(PyObject *self, PyObject *args) {
    int fd, staged, err;
    const char *prefix;
    Py_ssize_t prefix_len;
    folder f = {0};
    PyObject *paths = NULL, *ends = NULL, *kinds = NULL, *size = NULL, *mtime = NULL, *ino = NULL, *mode = NULL;
    PyObject *dev = NULL, *result = NULL;
    size_t i, total = 0;
    (void)self;

    if (!PyArg_ParseTuple(args, "iy#p:scan_dir", &fd, &prefix, &prefix_len, &staged)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    err = read_folder(fd, staged, &f);
    Py_END_ALLOW_THREADS
    if (err) {
        folder_free(&f);
        errno = err;
        return err == ENOMEM ? PyErr_NoMemory() : PyErr_SetFromErrno(PyExc_OSError);
    }

    for (i = 0; i < f.n; i++) total += (size_t)prefix_len + f.items[i].len;
    paths = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)total);
    ends = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)((f.n + 1) * sizeof(int64_t)));
    kinds = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)f.n);
    if (paths && ends && kinds) {
        char *p = PyBytes_AS_STRING(paths), *k = PyBytes_AS_STRING(kinds);
        int64_t *end = (int64_t *)PyBytes_AS_STRING(ends), at = 0;
        end[0] = 0;
        for (i = 0; i < f.n; i++) {
            const entry *e = &f.items[i];
            memcpy(p + at, prefix, (size_t)prefix_len);
            memcpy(p + at + prefix_len, e->name, e->len);
            at += prefix_len + (int64_t)e->len;
            end[i + 1] = at;
            k[i] = e->kind;
        }
        size = int_column(&f, offsetof(entry, size));
        mtime = int_column(&f, offsetof(entry, mtime_ns));
        ino = int_column(&f, offsetof(entry, ino));
        mode = int_column(&f, offsetof(entry, mode));
        dev = int_column(&f, offsetof(entry, dev));
        if (size && mtime && ino && mode && dev)
            result = PyTuple_Pack(8, paths, ends, kinds, size, mtime, ino, mode, dev);
    }
    Py_XDECREF(paths);
    Py_XDECREF(ends);
    Py_XDECREF(kinds);
    Py_XDECREF(size);
    Py_XDECREF(mtime);
    Py_XDECREF(ino);
    Py_XDECREF(mode);
    Py_XDECREF(dev);
    folder_free(&f);
    return result;
}

static PyMethodDef methods[] = {
    {"scan_dir", scan_dir, METH_VARARGS,
     "scan_dir(fd, prefix, staged) -> (paths, ends, kinds, size, mtime_ns, ino, mode, dev)\n\n"
     "One folder's entries, stat'ed and sorted as their paths sort (see the module's source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "fastscan", "The listing's per-folder scan, in C.", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit_fastscan(void) { return PyModule_Create(&module); }

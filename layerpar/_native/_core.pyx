# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""Cython wrapper of the C MGRIT engine.

`Core` owns one `lpm_core`.  States are Python objects passed to C as borrowed
`PyObject*` handles; every handle the engine keeps holds one reference.  An
exception raised in a Python callback is stored, turned into an error code for
C, and re-raised by `drive()`: it never escapes into C.
"""
from cpython.ref cimport PyObject, Py_INCREF, Py_XDECREF
from libc.stdlib cimport malloc, free

from layerpar._native.lpm cimport *

TIMER_NAMES = ("relax", "restrict", "coarse", "interp", "final", "step", "wait", "reduce",
               "total")

NAN_ERROR = LPM_ENAN


cdef inline int _store(Core self, BaseException exc) noexcept:
    if self._error is None:
        self._error = exc
    return 1


cdef _check_states(object res, int n, str who):
    """A callback's list of n new states: raise if it is not one."""
    if len(res) != n:
        raise ValueError(f"`{who}` returned {len(res)} states for {n} inputs")
    for k in range(n):
        if res[k] is None:
            raise TypeError(f"`{who}` returned None for a state")


cdef void _put_states(object res, int n, lpm_state *out) noexcept:
    """Hand n checked states to the engine (one reference each)."""
    cdef int k
    cdef object item
    for k in range(n):
        item = res[k]
        Py_INCREF(item)
        out[k] = <lpm_state>item


cdef int cb_step(void *app, lpm_state u, lpm_state f, double ts, double te, int is_, int ie,
                 int level, int final, lpm_state *out) noexcept:
    cdef Core self = <Core>app
    cdef object res
    try:
        res = self._step(<object>u, None if f == NULL else <object>f, ts, te, is_, ie, level,
                         final)
        if res is None:
            raise TypeError("`step` returned None; it must return the new state")
    except BaseException as exc:
        return _store(self, exc)
    Py_INCREF(res)
    out[0] = <lpm_state>res
    return 0


cdef int cb_step_batch(void *app, int n, const lpm_state *u, const lpm_state *f,
                       const double *ts, const double *te, const int *is_, const int *ie,
                       int level, int final, lpm_state *out) noexcept:
    cdef Core self = <Core>app
    cdef int k
    cdef list us, fs, lts, lte, lis, lie
    cdef object res
    try:
        us = [<object>u[k] for k in range(n)]
        if f == NULL:
            fs = None
        else:
            fs = [None if f[k] == NULL else <object>f[k] for k in range(n)]
        lts = [ts[k] for k in range(n)]
        lte = [te[k] for k in range(n)]
        lis = [is_[k] for k in range(n)]
        lie = [ie[k] for k in range(n)]
        res = self._step_batch(us, fs, lts, lte, lis, lie, level, final)
        _check_states(res, n, "step_batch")
    except BaseException as exc:
        return _store(self, exc)
    _put_states(res, n, out)
    return 0


cdef int cb_step_seq(void *app, int n, lpm_state u, const lpm_state *f, const double *ts,
                     const double *te, const int *is_, const int *ie, int level, int final,
                     lpm_state *out) noexcept:
    cdef Core self = <Core>app
    cdef int k
    cdef list fs
    cdef object res
    try:
        if f == NULL:
            fs = None
        else:
            fs = [None if f[k] == NULL else <object>f[k] for k in range(n)]
        res = self._step_seq(<object>u, fs, [ts[k] for k in range(n)], [te[k] for k in range(n)],
                             [is_[k] for k in range(n)], [ie[k] for k in range(n)], level,
                             final)
        _check_states(res, n, "step_seq")
    except BaseException as exc:
        return _store(self, exc)
    _put_states(res, n, out)
    return 0


cdef int cb_init(void *app, double t, int i, lpm_state *out) noexcept:
    cdef Core self = <Core>app
    cdef object res
    try:
        res = self._init(t, i)
        if res is None:
            raise TypeError("`init` returned None")
    except BaseException as exc:
        return _store(self, exc)
    Py_INCREF(res)
    out[0] = <lpm_state>res
    return 0


cdef int cb_clone(void *app, lpm_state u, lpm_state *out) noexcept:
    # states are immutable values: a clone may share the object
    Py_INCREF(<object>u)
    out[0] = u
    return 0


cdef void cb_free(void *app, lpm_state u) noexcept:
    Py_XDECREF(<PyObject *>u)


cdef int cb_sum(void *app, double alpha, lpm_state x, double beta, lpm_state y,
                lpm_state *out) noexcept:
    cdef Core self = <Core>app
    cdef object res
    try:
        res = self._sum(alpha, <object>x, beta, <object>y)
    except BaseException as exc:
        return _store(self, exc)
    Py_INCREF(res)
    out[0] = <lpm_state>res
    return 0


cdef int cb_sum_batch(void *app, int n, double alpha, const lpm_state *x, double beta,
                      const lpm_state *y, lpm_state *out) noexcept:
    cdef Core self = <Core>app
    cdef int k
    cdef object res
    try:
        res = self._sum_batch(alpha, [<object>x[k] for k in range(n)], beta,
                              [<object>y[k] for k in range(n)])
        _check_states(res, n, "sum_batch")
    except BaseException as exc:
        return _store(self, exc)
    _put_states(res, n, out)
    return 0


cdef int cb_norm_sq(void *app, int n, const lpm_state *u, double *out) noexcept:
    cdef Core self = <Core>app
    cdef int k
    try:
        out[0] = self._norm_sq([<object>u[k] for k in range(n)])
    except BaseException as exc:
        return _store(self, exc)
    return 0


cdef int cb_isend(void *app, int dest, int tag, lpm_state u, int *req) noexcept:
    cdef Core self = <Core>app
    try:
        req[0] = self._isend(dest, tag, <object>u)
    except BaseException as exc:
        return _store(self, exc)
    return 0


cdef int cb_irecv(void *app, int src, int tag, int *req) noexcept:
    cdef Core self = <Core>app
    try:
        req[0] = self._irecv(src, tag)
    except BaseException as exc:
        return _store(self, exc)
    return 0


cdef int cb_wait(void *app, int req, lpm_state *out) noexcept:
    cdef Core self = <Core>app
    cdef object res
    try:
        res = self._wait(req)
    except BaseException as exc:
        return _store(self, exc)
    if res is None:
        out[0] = NULL
    else:
        Py_INCREF(res)
        out[0] = <lpm_state>res
    return 0


cdef int cb_allreduce(void *app, double *values, int n) noexcept:
    cdef Core self = <Core>app
    cdef int k
    cdef object res
    try:
        res = self._allreduce([values[k] for k in range(n)])
        for k in range(n):
            values[k] = res[k]
    except BaseException as exc:
        return _store(self, exc)
    return 0


cdef _check(int code, str what):
    if code == LPM_EINVAL:
        raise ValueError(f"{what}: {lpm_strerror(code).decode()}")
    if code != LPM_OK:
        # the error tree lives in layerpar.mgrit.errors, which imports this module's
        # users: imported here, on the error path only, so neither imports the other
        from ..mgrit.errors import EngineError
        raise EngineError(f"{what}: {lpm_strerror(code).decode()}")


cdef class Core:
    """One MGRIT solver instance over a fixed fine grid and partition.

    Parameters
    ----------
    n_steps, t_start, t_final : the fine grid t_i = t_start + (i/N)(t_final - t_start).
    rank, n_ranks, bounds : this rank's position and the partition (rank q owns fine
        points bounds[q] .. bounds[q+1]-1).
    app : object with ``step(u, f, t_start, t_stop, i_start, i_stop, level, final)``,
        optional ``step_batch(us, fs, t_starts, t_stops, i_starts, i_stops, level, final)``
        (None to let the engine call ``step`` per state), optional
        ``step_seq(u, fs, t_starts, t_stops, i_starts, i_stops, level, final)`` returning
        the n states of n consecutive steps from u (sequential stretches), ``init(t, i)``,
        ``sum(alpha, x, beta, y)`` returning alpha*x + beta*y, optional
        ``sum_batch(alpha, xs, beta, ys)`` returning the list of alpha*x + beta*y (all
        points of a phase at once), ``norm_sq(states)``.
    transport : object with ``isend(dest, tag, state) -> int``, ``irecv(src, tag) -> int``,
        ``wait(req) -> state | None`` and ``allreduce_sum(list[float]) -> list[float]``.
    """

    cdef lpm_core *c
    cdef lpm_callbacks cb
    cdef public object _error
    cdef object _step, _step_batch, _step_seq, _init, _sum, _sum_batch, _norm_sq
    cdef object _isend, _irecv, _wait, _allreduce
    cdef readonly int n_steps, rank, n_ranks

    def __cinit__(self, int n_steps, double t_start, double t_final, int rank, int n_ranks,
                  bounds, app, transport):
        cdef int *b = NULL
        cdef int k, code
        self.c = NULL
        self._error = None
        if len(bounds) != n_ranks + 1:
            raise ValueError("`bounds` must have n_ranks + 1 entries")
        self._step = app.step
        self._step_batch = getattr(app, "step_batch", None)
        self._step_seq = getattr(app, "step_seq", None)
        self._init = app.init
        self._sum = app.sum
        self._sum_batch = getattr(app, "sum_batch", None)
        self._norm_sq = app.norm_sq
        self._isend = transport.isend
        self._irecv = transport.irecv
        self._wait = transport.wait
        self._allreduce = transport.allreduce_sum
        self.n_steps = n_steps
        self.rank = rank
        self.n_ranks = n_ranks
        self.cb.step = cb_step
        if self._step_batch is not None:
            self.cb.step_batch = cb_step_batch
        else:
            self.cb.step_batch = NULL
        if self._step_seq is not None:
            self.cb.step_seq = cb_step_seq
        else:
            self.cb.step_seq = NULL
        self.cb.init = cb_init
        self.cb.clone = cb_clone
        self.cb.free = cb_free
        self.cb.sum = cb_sum
        if self._sum_batch is not None:
            self.cb.sum_batch = cb_sum_batch
        else:
            self.cb.sum_batch = NULL
        self.cb.norm_sq = cb_norm_sq
        self.cb.isend = cb_isend
        self.cb.irecv = cb_irecv
        self.cb.wait = cb_wait
        self.cb.allreduce_sum = cb_allreduce
        b = <int *>malloc(sizeof(int) * (n_ranks + 1))
        if b == NULL:
            raise MemoryError()
        try:
            for k in range(n_ranks + 1):
                b[k] = bounds[k]
            code = lpm_create(n_steps, t_start, t_final, rank, n_ranks, b, &self.cb,
                              <void *>self, &self.c)
        finally:
            free(b)
        _check(code, "lpm_create (grid, rank or partition out of range)")

    def __dealloc__(self):
        if self.c != NULL:
            lpm_destroy(self.c)
            self.c = NULL

    def set_options(self, *, int max_levels, cfactor, nrelax, int min_coarse, double tol,
                    double rtol, int max_iter, bint skip, bint fmg, double cweight,
                    bint final_fc_relax):
        """Pass validated options to the engine (per-level lists: the last value repeats)."""
        cdef int l
        _check(lpm_set_max_levels(self.c, max_levels), "max_levels")
        for l in range(LPM_MAX_LEVELS):
            _check(lpm_set_cfactor(self.c, l, cfactor[min(l, len(cfactor) - 1)]), "cfactor")
            _check(lpm_set_nrelax(self.c, l, nrelax[min(l, len(nrelax) - 1)]), "nrelax")
        _check(lpm_set_min_coarse(self.c, min_coarse), "min_coarse")
        _check(lpm_set_tol(self.c, tol), "tol")
        _check(lpm_set_rtol(self.c, rtol), "rtol")
        _check(lpm_set_max_iter(self.c, max_iter), "max_iter")
        _check(lpm_set_skip(self.c, skip), "skip")
        _check(lpm_set_fmg(self.c, fmg), "fmg")
        _check(lpm_set_cweight(self.c, cweight), "cweight")
        _check(lpm_set_final_fc_relax(self.c, final_fc_relax), "final_fc_relax")

    def set_defer_norms(self, bint on):
        """Deferred residual norms (fixed iteration counts only: tol = rtol = 0): the
        app's norm_sq values are not used; it keeps them and reads them after the
        solve, so a cycle needs no host-device synchronisation."""
        _check(lpm_set_defer_norms(self.c, on), "defer_norms")

    def drive(self) -> int:
        """Run MGRIT.  Re-raises the first exception any callback raised; returns 0, or
        NAN_ERROR when the residual norm was not finite (the same on every rank)."""
        cdef int code
        self._error = None
        code = lpm_drive(self.c)
        if self._error is not None:
            exc = self._error
            self._error = None
            raise exc
        if code == LPM_ENAN:
            return code
        _check(code, "lpm_drive")
        return code

    @property
    def n_levels(self) -> int:
        return lpm_get_nlevels(self.c)

    @property
    def iterations(self) -> int:
        return lpm_get_iterations(self.c)

    @property
    def converged(self) -> bool:
        return bool(lpm_get_converged(self.c))

    @property
    def residual_history(self) -> list:
        cdef int n = lpm_get_nrnorms(self.c)
        cdef double *buf = <double *>malloc(sizeof(double) * (n + 1))
        if buf == NULL:
            raise MemoryError()
        try:
            lpm_get_rnorms(self.c, buf, n)
            return [buf[k] for k in range(n)]
        finally:
            free(buf)

    @property
    def timings(self) -> dict:
        cdef double buf[16]
        lpm_get_timings(self.c, buf)
        return {name: buf[k] for k, name in enumerate(TIMER_NAMES)}

    def step_counts(self) -> list:
        """Step evaluations per level in the last drive."""
        return [lpm_get_step_count(self.c, l) for l in range(lpm_get_nlevels(self.c))]

    def batch_counts(self) -> list:
        """Step callback invocations (single or batched) per level in the last drive."""
        return [lpm_get_batch_count(self.c, l) for l in range(lpm_get_nlevels(self.c))]

    def get_state(self, int i):
        """The state at fine point i (owned by this rank) after the last drive, or None."""
        cdef lpm_state s = lpm_get_state(self.c, i)
        if s == NULL:
            return None
        return <object>s

    def level_info(self, int level) -> tuple:
        """(n_intervals, stride, cfactor, lo, hi) of `level` on this rank."""
        cdef int n, stride, cf, lo, hi
        _check(lpm_get_level_info(self.c, level, &n, &stride, &cf, &lo, &hi), "level_info")
        return (n, stride, cf, lo, hi)

    def time(self, int i) -> float:
        return lpm_time(self.c, i)

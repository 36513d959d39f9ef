# cython: language_level=3, boundscheck=False, initializedcheck=False
"""Cython wrapper of XBraid (`braid.h`): layerpar's optional second MGRIT engine.

Built only when XBRAID_DIR names an XBraid tree (see setup.py).  `XBraidCore` has the
interface of `_core.Core` that `EngineSession` uses, and runs the same apps through
XBraid's callbacks: step, init, clone, free, sum, spatialnorm, access, bufsize,
bufpack, bufunpack.

A braid_Vector is a small box holding one reference to an (immutable) state object:
XBraid asks for in-place updates (step, sum), which replace the box's object.

XBraid has no error channel and drops callbacks' codes, so an exception raised in a
Python callback is stored, every later callback on this rank becomes a no-op that
keeps XBraid's bookkeeping valid, and the residual norms this rank contributes
become NaN, which ends the solve on every rank at the next halting test (XBraid
halts on a NaN norm).  After braid_Drive, the ranks exchange whether one failed:
the failing rank re-raises its exception, the others raise `RemoteError` naming it.
Each drive builds a fresh XBraid core (a second braid_Drive on one core would warm
restart from the last solution; the native engine starts from the initial guess).
"""
from cpython.ref cimport PyObject, Py_INCREF, Py_XDECREF
from libc.math cimport NAN, sqrt
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset

from mpi4py cimport MPI
from mpi4py.libmpi cimport MPI_Comm

from layerpar._native.braid_h cimport *

import time

import numpy as np

NAN_ERROR = 4  # the native engine's LPM_ENAN: drive()'s code for a non-finite norm
_TINY = 5e-324  # smallest double: r < _TINY iff r == 0 (the native engine halts on r == 0)


cdef struct _box:
    PyObject *obj  # one owned reference


cdef _box *_new_box(object obj) except NULL:
    cdef _box *b = <_box *>malloc(sizeof(_box))
    if b == NULL:
        raise MemoryError()
    Py_INCREF(obj)
    b.obj = <PyObject *>obj
    return b


cdef inline void _replace(_box *b, object obj) noexcept:
    Py_INCREF(obj)
    Py_XDECREF(b.obj)
    b.obj = <PyObject *>obj


cdef braid_Int cb_step(braid_App app, braid_Vector ustop, braid_Vector fstop, braid_Vector u,
                       braid_StepStatus status) noexcept:
    cdef XBraidCore self = <XBraidCore><void *>app
    cdef _box *b = <_box *>u
    cdef braid_Real ts = 0.0, te = 0.0
    cdef braid_Int ti = 0, level = 0, done = 0
    cdef int stride
    if self._error is not None:
        return 0
    braid_StepStatusGetTstartTstop(status, &ts, &te)
    braid_StepStatusGetTIndex(status, &ti)
    braid_StepStatusGetLevel(status, &level)
    braid_StepStatusGetDone(status, &done)
    try:
        stride = self._strides[level]
        t0 = time.perf_counter()
        res = self._step(<object>b.obj,
                         None if fstop == NULL else <object>(<_box *>fstop).obj,
                         ts, te, ti * stride, (ti + 1) * stride, level,
                         1 if (done and level == 0) else 0)
        self._t_step += time.perf_counter() - t0
        if res is None:
            raise TypeError("`step` returned None; it must return the new state")
        self._counts[level] += 1
    except BaseException as exc:
        self._error = exc
        return 0
    _replace(b, res)
    return 0


cdef braid_Int cb_init(braid_App app, braid_Real t, braid_Vector *u_ptr) noexcept:
    cdef XBraidCore self = <XBraidCore><void *>app
    res = None
    if self._error is None:
        try:
            # XBraid passes the time only; the index is recovered from the uniform grid
            i = int(round((t - self.t_start) / (self.t_final - self.t_start) * self.n_steps))
            res = self._init(t, i)
            if res is None:
                raise TypeError("`init` returned None")
        except BaseException as exc:
            self._error = exc
            res = None
    try:
        u_ptr[0] = <braid_Vector>_new_box(res)
    except BaseException as exc:
        if self._error is None:
            self._error = exc
        u_ptr[0] = NULL
    return 0


cdef braid_Int cb_clone(braid_App app, braid_Vector u, braid_Vector *v_ptr) noexcept:
    # states are immutable values: a clone shares the object
    cdef XBraidCore self = <XBraidCore><void *>app
    try:
        v_ptr[0] = <braid_Vector>_new_box(<object>(<_box *>u).obj)
    except BaseException as exc:
        if self._error is None:
            self._error = exc
        v_ptr[0] = NULL
    return 0


cdef braid_Int cb_free(braid_App app, braid_Vector u) noexcept:
    cdef _box *b = <_box *>u
    if b != NULL:
        Py_XDECREF(b.obj)
        free(b)
    return 0


cdef braid_Int cb_sum(braid_App app, braid_Real alpha, braid_Vector x, braid_Real beta,
                      braid_Vector y) noexcept:
    cdef XBraidCore self = <XBraidCore><void *>app
    cdef _box *by = <_box *>y
    if self._error is not None:
        return 0
    try:
        res = self._sum(alpha, <object>(<_box *>x).obj, beta, <object>by.obj)
        if res is None:
            raise TypeError("`sum` returned None")
    except BaseException as exc:
        self._error = exc
        return 0
    _replace(by, res)
    return 0


cdef braid_Int cb_norm(braid_App app, braid_Vector u, braid_Real *norm_ptr) noexcept:
    cdef XBraidCore self = <XBraidCore><void *>app
    cdef double v
    norm_ptr[0] = NAN  # a failed rank stops every rank at the next halting test
    if self._error is not None:
        return 0
    try:
        v = self._norm_sq([<object>(<_box *>u).obj])
        norm_ptr[0] = sqrt(v) if v >= 0 else NAN
    except BaseException as exc:
        self._error = exc
    return 0


cdef braid_Int cb_access(braid_App app, braid_Vector u, braid_AccessStatus status) noexcept:
    cdef XBraidCore self = <XBraidCore><void *>app
    cdef braid_Int ti = 0, level = 0, done = 0
    if self._error is not None:
        return 0
    braid_AccessStatusGetLevel(status, &level)
    braid_AccessStatusGetDone(status, &done)
    if level != 0 or not done:
        return 0
    braid_AccessStatusGetTIndex(status, &ti)
    try:
        self._states[ti] = <object>(<_box *>u).obj
    except BaseException as exc:
        self._error = exc
    return 0


cdef braid_Int cb_bufsize(braid_App app, braid_Int *size_ptr,
                          braid_BufferStatus status) noexcept:
    cdef XBraidCore self = <XBraidCore><void *>app
    size_ptr[0] = self._nbytes
    return 0


cdef braid_Int cb_bufpack(braid_App app, braid_Vector u, void *buffer,
                          braid_BufferStatus status) noexcept:
    cdef XBraidCore self = <XBraidCore><void *>app
    cdef const unsigned char[::1] view
    memset(buffer, 0, self._nbytes)
    if self._error is not None:
        return 0
    try:
        arr = self._pack(<object>(<_box *>u).obj)
        if arr.nbytes != self._nbytes:
            raise ValueError(f"a state has {arr.nbytes} bytes, expected {self._nbytes} "
                             "(the receive template's shape and dtype)")
        if self._nbytes > 0:
            view = arr
            memcpy(buffer, &view[0], self._nbytes)
    except BaseException as exc:
        self._error = exc
    return 0


cdef braid_Int cb_bufunpack(braid_App app, void *buffer, braid_Vector *u_ptr,
                            braid_BufferStatus status) noexcept:
    cdef XBraidCore self = <XBraidCore><void *>app
    cdef unsigned char[::1] view
    res = None
    if self._error is None:
        try:
            raw = np.empty(self._nbytes, dtype=np.uint8)
            if self._nbytes > 0:
                view = raw
                memcpy(&view[0], buffer, self._nbytes)
            res = self._unpack(raw)
        except BaseException as exc:
            self._error = exc
            res = None
    try:
        u_ptr[0] = <braid_Vector>_new_box(res)
    except BaseException as exc:
        if self._error is None:
            self._error = exc
        u_ptr[0] = NULL
    return 0


cdef class XBraidCore:
    """One XBraid solver over a fixed fine grid, with `_core.Core`'s interface.

    Parameters
    ----------
    n_steps, t_start, t_final : the fine grid t_i = t_start + (i/N)(t_final - t_start).
    comm : the mpi4py communicator XBraid runs on; its rank order is the time order
        (XBraid distributes the N+1 points in blocks, the first ranks taking one more).
    app : the engine app (``step``, ``init``, ``sum``, ``norm_sq``), as for `Core`.
    pack, unpack : state -> uint8 numpy array of `nbytes` bytes, and back.
    """

    cdef public object _error
    cdef object _step, _init, _sum, _norm_sq, _pack, _unpack
    cdef MPI.Comm _comm
    cdef dict _states
    cdef list _strides, _counts
    cdef double _t_step
    cdef int _nbytes
    cdef readonly int n_steps
    cdef readonly double t_start, t_final
    cdef dict _opts
    cdef int _niter, _nlevels
    cdef list _history
    cdef bint _converged
    cdef dict _timings

    def __cinit__(self, int n_steps, double t_start, double t_final, MPI.Comm comm, app,
                  pack, unpack):
        self._error = None
        self.n_steps = n_steps
        self.t_start = t_start
        self.t_final = t_final
        self._comm = comm
        self._step = app.step
        self._init = app.init
        self._sum = app.sum
        self._norm_sq = app.norm_sq
        self._pack = pack
        self._unpack = unpack
        self._states = {}
        self._strides = [1]
        self._counts = [0]
        self._nbytes = 0
        self._opts = {}
        self._niter = 0
        self._nlevels = 0
        self._history = []
        self._converged = False
        self._timings = {}

    def set_nbytes(self, int nbytes):
        """Bytes of one packed state (XBraid's message buffers)."""
        if nbytes < 0:
            raise ValueError("`nbytes` must be >= 0")
        self._nbytes = nbytes

    def set_options(self, *, int max_levels, cfactor, nrelax, int min_coarse, double tol,
                    double rtol, int max_iter, bint skip, bint fmg, double cweight,
                    bint final_fc_relax):
        """Keep validated options (per-level lists: the last value repeats).  XBraid
        halts on an absolute or a relative tolerance, not on both."""
        if tol > 0.0 and rtol > 0.0:
            raise ValueError(
                f"engine='xbraid' halts on an absolute or a relative tolerance, not both: "
                f"set `tol` ({tol}) or `rtol` ({rtol}) to 0")
        cf = [int(c) for c in cfactor]
        self._opts = dict(max_levels=max_levels, cfactor=cf, nrelax=[int(v) for v in nrelax],
                          min_coarse=min_coarse, tol=tol, rtol=rtol, max_iter=max_iter,
                          skip=skip, fmg=fmg, cweight=cweight, final_fc_relax=final_fc_relax)
        strides = [1]
        for l in range(max_levels - 1):
            strides.append(strides[-1] * cf[min(l, len(cf) - 1)])
        self._strides = strides

    def set_defer_norms(self, bint on):
        """Deferred norms are the native engine's: XBraid reads every norm."""
        if on:
            raise ValueError("engine='xbraid' cannot defer residual norms (XBraid reads "
                             "each iteration's norm to decide whether to halt); deferred "
                             "norms need engine='native'")

    cdef int _apply(self, braid_Core core) except -1:
        cdef int l, nl
        o = self._opts
        nl = o["max_levels"]
        braid_SetPrintLevel(core, 0)
        braid_SetFileIOLevel(core, 0)
        braid_SetAccessLevel(core, 1)
        braid_SetMaxLevels(core, nl)
        braid_SetMinCoarse(core, o["min_coarse"])
        braid_SetSkip(core, 1 if o["skip"] else 0)
        braid_SetMaxIter(core, o["max_iter"])
        if o["rtol"] > 0.0:
            braid_SetRelTol(core, o["rtol"])
        else:
            braid_SetAbsTol(core, o["tol"] if o["tol"] > 0.0 else _TINY)
        cf, nr = o["cfactor"], o["nrelax"]
        braid_SetCFactor(core, -1, cf[-1])
        braid_SetNRelax(core, -1, nr[-1])
        braid_SetCRelaxWt(core, -1, o["cweight"])
        for l in range(min(len(cf), nl)):
            braid_SetCFactor(core, l, cf[l])
        for l in range(min(len(nr), nl)):
            braid_SetNRelax(core, l, nr[l])
        if o["fmg"]:
            braid_SetFMG(core)
        if o["final_fc_relax"]:
            braid_SetFinalFCRelax(core)
        return 0

    def drive(self) -> int:
        """Run one XBraid solve from the initial guess.  Returns 0, or NAN_ERROR when the
        residual norm was not finite.  An exception a callback raised on this rank is
        stored; `error` gives it to the caller, which tells the other ranks."""
        cdef braid_Core core = NULL
        cdef braid_Int niter = 0, nlev = 0, nreq
        cdef double *buf
        cdef int k
        if not self._opts:
            raise RuntimeError("set_options() must be called before drive()")
        self._error = None
        self._states = {}
        self._counts = [0] * len(self._strides)
        self._t_step = 0.0
        t0 = time.perf_counter()
        braid_Init(self._comm.ob_mpi, self._comm.ob_mpi, self.t_start, self.t_final,
                   self.n_steps, <braid_App><void *>self, cb_step, cb_init, cb_clone, cb_free,
                   cb_sum, cb_norm, cb_access, cb_bufsize, cb_bufpack, cb_bufunpack, &core)
        try:
            self._apply(core)
            braid_Drive(core)
            braid_GetNumIter(core, &niter)
            braid_GetNLevels(core, &nlev)
            nreq = niter + 1
            buf = <double *>malloc(sizeof(double) * (nreq + 1))
            if buf == NULL:
                raise MemoryError()
            try:
                braid_GetRNorms(core, &nreq, buf)
                rn = [buf[k] for k in range(min(nreq, niter + 1))]
            finally:
                free(buf)
        finally:
            braid_Destroy(core)
        self._timings = {"step": self._t_step, "total": time.perf_counter() - t0}
        self._nlevels = nlev
        o = self._opts
        if nlev <= 1:  # sequential stepping: one pass, exact (as the native engine reports)
            self._niter, self._history, self._converged = 1, [], True
            return 0
        self._niter = niter
        hist = rn[(1 if o["skip"] else 0):niter]
        self._history = hist
        if hist and not all(v == v and v not in (float("inf"), float("-inf")) for v in hist):
            self._converged = False
            return NAN_ERROR
        r = hist[-1] if hist else None
        self._converged = r is not None and (
            r == 0.0 or r < o["tol"] or (o["rtol"] > 0.0 and r < o["rtol"] * hist[0]))
        return 0

    @property
    def error(self):
        """The exception a callback raised on this rank in the last drive, or None."""
        return self._error

    @property
    def n_levels(self) -> int:
        return self._nlevels

    @property
    def iterations(self) -> int:
        return self._niter

    @property
    def converged(self) -> bool:
        return bool(self._converged)

    @property
    def residual_history(self) -> list:
        return list(self._history)

    @property
    def timings(self) -> dict:
        """Measured seconds: inside step callbacks, and the whole drive (XBraid's own
        phase timers are not read)."""
        return dict(self._timings)

    def step_counts(self) -> list:
        """Step evaluations per level in the last drive."""
        return list(self._counts[:max(self._nlevels, 1)])

    def batch_counts(self) -> list:
        """Step callback invocations per level (XBraid steps one state per call)."""
        return self.step_counts()

    def get_state(self, int i):
        """The state at fine point i (owned by this rank) after the last drive, or None."""
        return self._states.get(i)

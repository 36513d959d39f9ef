# Extern declarations of the C engine's public header (lpm.h); nothing else.

cdef extern from "lpm.h" nogil:
    ctypedef void *lpm_state
    ctypedef struct lpm_core:
        pass

    int LPM_OK, LPM_ECALLBACK, LPM_EINVAL, LPM_ENOMEM, LPM_ENAN, LPM_ESTATE
    int LPM_NTIMERS, LPM_MAX_LEVELS
    int LPM_T_RELAX, LPM_T_RESTRICT, LPM_T_COARSE, LPM_T_INTERP, LPM_T_FINAL
    int LPM_T_STEP, LPM_T_WAIT, LPM_T_REDUCE, LPM_T_TOTAL

    ctypedef struct lpm_callbacks:
        int (*step)(void *app, lpm_state u, lpm_state f, double tstart, double tstop,
                    int istart, int istop, int level, int final, lpm_state *out)
        int (*step_batch)(void *app, int n, const lpm_state *u, const lpm_state *f,
                          const double *tstart, const double *tstop, const int *istart,
                          const int *istop, int level, int final, lpm_state *out)
        int (*step_seq)(void *app, int n, lpm_state u, const lpm_state *f,
                        const double *tstart, const double *tstop, const int *istart,
                        const int *istop, int level, int final, lpm_state *out)
        int (*init)(void *app, double t, int i, lpm_state *out)
        int (*clone)(void *app, lpm_state u, lpm_state *out)
        void (*free)(void *app, lpm_state u)
        int (*sum)(void *app, double alpha, lpm_state x, double beta, lpm_state y,
                   lpm_state *out)
        int (*sum_batch)(void *app, int n, double alpha, const lpm_state *x, double beta,
                         const lpm_state *y, lpm_state *out)
        int (*norm_sq)(void *app, int n, const lpm_state *u, double *out)
        int (*isend)(void *app, int dest, int tag, lpm_state u, int *req)
        int (*irecv)(void *app, int src, int tag, int *req)
        int (*wait)(void *app, int req, lpm_state *out)
        int (*allreduce_sum)(void *app, double *values, int n)

    int lpm_create(int nsteps, double t0, double tfinal, int rank, int nranks,
                   const int *bounds, const lpm_callbacks *cb, void *app, lpm_core **out)
    void lpm_destroy(lpm_core *core)
    int lpm_set_max_levels(lpm_core *core, int max_levels)
    int lpm_set_cfactor(lpm_core *core, int level, int cfactor)
    int lpm_set_nrelax(lpm_core *core, int level, int nrelax)
    int lpm_set_min_coarse(lpm_core *core, int min_coarse)
    int lpm_set_tol(lpm_core *core, double tol)
    int lpm_set_rtol(lpm_core *core, double rtol)
    int lpm_set_max_iter(lpm_core *core, int max_iter)
    int lpm_set_skip(lpm_core *core, int skip)
    int lpm_set_fmg(lpm_core *core, int fmg)
    int lpm_set_cweight(lpm_core *core, double cweight)
    int lpm_set_final_fc_relax(lpm_core *core, int on)
    int lpm_set_defer_norms(lpm_core *core, int on)
    int lpm_drive(lpm_core *core)
    int lpm_get_nlevels(const lpm_core *core)
    int lpm_get_iterations(const lpm_core *core)
    int lpm_get_converged(const lpm_core *core)
    int lpm_get_nrnorms(const lpm_core *core)
    int lpm_get_rnorms(const lpm_core *core, double *out, int n)
    void lpm_get_timings(const lpm_core *core, double *out)
    long lpm_get_step_count(const lpm_core *core, int level)
    long lpm_get_batch_count(const lpm_core *core, int level)
    lpm_state lpm_get_state(const lpm_core *core, int i)
    int lpm_get_level_info(const lpm_core *core, int level, int *n, int *stride, int *cf,
                           int *lo, int *hi)
    double lpm_time(const lpm_core *core, int i)
    const char *lpm_strerror(int code)

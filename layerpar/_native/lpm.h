/*
 * lpm.h -- public interface of layerpar's MGRIT engine ("lpm": layerpar MGRIT).
 *
 * The engine knows time grids, levels, C/F points, relaxation, FAS coarse-grid
 * correction, residual norms and halting.  It never touches state data: states
 * are opaque handles and everything done to them goes through lpm_callbacks.
 * Communication also goes through callbacks, so this file does not need mpi.h.
 *
 * State handles are immutable values: the engine never asks for a state to be
 * modified in place.  `clone` may therefore share storage with its argument.
 * Every handle the engine receives from a callback (step, init, clone, sum,
 * wait) is owned by the engine and released exactly once with `free`.
 *
 * All callbacks return 0 on success; any other value stops the solve on this
 * rank and lpm_drive() returns LPM_ECALLBACK.
 */
#ifndef LPM_H
#define LPM_H

#ifdef __cplusplus
extern "C" {
#endif

typedef void *lpm_state;
typedef struct lpm_core lpm_core;

/* error codes */
#define LPM_OK 0
#define LPM_ECALLBACK 1 /* a callback returned nonzero */
#define LPM_EINVAL 2    /* an argument or option is out of range */
#define LPM_ENOMEM 3    /* allocation failed */
#define LPM_ENAN 4      /* residual norm is NaN */
#define LPM_ESTATE 5    /* call out of order (e.g. accessor before drive) */

/* timers reported by lpm_get_timings (seconds, accumulated over one drive) */
#define LPM_T_RELAX 0    /* F/C relaxation on levels that are not the coarsest */
#define LPM_T_RESTRICT 1 /* residual, norm, injection and FAS right-hand side */
#define LPM_T_COARSE 2   /* sequential solve on the coarsest level */
#define LPM_T_INTERP 3   /* interpolation (and the F-sweep that follows it) */
#define LPM_T_FINAL 4    /* final F(C) sweep on the fine grid */
#define LPM_T_STEP 5     /* inside step / step_batch callbacks (part of the above) */
#define LPM_T_WAIT 6     /* inside wait callbacks (part of the above) */
#define LPM_T_REDUCE 7   /* inside allreduce callbacks */
#define LPM_T_TOTAL 8
#define LPM_NTIMERS 9

#define LPM_MAX_LEVELS 30

typedef struct lpm_callbacks {
    /* out = Phi(u) + f  (f may be NULL: no right-hand side).  Advances u from
     * fine index istart (time tstart) to istop (tstop) on `level`.  `final` is 1
     * when this is the last evaluation of this step in the solve (final sweep,
     * or the single sequential sweep of a one-level solve). */
    int (*step)(void *app, lpm_state u, lpm_state f, double tstart, double tstop,
                int istart, int istop, int level, int final, lpm_state *out);
    /* n independent steps at once (same level); out[k] as step() would give
     * for u[k], f[k] (f may be NULL, or f[k] NULL).  Optional: NULL -> the
     * engine calls step() n times. */
    int (*step_batch)(void *app, int n, const lpm_state *u, const lpm_state *f,
                      const double *tstart, const double *tstop, const int *istart,
                      const int *istop, int level, int final, lpm_state *out);
    /* n consecutive steps at once: out[0] = Phi(u) + f[0], out[k] = Phi(out[k-1]) +
     * f[k] (f may be NULL, or f[k] NULL), stepping through fine indices istart[k] ->
     * istop[k].  Used for sequential stretches (the coarsest-level solve), so a
     * whole rank's share of a sequential solve is one call.  Optional: NULL -> the
     * engine calls step() n times. */
    int (*step_seq)(void *app, int n, lpm_state u, const lpm_state *f, const double *tstart,
                    const double *tstop, const int *istart, const int *istop, int level,
                    int final, lpm_state *out);
    /* initial guess at fine index i (time t); i == 0 gives the initial condition */
    int (*init)(void *app, double t, int i, lpm_state *out);
    int (*clone)(void *app, lpm_state u, lpm_state *out);
    void (*free)(void *app, lpm_state u);
    /* out = alpha*x + beta*y (a new state) */
    int (*sum)(void *app, double alpha, lpm_state x, double beta, lpm_state y, lpm_state *out);
    /* n sums at once: out[k] = alpha*x[k] + beta*y[k].  Optional: NULL -> the engine
     * calls sum() n times.  Used wherever a phase combines all points of a level
     * (residuals, FAS right-hand sides, corrections, weighted C-updates), so an app
     * whose states are rows of one tensor does one operation per phase, not per point. */
    int (*sum_batch)(void *app, int n, double alpha, const lpm_state *x, double beta,
                     const lpm_state *y, lpm_state *out);
    /* *out = sum over k of ||u[k]||^2 (one call per level-0 residual evaluation) */
    int (*norm_sq)(void *app, int n, const lpm_state *u, double *out);

    /* transport: ranks are positions in the time partition (0 owns t0) */
    int (*isend)(void *app, int dest, int tag, lpm_state u, int *req);
    int (*irecv)(void *app, int src, int tag, int *req);
    /* completes a request; for a receive *out is the received state (owned by
     * the engine), for a send *out is set to NULL */
    int (*wait)(void *app, int req, lpm_state *out);
    int (*allreduce_sum)(void *app, double *values, int n);
} lpm_callbacks;

/* Create a core for the fine grid t_i = t0 + (i/N)(tfinal - t0), i = 0..N.
 * `bounds` has nranks+1 entries: rank q owns fine points bounds[q] ..
 * bounds[q+1]-1; bounds[0] = 0, bounds[nranks] = N+1, strictly increasing. */
int lpm_create(int nsteps, double t0, double tfinal, int rank, int nranks, const int *bounds,
               const lpm_callbacks *cb, void *app, lpm_core **out);
void lpm_destroy(lpm_core *core);

/* option setters: each validates its value and returns LPM_EINVAL if out of
 * range.  `level` = -1 sets the value for every level, `level` = l for level l
 * only (l < LPM_MAX_LEVELS). */
int lpm_set_max_levels(lpm_core *core, int max_levels);         /* >= 1, default 30 */
int lpm_set_cfactor(lpm_core *core, int level, int cfactor);    /* >= 2, default 2 */
int lpm_set_nrelax(lpm_core *core, int level, int nrelax);      /* >= 0, default 1 (FCF) */
int lpm_set_min_coarse(lpm_core *core, int min_coarse);         /* >= 1, default 2 */
int lpm_set_tol(lpm_core *core, double tol);                    /* >= 0, default 1e-9 */
int lpm_set_rtol(lpm_core *core, double rtol);                  /* >= 0, default 0 */
int lpm_set_max_iter(lpm_core *core, int max_iter);             /* >= 1, default 100 */
int lpm_set_skip(lpm_core *core, int skip);                     /* 0/1, default 1 */
int lpm_set_fmg(lpm_core *core, int fmg);                       /* 0/1, default 0 */
int lpm_set_cweight(lpm_core *core, double cweight);            /* (0, 2], default 1 */
int lpm_set_final_fc_relax(lpm_core *core, int on);             /* 0/1, default 0 */
/* Deferred residual norms (0/1, default 0), for fixed iteration counts (tol = rtol = 0,
 * else lpm_drive returns LPM_EINVAL): norm_sq is still called once per iteration, but
 * its value is not reduced over ranks or used; the app keeps the norms (on its device)
 * and reads them after the solve.  The halting test then needs no value read back, so
 * a cycle runs without one host-device synchronisation.  lpm_get_rnorms gives zeros
 * and lpm_get_converged 0. */
int lpm_set_defer_norms(lpm_core *core, int on);

/* Run MGRIT.  Builds the level hierarchy on first call. */
int lpm_drive(lpm_core *core);

/* accessors (valid after lpm_drive) */
int lpm_get_nlevels(const lpm_core *core);
int lpm_get_iterations(const lpm_core *core);
int lpm_get_converged(const lpm_core *core);
int lpm_get_nrnorms(const lpm_core *core);
int lpm_get_rnorms(const lpm_core *core, double *out, int n); /* returns number copied */
void lpm_get_timings(const lpm_core *core, double *out);      /* LPM_NTIMERS values */
/* number of step evaluations on `level` (single and batched), last drive */
long lpm_get_step_count(const lpm_core *core, int level);
long lpm_get_batch_count(const lpm_core *core, int level);
/* borrowed handle of the state at fine index i (must be owned by this rank);
 * NULL if not set */
lpm_state lpm_get_state(const lpm_core *core, int i);
/* describe level l: number of intervals, stride (fine points per coarse
 * interval), coarsening factor to level l+1 (0 on the coarsest), and this
 * rank's level-index range [lo, hi] (lo > hi when empty) */
int lpm_get_level_info(const lpm_core *core, int level, int *n, int *stride, int *cf, int *lo,
                       int *hi);
double lpm_time(const lpm_core *core, int i);
const char *lpm_strerror(int code);

#ifdef __cplusplus
}
#endif
#endif /* LPM_H */

/* lpm_internal.h -- engine internals shared by the phase files (prefix _lpm_). */
#ifndef LPM_INTERNAL_H
#define LPM_INTERNAL_H

#include <stddef.h>

#include "lpm.h"

/* message tags: phase * 32 + level */
#define _LPM_TAG_F 1      /* F-sweep: left neighbour's last point */
#define _LPM_TAG_C 2      /* C-sweep / residual: left neighbour's last F-point */
#define _LPM_TAG_FAS 3    /* restriction: coarse v at left neighbour's last point */
#define _LPM_TAG_COARSE 4 /* coarsest sequential solve */
#define _LPM_TAG(phase, level) ((phase) * 32 + (level))

#define _LPM_TRY(expr)                                                                      \
    do {                                                                                    \
        int _lpm_e = (expr);                                                                \
        if (_lpm_e != LPM_OK) return _lpm_e;                                                \
    } while (0)

typedef struct {
    int n;       /* intervals: points 0..n */
    int stride;  /* fine index of point j is j * stride */
    int cf;      /* coarsening factor to the next level; 0 on the coarsest */
    int nrelax;
    double cweight;
    int lo, hi;  /* local range of level indices; empty when lo > hi */
    int left;    /* rank owning point lo-1 on this level, -1 if none */
    int right;   /* rank owning point hi+1 on this level, -1 if none */
    lpm_state *u; /* current values, index j - lo */
    lpm_state *v; /* restricted (injected) values, levels >= 1 */
    lpm_state *f; /* FAS right-hand side (NULL entry = zero), levels >= 1 */
} _lpm_level;

struct lpm_core {
    /* problem */
    int nsteps;
    double t0, tfinal;
    int rank, nranks;
    int *bounds;
    lpm_callbacks cb;
    void *app;
    /* options */
    int max_levels;
    int cfactor[LPM_MAX_LEVELS];
    int nrelax[LPM_MAX_LEVELS];
    int min_coarse;
    double tol, rtol;
    int max_iter;
    int skip, fmg, final_fc_relax, defer_norms;
    double cweight;
    /* hierarchy */
    int nlevels;
    int built;
    _lpm_level levels[LPM_MAX_LEVELS];
    /* work arrays for batched steps, sized to the largest local level range + 1 */
    int nwork;
    lpm_state *w_u, *w_f, *w_out;
    lpm_state *w_x, *w_y, *w_s; /* operands and results of batched sums */
    double *w_ts, *w_te;
    int *w_is, *w_ie, *w_idx;
    /* results of the last drive */
    int iterations, converged;
    int nrnorms, cap_rnorms;
    double *rnorms;
    double timings[LPM_NTIMERS];
    long step_count[LPM_MAX_LEVELS];
    long batch_count[LPM_MAX_LEVELS];
};

/* core.c */
double _lpm_now(void);
void _lpm_set(lpm_core *c, lpm_state *slot, lpm_state value); /* frees old */
void _lpm_clear(lpm_core *c, lpm_state *slot);
/* out[k] = alpha*x[k] + beta*y[k], k < n, in one sum_batch call when the app has one;
 * on failure no out[k] is left set */
int _lpm_sum_batch(lpm_core *c, int n, double alpha, const lpm_state *x, double beta,
                   const lpm_state *y, lpm_state *out);

/* grid.c */
int _lpm_grid_build(lpm_core *c);
void _lpm_grid_free_states(lpm_core *c);
void _lpm_grid_destroy(lpm_core *c);
int _lpm_owner(const lpm_core *c, int level, int j);

/* comm.c */
int _lpm_isend(lpm_core *c, int dest, int tag, lpm_state u, int *req);
int _lpm_irecv(lpm_core *c, int src, int tag, int *req);
int _lpm_wait(lpm_core *c, int req, lpm_state *out);
int _lpm_allreduce(lpm_core *c, double *v, int n);

/* relax.c */
int _lpm_step(lpm_core *c, int level, lpm_state u, lpm_state f, int j, int final, lpm_state *out);
int _lpm_step_batch(lpm_core *c, int level, int n, int final); /* uses w_* arrays */
int _lpm_fsweep(lpm_core *c, int level, int final);
int _lpm_cpoint_steps(lpm_core *c, int level, int final, int *m, lpm_state *left);
int _lpm_csweep(lpm_core *c, int level, int final);
int _lpm_relax(lpm_core *c, int level);
int _lpm_coarse_solve(lpm_core *c, int level, int final);

/* residual.c */
int _lpm_residual(lpm_core *c, int level, lpm_state *a, double *normsq);

/* restrict.c */
int _lpm_restrict(lpm_core *c, int level, double *normsq);
int _lpm_inject(lpm_core *c, int level);

/* interp.c */
int _lpm_interpolate(lpm_core *c, int level);

#endif /* LPM_INTERNAL_H */

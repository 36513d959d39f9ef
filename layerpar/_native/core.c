/* core.c -- creation, options (validated setters), accessors, destruction. */
#define _POSIX_C_SOURCE 199309L
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "lpm_internal.h"

double _lpm_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void _lpm_clear(lpm_core *c, lpm_state *slot) {
    if (*slot) {
        c->cb.free(c->app, *slot);
        *slot = NULL;
    }
}

void _lpm_set(lpm_core *c, lpm_state *slot, lpm_state value) {
    if (*slot) c->cb.free(c->app, *slot);
    *slot = value;
}

int _lpm_sum_batch(lpm_core *c, int n, double alpha, const lpm_state *x, double beta,
                   const lpm_state *y, lpm_state *out) {
    for (int k = 0; k < n; k++) out[k] = NULL;
    if (n == 0) return LPM_OK;
    if (n > 1 && c->cb.sum_batch) {
        if (!c->cb.sum_batch(c->app, n, alpha, x, beta, y, out)) return LPM_OK;
        for (int k = 0; k < n; k++) _lpm_clear(c, &out[k]);
        return LPM_ECALLBACK;
    }
    for (int k = 0; k < n; k++) {
        if (c->cb.sum(c->app, alpha, x[k], beta, y[k], &out[k])) {
            for (int m = 0; m < k; m++) _lpm_clear(c, &out[m]);
            out[k] = NULL;
            return LPM_ECALLBACK;
        }
    }
    return LPM_OK;
}

int lpm_create(int nsteps, double t0, double tfinal, int rank, int nranks, const int *bounds,
               const lpm_callbacks *cb, void *app, lpm_core **out) {
    *out = NULL;
    if (nsteps < 1 || nranks < 1 || rank < 0 || rank >= nranks || !bounds || !cb) return LPM_EINVAL;
    if (!isfinite(t0) || !isfinite(tfinal) || !(tfinal > t0)) return LPM_EINVAL;
    if (bounds[0] != 0 || bounds[nranks] != nsteps + 1) return LPM_EINVAL;
    for (int q = 0; q < nranks; q++)
        if (bounds[q + 1] <= bounds[q]) return LPM_EINVAL;
    if (!cb->step || !cb->init || !cb->clone || !cb->free || !cb->sum || !cb->norm_sq)
        return LPM_EINVAL;
    if (nranks > 1 && (!cb->isend || !cb->irecv || !cb->wait)) return LPM_EINVAL;
    if (!cb->allreduce_sum) return LPM_EINVAL;

    lpm_core *c = calloc(1, sizeof(lpm_core));
    if (!c) return LPM_ENOMEM;
    c->bounds = malloc(sizeof(int) * (size_t)(nranks + 1));
    if (!c->bounds) {
        free(c);
        return LPM_ENOMEM;
    }
    memcpy(c->bounds, bounds, sizeof(int) * (size_t)(nranks + 1));
    c->nsteps = nsteps;
    c->t0 = t0;
    c->tfinal = tfinal;
    c->rank = rank;
    c->nranks = nranks;
    c->cb = *cb;
    c->app = app;
    c->max_levels = LPM_MAX_LEVELS;
    for (int l = 0; l < LPM_MAX_LEVELS; l++) {
        c->cfactor[l] = 2;
        c->nrelax[l] = 1;
    }
    c->min_coarse = 2;
    c->tol = 1e-9;
    c->rtol = 0.0;
    c->max_iter = 100;
    c->skip = 1;
    c->fmg = 0;
    c->final_fc_relax = 0;
    c->cweight = 1.0;
    *out = c;
    return LPM_OK;
}

void lpm_destroy(lpm_core *c) {
    if (!c) return;
    _lpm_grid_destroy(c);
    free(c->rnorms);
    free(c->bounds);
    free(c);
}

/* options changing the hierarchy invalidate it; it is rebuilt on the next drive */
static void invalidate(lpm_core *c) {
    if (c->built) _lpm_grid_destroy(c);
}

int lpm_set_max_levels(lpm_core *c, int v) {
    if (v < 1 || v > LPM_MAX_LEVELS) return LPM_EINVAL;
    invalidate(c);
    c->max_levels = v;
    return LPM_OK;
}

static int set_per_level(lpm_core *c, int *arr, int level, int v) {
    if (level < -1 || level >= LPM_MAX_LEVELS) return LPM_EINVAL;
    invalidate(c);
    if (level == -1)
        for (int l = 0; l < LPM_MAX_LEVELS; l++) arr[l] = v;
    else
        arr[level] = v;
    return LPM_OK;
}

int lpm_set_cfactor(lpm_core *c, int level, int v) {
    if (v < 2) return LPM_EINVAL;
    return set_per_level(c, c->cfactor, level, v);
}

int lpm_set_nrelax(lpm_core *c, int level, int v) {
    if (v < 0) return LPM_EINVAL;
    return set_per_level(c, c->nrelax, level, v);
}

int lpm_set_min_coarse(lpm_core *c, int v) {
    if (v < 1) return LPM_EINVAL;
    invalidate(c);
    c->min_coarse = v;
    return LPM_OK;
}

int lpm_set_tol(lpm_core *c, double v) {
    if (!(v >= 0.0) || !isfinite(v)) return LPM_EINVAL;
    c->tol = v;
    return LPM_OK;
}

int lpm_set_rtol(lpm_core *c, double v) {
    if (!(v >= 0.0) || !isfinite(v)) return LPM_EINVAL;
    c->rtol = v;
    return LPM_OK;
}

int lpm_set_max_iter(lpm_core *c, int v) {
    if (v < 1) return LPM_EINVAL;
    c->max_iter = v;
    return LPM_OK;
}

int lpm_set_skip(lpm_core *c, int v) {
    if (v != 0 && v != 1) return LPM_EINVAL;
    c->skip = v;
    return LPM_OK;
}

int lpm_set_fmg(lpm_core *c, int v) {
    if (v != 0 && v != 1) return LPM_EINVAL;
    c->fmg = v;
    return LPM_OK;
}

int lpm_set_cweight(lpm_core *c, double v) {
    if (!(v > 0.0 && v <= 2.0)) return LPM_EINVAL;
    c->cweight = v;
    return LPM_OK;
}

int lpm_set_final_fc_relax(lpm_core *c, int v) {
    if (v != 0 && v != 1) return LPM_EINVAL;
    c->final_fc_relax = v;
    return LPM_OK;
}

int lpm_set_defer_norms(lpm_core *c, int v) {
    if (v != 0 && v != 1) return LPM_EINVAL;
    c->defer_norms = v;
    return LPM_OK;
}

int lpm_get_nlevels(const lpm_core *c) { return c->nlevels; }
int lpm_get_iterations(const lpm_core *c) { return c->iterations; }
int lpm_get_converged(const lpm_core *c) { return c->converged; }
int lpm_get_nrnorms(const lpm_core *c) { return c->nrnorms; }

int lpm_get_rnorms(const lpm_core *c, double *out, int n) {
    int m = n < c->nrnorms ? n : c->nrnorms;
    for (int k = 0; k < m; k++) out[k] = c->rnorms[k];
    return m;
}

void lpm_get_timings(const lpm_core *c, double *out) {
    for (int k = 0; k < LPM_NTIMERS; k++) out[k] = c->timings[k];
}

long lpm_get_step_count(const lpm_core *c, int level) {
    return (level >= 0 && level < LPM_MAX_LEVELS) ? c->step_count[level] : 0;
}

long lpm_get_batch_count(const lpm_core *c, int level) {
    return (level >= 0 && level < LPM_MAX_LEVELS) ? c->batch_count[level] : 0;
}

lpm_state lpm_get_state(const lpm_core *c, int i) {
    if (!c->built || i < 0 || i > c->nsteps) return NULL;
    const _lpm_level *L = &c->levels[0];
    if (i < L->lo || i > L->hi) return NULL;
    return L->u[i - L->lo];
}

int lpm_get_level_info(const lpm_core *c, int level, int *n, int *stride, int *cf, int *lo,
                       int *hi) {
    if (!c->built || level < 0 || level >= c->nlevels) return LPM_ESTATE;
    const _lpm_level *L = &c->levels[level];
    *n = L->n;
    *stride = L->stride;
    *cf = L->cf;
    *lo = L->lo;
    *hi = L->hi;
    return LPM_OK;
}

double lpm_time(const lpm_core *c, int i) {
    return c->t0 + ((double)i / (double)c->nsteps) * (c->tfinal - c->t0);
}

const char *lpm_strerror(int code) {
    switch (code) {
    case LPM_OK: return "success";
    case LPM_ECALLBACK: return "a callback failed";
    case LPM_EINVAL: return "invalid argument";
    case LPM_ENOMEM: return "out of memory";
    case LPM_ENAN: return "residual norm is NaN";
    case LPM_ESTATE: return "call out of order";
    default: return "unknown error";
    }
}

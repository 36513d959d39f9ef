/* drive.c -- MGRIT cycles (V and F), halting, and the final fine-grid sweep.
 *
 * Iteration k: on each level from the finest down, relax (nrelax x FC, then F)
 * and restrict (the fine level also measures r_k); solve the coarsest level
 * sequentially; interpolate corrections back up.  With `skip`, iteration 0
 * does no relaxation on the way down: the fine C-point guesses are injected to
 * every level.  Halting after cycle k: r_k < tol, r_k < rtol * r_first,
 * k = max_iter - 1; a non-finite r_k is an error (LPM_ENAN).
 */
#include <math.h>
#include <stdlib.h>

#include "lpm_internal.h"

typedef struct {
    double normsq;
    int have_r;
} cycle_state;

static int down(lpm_core *c, int level, int skip, cycle_state *s) {
    double t = _lpm_now();
    int e;
    if (skip) {
        e = _lpm_inject(c, level);
        c->timings[LPM_T_RESTRICT] += _lpm_now() - t;
        return e;
    }
    e = _lpm_relax(c, level);
    double t2 = _lpm_now();
    c->timings[LPM_T_RELAX] += t2 - t;
    if (e) return e;
    e = _lpm_restrict(c, level, level == 0 ? &s->normsq : NULL);
    if (level == 0) s->have_r = 1;
    c->timings[LPM_T_RESTRICT] += _lpm_now() - t2;
    return e;
}

static int up(lpm_core *c, int level) {
    double t = _lpm_now();
    int e = _lpm_interpolate(c, level);
    c->timings[LPM_T_INTERP] += _lpm_now() - t;
    return e;
}

static int coarsest(lpm_core *c, int level, int final) {
    double t = _lpm_now();
    int e = _lpm_coarse_solve(c, level, final);
    c->timings[LPM_T_COARSE] += _lpm_now() - t;
    return e;
}

static int vcycle(lpm_core *c, int level, int skip, cycle_state *s) {
    if (level == c->nlevels - 1) return coarsest(c, level, 0);
    _LPM_TRY(down(c, level, skip, s));
    _LPM_TRY(vcycle(c, level + 1, skip, s));
    return up(c, level);
}

/* F-cycle: down to the coarsest, then on the way up each level below the
 * finest does one more V-cycle (level sequence 0 1 2 1 2 1 0 for 3 levels) */
static int fcycle(lpm_core *c, int level, int skip, cycle_state *s) {
    if (level == c->nlevels - 1) return coarsest(c, level, 0);
    _LPM_TRY(down(c, level, skip, s));
    _LPM_TRY(fcycle(c, level + 1, skip, s));
    _LPM_TRY(up(c, level));
    if (level > 0) {
        _LPM_TRY(down(c, level, 0, s));
        _LPM_TRY(vcycle(c, level + 1, 0, s));
        _LPM_TRY(up(c, level));
    }
    return LPM_OK;
}

static int push_rnorm(lpm_core *c, double r) {
    if (c->nrnorms == c->cap_rnorms) {
        int cap = c->cap_rnorms ? 2 * c->cap_rnorms : 16;
        double *p = realloc(c->rnorms, sizeof(double) * (size_t)cap);
        if (!p) return LPM_ENOMEM;
        c->rnorms = p;
        c->cap_rnorms = cap;
    }
    c->rnorms[c->nrnorms++] = r;
    return LPM_OK;
}

static int run(lpm_core *c) {
    _lpm_level *L0 = &c->levels[0];
    for (int j = L0->lo; j <= L0->hi; j++) {
        if (c->nlevels == 1 ? j != 0 : j % L0->cf != 0) continue;
        lpm_state s = NULL;
        if (c->cb.init(c->app, lpm_time(c, j), j, &s)) return LPM_ECALLBACK;
        _lpm_set(c, &L0->u[j - L0->lo], s);
    }
    if (c->nlevels == 1) {
        _LPM_TRY(coarsest(c, 0, 1));
        c->iterations = 1;
        c->converged = 1;
        return LPM_OK;
    }
    double rfirst = -1.0;
    for (int k = 0;; k++) {
        cycle_state s = {0.0, 0};
        int skip = c->skip && k == 0;
        _LPM_TRY(c->fmg ? fcycle(c, 0, skip, &s) : vcycle(c, 0, skip, &s));
        int done = 0;
        if (s.have_r && c->defer_norms) {
            _LPM_TRY(push_rnorm(c, 0.0)); /* the app holds the value */
        } else if (s.have_r) {
            _LPM_TRY(_lpm_allreduce(c, &s.normsq, 1));
            double r = sqrt(s.normsq);
            _LPM_TRY(push_rnorm(c, r));
            if (!isfinite(r)) {
                c->iterations = k + 1;
                return LPM_ENAN;
            }
            if (rfirst < 0.0) rfirst = r;
            if (r == 0.0 || r < c->tol || r < c->rtol * rfirst) {
                c->converged = 1;
                done = 1;
            }
        }
        if (k == c->max_iter - 1) done = 1;
        if (done) {
            c->iterations = k + 1;
            break;
        }
    }
    double t = _lpm_now();
    _LPM_TRY(_lpm_fsweep(c, 0, 1));
    if (c->final_fc_relax) _LPM_TRY(_lpm_csweep(c, 0, 1));
    c->timings[LPM_T_FINAL] += _lpm_now() - t;
    return LPM_OK;
}

int lpm_drive(lpm_core *c) {
    if (c->defer_norms && (c->tol != 0.0 || c->rtol != 0.0)) return LPM_EINVAL;
    if (!c->built) _LPM_TRY(_lpm_grid_build(c));
    _lpm_grid_free_states(c);
    c->iterations = 0;
    c->converged = 0;
    c->nrnorms = 0;
    for (int k = 0; k < LPM_NTIMERS; k++) c->timings[k] = 0.0;
    for (int l = 0; l < LPM_MAX_LEVELS; l++) c->step_count[l] = c->batch_count[l] = 0;
    double t = _lpm_now();
    int e = run(c);
    c->timings[LPM_T_TOTAL] = _lpm_now() - t;
    return e;
}

/* relax.c -- F- and C-relaxation sweeps and the sequential coarsest-level solve.
 *
 * F-sweep: u_i = Phi(u_{i-1}) + f_i at every F-point, interval by interval.
 * All F-points at the same offset k of their intervals are independent, so a
 * sweep is cf-1 batched step calls.  A rank whose first point is an F-point
 * needs its left neighbour's last point; that interval is done last so the
 * message overlaps the local work.
 * C-sweep: u_c = w (Phi(u_{c-1}) + f_c) + (1 - w) u_c at every C-point c >= 1.
 */
#include "lpm_internal.h"

#define U(L, j) ((L)->u[(j) - (L)->lo])
#define F(L, j) ((L)->f ? (L)->f[(j) - (L)->lo] : NULL)

int _lpm_step(lpm_core *c, int level, lpm_state u, lpm_state f, int j, int final, lpm_state *out) {
    const _lpm_level *L = &c->levels[level];
    int is = (j - 1) * L->stride, ie = j * L->stride;
    double t = _lpm_now();
    *out = NULL;
    int e = c->cb.step(c->app, u, f, lpm_time(c, is), lpm_time(c, ie), is, ie, level, final, out);
    c->timings[LPM_T_STEP] += _lpm_now() - t;
    c->step_count[level] += 1;
    c->batch_count[level] += 1;
    return e ? LPM_ECALLBACK : LPM_OK;
}

/* Fine indices and times of the steps into level points c->w_idx[0..n-1]; clears
 * c->w_out; returns whether any right-hand side c->w_f[k] is set. */
static int prepare_steps(lpm_core *c, int level, int n) {
    const _lpm_level *L = &c->levels[level];
    int any_f = 0;
    for (int k = 0; k < n; k++) {
        c->w_is[k] = (c->w_idx[k] - 1) * L->stride;
        c->w_ie[k] = c->w_idx[k] * L->stride;
        c->w_ts[k] = lpm_time(c, c->w_is[k]);
        c->w_te[k] = lpm_time(c, c->w_ie[k]);
        c->w_out[k] = NULL;
        if (c->w_f[k]) any_f = 1;
    }
    return any_f;
}

/* Bookkeeping after a step_batch / step_seq callback that started at time t0:
 * timers and counters; on failure the outputs it may have set are released. */
static int after_callback(lpm_core *c, int level, int n, double t0, int e) {
    c->timings[LPM_T_STEP] += _lpm_now() - t0;
    c->step_count[level] += n;
    c->batch_count[level] += 1;
    if (e) {
        for (int k = 0; k < n; k++) _lpm_clear(c, &c->w_out[k]);
        return LPM_ECALLBACK;
    }
    return LPM_OK;
}

/* Steps into the level points c->w_idx[0..n-1] from inputs c->w_u with
 * right-hand sides c->w_f (entries may be NULL); results in c->w_out. */
int _lpm_step_batch(lpm_core *c, int level, int n, int final) {
    int any_f = prepare_steps(c, level, n);
    if (n == 1 || !c->cb.step_batch) {
        for (int k = 0; k < n; k++) {
            int e = _lpm_step(c, level, c->w_u[k], c->w_f[k], c->w_idx[k], final, &c->w_out[k]);
            if (e) {
                for (int m = 0; m < k; m++) _lpm_clear(c, &c->w_out[m]);
                return e;
            }
        }
        return LPM_OK;
    }
    double t = _lpm_now();
    int e = c->cb.step_batch(c->app, n, c->w_u, any_f ? c->w_f : NULL, c->w_ts, c->w_te, c->w_is,
                             c->w_ie, level, final, c->w_out);
    return after_callback(c, level, n, t, e);
}

int _lpm_fsweep(lpm_core *c, int level, int final) {
    _lpm_level *L = &c->levels[level];
    if (L->hi < L->lo) return LPM_OK;
    const int cf = L->cf, lo = L->lo, hi = L->hi;
    const int need_left = lo > 0 && lo % cf != 0;
    const int send_right = L->right >= 0 && (hi + 1) % cf != 0;
    const int c0 = ((lo + cf - 1) / cf) * cf; /* first local C-point */
    const int clast = (hi / cf) * cf;         /* last C-point at or before hi */
    int rreq = -1, sreq = -1;

    if (need_left) _LPM_TRY(_lpm_irecv(c, L->left, _LPM_TAG(_LPM_TAG_F, level), &rreq));
    if (send_right && hi % cf == 0)
        _LPM_TRY(_lpm_isend(c, L->right, _LPM_TAG(_LPM_TAG_F, level), U(L, hi), &sreq));

    /* intervals whose C-point is local: offset by offset, batched */
    for (int k = 1; k < cf; k++) {
        int m = 0;
        for (int cc = c0; cc + k <= hi; cc += cf) {
            int j = cc + k;
            c->w_idx[m] = j;
            c->w_u[m] = U(L, j - 1);
            c->w_f[m] = F(L, j);
            m++;
        }
        if (m == 0) break;
        _LPM_TRY(_lpm_step_batch(c, level, m, final));
        for (int t = 0; t < m; t++) _lpm_set(c, &U(L, c->w_idx[t]), c->w_out[t]);
        if (send_right && hi % cf != 0 && clast >= lo && hi - clast == k)
            _LPM_TRY(_lpm_isend(c, L->right, _LPM_TAG(_LPM_TAG_F, level), U(L, hi), &sreq));
    }

    /* the interval that started on the left neighbour */
    if (need_left) {
        lpm_state prev = NULL, out = NULL;
        _LPM_TRY(_lpm_wait(c, rreq, &prev));
        lpm_state ghost = prev;
        for (int j = lo; j <= hi && j % cf != 0; j++) {
            int e = _lpm_step(c, level, prev, F(L, j), j, final, &out);
            if (e) {
                c->cb.free(c->app, ghost);
                return e;
            }
            _lpm_set(c, &U(L, j), out);
            prev = out;
        }
        c->cb.free(c->app, ghost);
        if (send_right && hi < c0)
            _LPM_TRY(_lpm_isend(c, L->right, _LPM_TAG(_LPM_TAG_F, level), U(L, hi), &sreq));
    }
    if (sreq >= 0) _LPM_TRY(_lpm_wait(c, sreq, NULL));
    return LPM_OK;
}

/* weighted C-update: new = w*a + (1-w)*u_c; consumes a */
static int cupdate(lpm_core *c, _lpm_level *L, int j, lpm_state a) {
    if (L->cweight == 1.0) {
        _lpm_set(c, &U(L, j), a);
        return LPM_OK;
    }
    lpm_state out = NULL;
    int e = c->cb.sum(c->app, L->cweight, a, 1.0 - L->cweight, U(L, j), &out);
    c->cb.free(c->app, a);
    if (e) return LPM_ECALLBACK;
    _lpm_set(c, &U(L, j), out);
    return LPM_OK;
}

/* The C-point steps of a sweep, before any update: a_c = Phi(u_{c-1}) + f_c at every
 * local C-point c >= 1.  The batched ones are left in c->w_out[0..*m) at the points
 * c->w_idx; the one whose interval starts on the left neighbour (the first local
 * point, when it is a C-point) in *left, else NULL.  Shared by the C-sweep below and
 * the fine-grid residual (restrict.c); on failure nothing is left to free. */
int _lpm_cpoint_steps(lpm_core *c, int level, int final, int *m, lpm_state *left) {
    _lpm_level *L = &c->levels[level];
    *m = 0;
    *left = NULL;
    if (L->hi < L->lo) return LPM_OK;
    const int cf = L->cf, lo = L->lo, hi = L->hi;
    const int need_left = lo > 0 && lo % cf == 0;
    const int send_right = L->right >= 0 && (hi + 1) % cf == 0;
    int rreq = -1, sreq = -1, n = 0;

    if (need_left) _LPM_TRY(_lpm_irecv(c, L->left, _LPM_TAG(_LPM_TAG_C, level), &rreq));
    if (send_right)
        _LPM_TRY(_lpm_isend(c, L->right, _LPM_TAG(_LPM_TAG_C, level), U(L, hi), &sreq));

    int first = ((lo + cf - 1) / cf) * cf;
    if (first == 0 || need_left) first += cf;
    for (int j = first; j <= hi; j += cf) {
        c->w_idx[n] = j;
        c->w_u[n] = U(L, j - 1);
        c->w_f[n] = F(L, j);
        n++;
    }
    if (n > 0) _LPM_TRY(_lpm_step_batch(c, level, n, final));
    int e = LPM_OK;
    if (need_left) {
        lpm_state ghost = NULL;
        e = _lpm_wait(c, rreq, &ghost);
        if (!e) {
            e = _lpm_step(c, level, ghost, F(L, lo), lo, final, left);
            c->cb.free(c->app, ghost);
        }
    }
    if (!e && sreq >= 0) e = _lpm_wait(c, sreq, NULL);
    if (e) {
        for (int t = 0; t < n; t++) _lpm_clear(c, &c->w_out[t]);
        _lpm_clear(c, left);
        return e;
    }
    *m = n;
    return LPM_OK;
}

int _lpm_csweep(lpm_core *c, int level, int final) {
    _lpm_level *L = &c->levels[level];
    int m;
    lpm_state a_left;
    _LPM_TRY(_lpm_cpoint_steps(c, level, final, &m, &a_left));
    if (m > 0 && L->cweight != 1.0) { /* new = w a + (1 - w) u_c, all C-points in one call */
        for (int t = 0; t < m; t++) c->w_y[t] = U(L, c->w_idx[t]);
        int e = _lpm_sum_batch(c, m, L->cweight, c->w_out, 1.0 - L->cweight, c->w_y, c->w_s);
        for (int t = 0; t < m; t++) _lpm_clear(c, &c->w_out[t]);
        if (e) {
            _lpm_clear(c, &a_left);
            return e;
        }
        for (int t = 0; t < m; t++) c->w_out[t] = c->w_s[t];
    }
    for (int t = 0; t < m; t++) _lpm_set(c, &U(L, c->w_idx[t]), c->w_out[t]);
    if (a_left) _LPM_TRY(cupdate(c, L, L->lo, a_left));
    return LPM_OK;
}

/* nrelax sweeps of (F then C), then the F-sweep that precedes the residual */
int _lpm_relax(lpm_core *c, int level) {
    for (int s = 0; s < c->levels[level].nrelax; s++) {
        _LPM_TRY(_lpm_fsweep(c, level, 0));
        _LPM_TRY(_lpm_csweep(c, level, 0));
    }
    return _lpm_fsweep(c, level, 0);
}

/* n consecutive steps into level points start..start+n-1 from state u, in one
 * step_seq call */
static int seq_steps(lpm_core *c, int level, int start, int n, lpm_state u, int final) {
    _lpm_level *L = &c->levels[level];
    for (int k = 0; k < n; k++) {
        c->w_idx[k] = start + k;
        c->w_f[k] = F(L, start + k);
    }
    int any_f = prepare_steps(c, level, n);
    double t = _lpm_now();
    int e = c->cb.step_seq(c->app, n, u, any_f ? c->w_f : NULL, c->w_ts, c->w_te, c->w_is,
                           c->w_ie, level, final, c->w_out);
    _LPM_TRY(after_callback(c, level, n, t, e));
    for (int k = 0; k < n; k++) _lpm_set(c, &U(L, start + k), c->w_out[k]);
    return LPM_OK;
}

/* exact solve on the coarsest level: u_j = Phi(u_{j-1}) + f_j in order; a rank's
 * whole stretch is one step_seq call when the app provides it */
int _lpm_coarse_solve(lpm_core *c, int level, int final) {
    _lpm_level *L = &c->levels[level];
    if (L->hi < L->lo) return LPM_OK;
    lpm_state ghost = NULL, out = NULL;
    int sreq = -1, e = LPM_OK;
    if (L->lo > 0) {
        int rreq;
        _LPM_TRY(_lpm_irecv(c, L->left, _LPM_TAG(_LPM_TAG_COARSE, level), &rreq));
        _LPM_TRY(_lpm_wait(c, rreq, &ghost));
    }
    const int start = L->lo > 0 ? L->lo : 1;
    const int n = L->hi - start + 1;
    if (n > 1 && c->cb.step_seq) {
        e = seq_steps(c, level, start, n, start == L->lo ? ghost : U(L, start - 1), final);
    } else {
        for (int j = start; j <= L->hi && !e; j++) {
            e = _lpm_step(c, level, j == L->lo ? ghost : U(L, j - 1), F(L, j), j, final, &out);
            if (!e) _lpm_set(c, &U(L, j), out);
        }
    }
    if (ghost) c->cb.free(c->app, ghost);
    if (e) return e;
    if (L->right >= 0) {
        _LPM_TRY(_lpm_isend(c, L->right, _LPM_TAG(_LPM_TAG_COARSE, level), U(L, L->hi), &sreq));
        _LPM_TRY(_lpm_wait(c, sreq, NULL));
    }
    return LPM_OK;
}

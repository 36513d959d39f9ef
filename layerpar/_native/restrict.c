/* restrict.c -- restriction to the next coarser level (FAS).
 *
 * Injection of u at the C-points: v_{l+1}[i] = u_l[i cf], and the coarse
 * initial guess u_{l+1}[i] = u_l[i cf].  Coarse right-hand side
 *     f_{l+1}[i] = a_{i cf} - Phi_{l+1}(v_{l+1}[i-1])
 *                = r[i] + (v[i] - Phi_{l+1}(v[i-1])),
 * with a_c = Phi_l(u_{c-1}) + f_l[c] from residual.c.
 */
#include <stdlib.h>

#include "lpm_internal.h"

#define U(L, j) ((L)->u[(j) - (L)->lo])

static int count(const _lpm_level *L) { return L->hi >= L->lo ? L->hi - L->lo + 1 : 0; }

static int inject_values(lpm_core *c, int level) {
    _lpm_level *L = &c->levels[level], *C = &c->levels[level + 1];
    for (int i = C->lo; i <= C->hi; i++) {
        lpm_state s = U(L, i * L->cf), cu = NULL, cv = NULL;
        if (c->cb.clone(c->app, s, &cv)) return LPM_ECALLBACK;
        _lpm_set(c, &C->v[i - C->lo], cv);
        if (c->cb.clone(c->app, s, &cu)) return LPM_ECALLBACK;
        _lpm_set(c, &C->u[i - C->lo], cu);
        _lpm_clear(c, &C->f[i - C->lo]);
    }
    return LPM_OK;
}

int _lpm_inject(lpm_core *c, int level) { return inject_values(c, level); }

static void free_array(lpm_core *c, lpm_state *a, int n) {
    if (!a) return;
    for (int k = 0; k < n; k++) _lpm_clear(c, &a[k]);
    free(a);
}

int _lpm_restrict(lpm_core *c, int level, double *normsq) {
    _lpm_level *L = &c->levels[level], *C = &c->levels[level + 1];
    const int nl = count(L);
    lpm_state *a = calloc((size_t)(nl > 0 ? nl : 1), sizeof(lpm_state));
    if (!a) return LPM_ENOMEM;
    int m = 0;
    lpm_state left = NULL;
    int e = _lpm_cpoint_steps(c, level, 0, &m, &left);
    if (!e) {
        for (int t = 0; t < m; t++) a[c->w_idx[t] - L->lo] = c->w_out[t];
        if (left) a[0] = left;
    }
    if (!e && normsq) e = _lpm_residual(c, level, a, normsq);
    if (!e) e = inject_values(c, level);
    if (e || C->hi < C->lo) {
        free_array(c, a, nl);
        return e;
    }

    /* f[i] = a_{i cf} - Phi_C(v[i-1]) */
    const int need_left = C->lo > 0;
    int rreq = -1, sreq = -1;
    if (need_left) e = _lpm_irecv(c, C->left, _LPM_TAG(_LPM_TAG_FAS, level + 1), &rreq);
    if (!e && C->right >= 0)
        e = _lpm_isend(c, C->right, _LPM_TAG(_LPM_TAG_FAS, level + 1), C->v[C->hi - C->lo], &sreq);
    m = 0;
    for (int i = (C->lo > 0 ? C->lo + 1 : 1); !e && i <= C->hi; i++) {
        c->w_idx[m] = i;
        c->w_u[m] = C->v[i - 1 - C->lo];
        c->w_f[m] = NULL;
        m++;
    }
    if (!e && m > 0) {
        e = _lpm_step_batch(c, level + 1, m, 0);
        for (int t = 0; !e && t < m; t++) c->w_x[t] = a[c->w_idx[t] * L->cf - L->lo];
        if (!e) e = _lpm_sum_batch(c, m, 1.0, c->w_x, -1.0, c->w_out, c->w_s);
        if (!e)
            for (int t = 0; t < m; t++) _lpm_set(c, &C->f[c->w_idx[t] - C->lo], c->w_s[t]);
        for (int t = 0; t < m; t++) _lpm_clear(c, &c->w_out[t]);
    }
    if (!e && need_left) {
        lpm_state ghost = NULL, b = NULL, fi = NULL;
        e = _lpm_wait(c, rreq, &ghost);
        if (!e) {
            e = _lpm_step(c, level + 1, ghost, NULL, C->lo, 0, &b);
            c->cb.free(c->app, ghost);
        }
        if (!e) {
            if (c->cb.sum(c->app, 1.0, a[C->lo * L->cf - L->lo], -1.0, b, &fi)) e = LPM_ECALLBACK;
            c->cb.free(c->app, b);
            if (!e) _lpm_set(c, &C->f[0], fi);
        }
    }
    if (!e && sreq >= 0) e = _lpm_wait(c, sreq, NULL);
    free_array(c, a, nl);
    return e;
}

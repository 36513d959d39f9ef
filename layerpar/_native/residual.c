/* residual.c -- C-point steps and the fine-grid residual norm.
 *
 * a_c = Phi(u_{c-1}) + f_c at every local C-point c >= 1 (the value a C-sweep
 * would assign), and on the fine grid r_c = a_c - u_c with
 * ||r||^2 = sum_c ||r_c||^2 (no dt or dx scaling).
 */
#include <stdlib.h>

#include "lpm_internal.h"

#define U(L, j) ((L)->u[(j) - (L)->lo])
#define F(L, j) ((L)->f ? (L)->f[(j) - (L)->lo] : NULL)

/* fills a[j - lo] for local C-points j >= 1; other entries stay NULL */
int _lpm_cpoint_steps(lpm_core *c, int level, lpm_state *a) {
    _lpm_level *L = &c->levels[level];
    if (L->hi < L->lo) return LPM_OK;
    const int cf = L->cf, lo = L->lo, hi = L->hi;
    const int need_left = lo > 0 && lo % cf == 0;
    const int send_right = L->right >= 0 && (hi + 1) % cf == 0;
    int rreq = -1, sreq = -1;

    if (need_left) _LPM_TRY(_lpm_irecv(c, L->left, _LPM_TAG(_LPM_TAG_C, level), &rreq));
    if (send_right)
        _LPM_TRY(_lpm_isend(c, L->right, _LPM_TAG(_LPM_TAG_C, level), U(L, hi), &sreq));

    int first = ((lo + cf - 1) / cf) * cf;
    if (first == 0 || need_left) first += cf;
    int m = 0;
    for (int j = first; j <= hi; j += cf) {
        c->w_idx[m] = j;
        c->w_u[m] = U(L, j - 1);
        c->w_f[m] = F(L, j);
        m++;
    }
    if (m > 0) {
        _LPM_TRY(_lpm_step_batch(c, level, m, 0));
        for (int t = 0; t < m; t++) a[c->w_idx[t] - lo] = c->w_out[t];
    }
    if (need_left) {
        lpm_state ghost = NULL;
        _LPM_TRY(_lpm_wait(c, rreq, &ghost));
        int e = _lpm_step(c, level, ghost, F(L, lo), lo, 0, &a[0]);
        c->cb.free(c->app, ghost);
        if (e) return e;
    }
    if (sreq >= 0) _LPM_TRY(_lpm_wait(c, sreq, NULL));
    return LPM_OK;
}

/* local sum of ||a_c - u_c||^2 over local C-points c >= 1 (one batched sum, one norm) */
int _lpm_residual(lpm_core *c, int level, lpm_state *a, double *normsq) {
    _lpm_level *L = &c->levels[level];
    *normsq = 0.0;
    if (L->hi < L->lo) return LPM_OK;
    int m = 0;
    for (int j = L->lo; j <= L->hi; j++) {
        lpm_state aj = a[j - L->lo];
        if (!aj) continue;
        c->w_x[m] = aj;
        c->w_y[m] = U(L, j);
        m++;
    }
    int e = _lpm_sum_batch(c, m, 1.0, c->w_x, -1.0, c->w_y, c->w_s);
    if (e == LPM_OK && m > 0 && c->cb.norm_sq(c->app, m, c->w_s, normsq)) e = LPM_ECALLBACK;
    for (int k = 0; k < m; k++) _lpm_clear(c, &c->w_s[k]);
    return e;
}

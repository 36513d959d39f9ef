/* residual.c -- the fine-grid residual norm.
 *
 * With a_c = Phi(u_{c-1}) + f_c at every local C-point c >= 1 (the value a C-sweep
 * would assign: _lpm_cpoint_steps in relax.c), r_c = a_c - u_c and
 * ||r||^2 = sum_c ||r_c||^2 (no dt or dx scaling).
 */
#include "lpm_internal.h"

#define U(L, j) ((L)->u[(j) - (L)->lo])
#define F(L, j) ((L)->f ? (L)->f[(j) - (L)->lo] : NULL)

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

/* interp.c -- interpolation of the coarse correction.
 *
 * e_i = u_{l+1}[i] - v_{l+1}[i] is added to the level-l C-point i cf.  On
 * levels above the finest an F-sweep then regenerates the F-points (they are
 * C-points of the level above); on the fine grid the next relaxation or the
 * final sweep does that.
 */
#include "lpm_internal.h"

int _lpm_interpolate(lpm_core *c, int level) {
    _lpm_level *L = &c->levels[level], *C = &c->levels[level + 1];
    int m = 0;
    for (int i = (C->lo > 0 ? C->lo : 1); i <= C->hi; i++) {
        c->w_x[m] = C->u[i - C->lo];
        c->w_y[m] = C->v[i - C->lo];
        c->w_idx[m] = i;
        m++;
    }
    /* e = u - v (into w_out), then u_l[i cf] = e + u_l[i cf] (into w_s) */
    _LPM_TRY(_lpm_sum_batch(c, m, 1.0, c->w_x, -1.0, c->w_y, c->w_out));
    for (int t = 0; t < m; t++) c->w_y[t] = L->u[c->w_idx[t] * L->cf - L->lo];
    int err = _lpm_sum_batch(c, m, 1.0, c->w_out, 1.0, c->w_y, c->w_s);
    for (int t = 0; t < m; t++) _lpm_clear(c, &c->w_out[t]);
    if (err) return err;
    for (int t = 0; t < m; t++) _lpm_set(c, &L->u[c->w_idx[t] * L->cf - L->lo], c->w_s[t]);
    for (int i = C->lo; i <= C->hi; i++) {
        _lpm_clear(c, &C->u[i - C->lo]);
        _lpm_clear(c, &C->v[i - C->lo]);
        _lpm_clear(c, &C->f[i - C->lo]);
    }
    if (level > 0) return _lpm_fsweep(c, level, 0);
    return LPM_OK;
}

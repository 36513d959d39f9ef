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
    for (int i = (C->lo > 0 ? C->lo : 1); i <= C->hi; i++) {
        lpm_state e = NULL, out = NULL;
        lpm_state *slot = &L->u[i * L->cf - L->lo];
        if (c->cb.sum(c->app, 1.0, C->u[i - C->lo], -1.0, C->v[i - C->lo], &e))
            return LPM_ECALLBACK;
        int err = c->cb.sum(c->app, 1.0, e, 1.0, *slot, &out);
        c->cb.free(c->app, e);
        if (err) return LPM_ECALLBACK;
        _lpm_set(c, slot, out);
    }
    for (int i = C->lo; i <= C->hi; i++) {
        _lpm_clear(c, &C->u[i - C->lo]);
        _lpm_clear(c, &C->v[i - C->lo]);
        _lpm_clear(c, &C->f[i - C->lo]);
    }
    if (level > 0) return _lpm_fsweep(c, level, 0);
    return LPM_OK;
}

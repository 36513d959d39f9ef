/* grid.c -- the level hierarchy and its block partition over ranks. */
#include <stdlib.h>

#include "lpm_internal.h"

/* rank owning level-`level` point j: the largest q with bounds[q] <= j*stride */
int _lpm_owner(const lpm_core *c, int level, int j) {
    int fine = j * c->levels[level].stride;
    int lo = 0, hi = c->nranks - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (c->bounds[mid] <= fine)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

static int count(const _lpm_level *L) { return L->hi >= L->lo ? L->hi - L->lo + 1 : 0; }

int _lpm_grid_build(lpm_core *c) {
    int n = c->nsteps, stride = 1, l = 0;
    for (;;) {
        _lpm_level *L = &c->levels[l];
        L->n = n;
        L->stride = stride;
        L->nrelax = c->nrelax[l];
        L->cweight = c->cweight;
        int cf = c->cfactor[l];
        if (l + 1 < c->max_levels && n / cf >= c->min_coarse) {
            L->cf = cf;
            n /= cf;
            stride *= cf;
            l++;
        } else {
            L->cf = 0;
            break;
        }
    }
    c->nlevels = l + 1;

    int flo = c->bounds[c->rank], fhi = c->bounds[c->rank + 1] - 1;
    int maxcount = 0;
    for (l = 0; l < c->nlevels; l++) {
        _lpm_level *L = &c->levels[l];
        L->lo = (flo + L->stride - 1) / L->stride;
        L->hi = fhi / L->stride;
        if (L->hi > L->n) L->hi = L->n;
        int m = count(L);
        L->left = (m > 0 && L->lo > 0) ? _lpm_owner(c, l, L->lo - 1) : -1;
        L->right = (m > 0 && L->hi < L->n) ? _lpm_owner(c, l, L->hi + 1) : -1;
        size_t sz = (size_t)(m > 0 ? m : 1);
        L->u = calloc(sz, sizeof(lpm_state));
        L->v = l > 0 ? calloc(sz, sizeof(lpm_state)) : NULL;
        L->f = l > 0 ? calloc(sz, sizeof(lpm_state)) : NULL;
        if (!L->u || (l > 0 && (!L->v || !L->f))) {
            c->built = 1;
            _lpm_grid_destroy(c);
            return LPM_ENOMEM;
        }
        if (m > maxcount) maxcount = m;
    }
    c->nwork = maxcount + 1;
    size_t w = (size_t)c->nwork;
    c->w_u = calloc(w, sizeof(lpm_state));
    c->w_f = calloc(w, sizeof(lpm_state));
    c->w_out = calloc(w, sizeof(lpm_state));
    c->w_x = calloc(w, sizeof(lpm_state));
    c->w_y = calloc(w, sizeof(lpm_state));
    c->w_s = calloc(w, sizeof(lpm_state));
    c->w_ts = calloc(w, sizeof(double));
    c->w_te = calloc(w, sizeof(double));
    c->w_is = calloc(w, sizeof(int));
    c->w_ie = calloc(w, sizeof(int));
    c->w_idx = calloc(w, sizeof(int));
    c->built = 1;
    if (!c->w_u || !c->w_f || !c->w_out || !c->w_x || !c->w_y || !c->w_s || !c->w_ts || !c->w_te || !c->w_is || !c->w_ie ||
        !c->w_idx) {
        _lpm_grid_destroy(c);
        return LPM_ENOMEM;
    }
    return LPM_OK;
}

void _lpm_grid_free_states(lpm_core *c) {
    if (!c->built) return;
    for (int l = 0; l < c->nlevels; l++) {
        _lpm_level *L = &c->levels[l];
        int m = count(L);
        for (int k = 0; k < m; k++) {
            if (L->u) _lpm_clear(c, &L->u[k]);
            if (L->v) _lpm_clear(c, &L->v[k]);
            if (L->f) _lpm_clear(c, &L->f[k]);
        }
    }
}

void _lpm_grid_destroy(lpm_core *c) {
    if (!c->built) return;
    _lpm_grid_free_states(c);
    for (int l = 0; l < c->nlevels; l++) {
        _lpm_level *L = &c->levels[l];
        free(L->u);
        free(L->v);
        free(L->f);
        L->u = L->v = L->f = NULL;
    }
    free(c->w_u);
    free(c->w_f);
    free(c->w_out);
    free(c->w_x);
    free(c->w_y);
    free(c->w_s);
    free(c->w_ts);
    free(c->w_te);
    free(c->w_is);
    free(c->w_ie);
    free(c->w_idx);
    c->w_u = c->w_f = c->w_out = c->w_x = c->w_y = c->w_s = NULL;
    c->w_ts = c->w_te = NULL;
    c->w_is = c->w_ie = c->w_idx = NULL;
    c->built = 0;
    c->nlevels = 0;
}

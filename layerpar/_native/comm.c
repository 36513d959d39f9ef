/* comm.c -- boundary-state communication through the transport callbacks. */
#include "lpm_internal.h"

int _lpm_isend(lpm_core *c, int dest, int tag, lpm_state u, int *req) {
    return c->cb.isend(c->app, dest, tag, u, req) ? LPM_ECALLBACK : LPM_OK;
}

int _lpm_irecv(lpm_core *c, int src, int tag, int *req) {
    return c->cb.irecv(c->app, src, tag, req) ? LPM_ECALLBACK : LPM_OK;
}

int _lpm_wait(lpm_core *c, int req, lpm_state *out) {
    double t = _lpm_now();
    lpm_state tmp = NULL;
    int e = c->cb.wait(c->app, req, &tmp);
    c->timings[LPM_T_WAIT] += _lpm_now() - t;
    if (out)
        *out = tmp;
    else if (tmp)
        c->cb.free(c->app, tmp);
    return e ? LPM_ECALLBACK : LPM_OK;
}

int _lpm_allreduce(lpm_core *c, double *v, int n) {
    double t = _lpm_now();
    int e = c->cb.allreduce_sum(c->app, v, n);
    c->timings[LPM_T_REDUCE] += _lpm_now() - t;
    return e ? LPM_ECALLBACK : LPM_OK;
}

# Declarations of XBraid's public header `braid.h` that layerpar's XBraid engine uses
# (extern only: no XBraid code here; XBraid is built from the user's tree, XBRAID_DIR).
from mpi4py.libmpi cimport MPI_Comm

cdef extern from "braid.h" nogil:
    ctypedef int braid_Int
    ctypedef double braid_Real
    # opaque to us: XBraid only passes these pointers back to our callbacks
    ctypedef void *braid_App
    ctypedef void *braid_Vector
    ctypedef void *braid_Core
    ctypedef void *braid_StepStatus
    ctypedef void *braid_AccessStatus
    ctypedef void *braid_BufferStatus


cdef extern from "braid.h":
    # callbacks run with the GIL held (braid_Drive is called with it)
    ctypedef braid_Int (*braid_PtFcnStep)(braid_App app, braid_Vector ustop,
                                          braid_Vector fstop, braid_Vector u,
                                          braid_StepStatus status) noexcept
    ctypedef braid_Int (*braid_PtFcnInit)(braid_App app, braid_Real t,
                                          braid_Vector *u_ptr) noexcept
    ctypedef braid_Int (*braid_PtFcnClone)(braid_App app, braid_Vector u,
                                           braid_Vector *v_ptr) noexcept
    ctypedef braid_Int (*braid_PtFcnFree)(braid_App app, braid_Vector u) noexcept
    ctypedef braid_Int (*braid_PtFcnSum)(braid_App app, braid_Real alpha, braid_Vector x,
                                         braid_Real beta, braid_Vector y) noexcept
    ctypedef braid_Int (*braid_PtFcnSpatialNorm)(braid_App app, braid_Vector u,
                                                 braid_Real *norm_ptr) noexcept
    ctypedef braid_Int (*braid_PtFcnAccess)(braid_App app, braid_Vector u,
                                            braid_AccessStatus status) noexcept
    ctypedef braid_Int (*braid_PtFcnBufSize)(braid_App app, braid_Int *size_ptr,
                                             braid_BufferStatus status) noexcept
    ctypedef braid_Int (*braid_PtFcnBufPack)(braid_App app, braid_Vector u, void *buffer,
                                             braid_BufferStatus status) noexcept
    ctypedef braid_Int (*braid_PtFcnBufUnpack)(braid_App app, void *buffer,
                                               braid_Vector *u_ptr,
                                               braid_BufferStatus status) noexcept

cdef extern from "braid.h" nogil:
    braid_Int braid_Init(MPI_Comm comm_world, MPI_Comm comm, braid_Real tstart,
                         braid_Real tstop, braid_Int ntime, braid_App app,
                         braid_PtFcnStep step, braid_PtFcnInit init, braid_PtFcnClone clone,
                         braid_PtFcnFree free, braid_PtFcnSum sum,
                         braid_PtFcnSpatialNorm spatialnorm, braid_PtFcnAccess access,
                         braid_PtFcnBufSize bufsize, braid_PtFcnBufPack bufpack,
                         braid_PtFcnBufUnpack bufunpack, braid_Core *core_ptr)
    braid_Int braid_Drive(braid_Core core)
    braid_Int braid_Destroy(braid_Core core)

    braid_Int braid_SetMaxLevels(braid_Core core, braid_Int max_levels)
    braid_Int braid_SetMinCoarse(braid_Core core, braid_Int min_coarse)
    braid_Int braid_SetSkip(braid_Core core, braid_Int skip)
    braid_Int braid_SetAbsTol(braid_Core core, braid_Real atol)
    braid_Int braid_SetRelTol(braid_Core core, braid_Real rtol)
    braid_Int braid_SetNRelax(braid_Core core, braid_Int level, braid_Int nrelax)
    braid_Int braid_SetCRelaxWt(braid_Core core, braid_Int level, braid_Real Cwt)
    braid_Int braid_SetCFactor(braid_Core core, braid_Int level, braid_Int cfactor)
    braid_Int braid_SetMaxIter(braid_Core core, braid_Int max_iter)
    braid_Int braid_SetFMG(braid_Core core)
    braid_Int braid_SetPrintLevel(braid_Core core, braid_Int print_level)
    braid_Int braid_SetFileIOLevel(braid_Core core, braid_Int io_level)
    braid_Int braid_SetAccessLevel(braid_Core core, braid_Int access_level)
    braid_Int braid_SetFinalFCRelax(braid_Core core)

    braid_Int braid_GetNumIter(braid_Core core, braid_Int *niter_ptr)
    braid_Int braid_GetRNorms(braid_Core core, braid_Int *nrequest_ptr, braid_Real *rnorms)
    braid_Int braid_GetNLevels(braid_Core core, braid_Int *nlevels_ptr)

    braid_Int braid_StepStatusGetTstartTstop(braid_StepStatus s, braid_Real *tstart,
                                             braid_Real *tstop)
    braid_Int braid_StepStatusGetTIndex(braid_StepStatus s, braid_Int *tindex)
    braid_Int braid_StepStatusGetLevel(braid_StepStatus s, braid_Int *level)
    braid_Int braid_StepStatusGetDone(braid_StepStatus s, braid_Int *done)
    braid_Int braid_AccessStatusGetTIndex(braid_AccessStatus s, braid_Int *tindex)
    braid_Int braid_AccessStatusGetLevel(braid_AccessStatus s, braid_Int *level)
    braid_Int braid_AccessStatusGetDone(braid_AccessStatus s, braid_Int *done)

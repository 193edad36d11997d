"""Native thread pools pinned to the configuration.

numpy's BLAS (OpenBLAS) starts one thread per core and spins them between
calls; beside onnxruntime's own pool and a 50 Hz control loop on a 2-core robot
they fight for the CPU (measured in issue 11: exact search over 2,000 vectors
under load took 9.9 ms with OpenBLAS on 2 threads, 0.69 ms on 1).  The store
and the daemon call :func:`pin_native_threads` when they start, so nobody has
to set ``OPENBLAS_NUM_THREADS`` by hand.  onnxruntime's pool is sized by
``embedding.threads`` in :mod:`reachy_memory.embedding`.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)
_pinned: Any = None  # the threadpoolctl limiter: kept alive so the limit stays


def pin_native_threads(blas_threads: int) -> dict[str, int]:
    """Limit every BLAS and OpenMP pool loaded in this process to ``blas_threads``.

    Returns ``{library: threads}`` as now in force.  Without threadpoolctl the
    pools are left alone (logged once).
    """
    global _pinned
    try:
        from threadpoolctl import threadpool_info, threadpool_limits
    except ImportError:  # an optional speed-up, never a reason to fail
        log.warning("threadpoolctl is not installed: BLAS threads are not pinned")
        return {}
    _pinned = threadpool_limits(limits=blas_threads, user_api="blas")
    threadpool_limits(limits=blas_threads, user_api="openmp")
    return {info["internal_api"]: int(info["num_threads"]) for info in threadpool_info()}

"""Native runtime settings: thread pools pinned to the configuration, a bounded heap,
large buffers in their own mappings (:func:`big_buffer`, :func:`release_pages`).

numpy's BLAS (OpenBLAS) starts one thread per core and spins them between
calls; beside onnxruntime's own pool and a 50 Hz control loop on a 2-core robot
they fight for the CPU (measured in issue 11: exact search over 2,000 vectors
under load took 9.9 ms with OpenBLAS on 2 threads, 0.69 ms on 1).  The store
and the daemon call :func:`pin_native_threads` when they start, so nobody has
to set ``OPENBLAS_NUM_THREADS`` by hand.  onnxruntime's pool is sized by
``embedding.threads`` in :mod:`reachy_memory.embedding.embedder`.

onnxruntime frees a batch's activations (tens of MB for 8 texts of 256 tokens)
to glibc, whose adaptive mmap threshold then keeps such blocks on the heap, and
a process's RSS would stay at the peak of the largest batch ever seen.  So the
embedder calls :func:`release_free_heap` after a large call, and the daemon
also calls :func:`bound_native_heap` (a fixed 4 MiB mmap threshold, two arenas:
daemon RSS under the mixed load 195 -> 180 MB peak, README).  A 256 KiB
threshold (tried first) made every array over 256 KiB a fresh mapping,
page-faulted on this VM at ~2.6 us a page: a 2,000-vector gather went from 0.24
to 2.5 ms; exact search now gathers through a reused buffer instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import logging
import mmap
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

log = logging.getLogger(__name__)
_pinned: Any = None  # the threadpoolctl limiter: kept alive so the limit stays
class _WhileAny:
    """A process-wide setting held while any thread is inside (nesting and threads
    allowed, leaving in any order): ``enter`` runs for the first one in and returns
    what ``leave`` is given when the last one goes out."""

    def __init__(self, enter: Callable[[], Any], leave: Callable[[Any], None]) -> None:
        self._enter, self._leave = enter, leave
        self._lock = threading.Lock()
        self._inside, self._saved = 0, None

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            if self._inside == 0:
                self._saved = self._enter()
            self._inside += 1
        try:
            yield
        finally:
            with self._lock:
                self._inside -= 1
                if self._inside == 0:
                    self._leave(self._saved)


def _gc_off() -> bool:
    was = gc.isenabled()
    gc.disable()
    return was


_NO_GC = _WhileAny(_gc_off, lambda was: gc.enable() if was else None)


def gc_paused() -> contextlib.AbstractContextManager[None]:
    """No garbage collection while any thread is inside (nesting and threads allowed).

    For bulk work that allocates tens of thousands of objects without cycles (a
    mass expiry, a snapshot): with a store of 100k memories every full collection
    walks ~400k objects, and creating 66k small lists took 234 ms with the
    collector on against 16 ms with it off (issue 11)."""
    return _NO_GC.held()


SHORT_SWITCH_SECONDS = 0.0005


def _switch_short() -> tuple[float, float]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(ours := min(before, SHORT_SWITCH_SECONDS))
    return before, ours


def _switch_back(saved: tuple[float, float]) -> None:
    before, ours = saved
    if sys.getswitchinterval() == ours:  # not if another part of the process set its own meanwhile
        sys.setswitchinterval(before)


_SHORT_SWITCH = _WhileAny(_switch_short, _switch_back)


def short_switch_interval() -> contextlib.AbstractContextManager[None]:
    """The interpreter's thread switch interval at most ``SHORT_SWITCH_SECONDS`` while any
    thread is inside; the last one out restores it (a backup and a compaction may
    overlap and end in either order)."""
    return _SHORT_SWITCH.held()


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


M_MMAP_THRESHOLD, M_ARENA_MAX = -3, -8  # glibc's mallopt parameter numbers
HEAP_MMAP_THRESHOLD = 4 << 20
HEAP_ARENAS = 2


def bound_native_heap() -> bool:
    """The daemon's heap policy (glibc): blocks of 4 MiB or more get their own
    mapping, returned when freed (a fixed threshold also stops glibc raising it
    to 32 MiB after each large free), and two malloc arenas instead of one per
    thread, whose free space no other thread could reuse.  Returns True when
    set; False where the C library is not glibc or the environment already says
    (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_ARENA_MAX``: the operator's word wins)."""
    if {"MALLOC_MMAP_THRESHOLD_", "MALLOC_ARENA_MAX"} & set(os.environ):
        return False
    mallopt = _glibc_call("mallopt")
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD)) and bool(mallopt(M_ARENA_MAX, HEAP_ARENAS))


TRIM_TOKENS = 2048  # an embedding call that ran this many (padded) tokens gives its heap back


def release_free_heap() -> bool:
    """Give the C heap's free memory back to the system (glibc ``malloc_trim``);
    False where the C library has no such call.  Costs 1-6 ms on the daemon's heap
    at 10k memories (~10 ms on a larger one), holding each malloc arena meanwhile:
    called after big embedding calls (:data:`TRIM_TOKENS`) and by the daemon at idle
    moments (``server.heap_trim_seconds``), never per query."""
    trim = _glibc_call("malloc_trim")
    if trim is None:
        return False
    trim(0)  # ctypes releases the GIL for the call: other threads go on
    return True


@functools.cache
def _glibc_call(name: str) -> Any:
    """The C library's function ``name``, or None where there is none (not glibc).
    Looked up once: ``find_library`` runs ``ldconfig`` in a subprocess (~2.6 ms)."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


_big_buffers: weakref.WeakSet[mmap.mmap] = weakref.WeakSet()  # what release_pages may give back


def big_buffer(nbytes: int) -> mmap.mmap:
    """``nbytes`` of zeroed memory in an anonymous private mapping, for a large
    buffer that grows or is given back in parts: ``resize`` moves its pages
    (``mremap``) instead of copying them, pages are resident only once written, and
    :func:`release_pages` returns parts of it.  Huge pages are asked for: on this
    VM a 150 MB copy into fresh memory took 95 ms with 4 KiB pages and 28 ms with them.
    Raises MemoryError when the system has no room."""
    try:
        mapping = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE)
    except OSError as exc:
        raise MemoryError(f"cannot map {nbytes} bytes: {exc.strerror}") from exc
    with contextlib.suppress(AttributeError, OSError):  # an advice, not a need
        mapping.madvise(mmap.MADV_HUGEPAGE)
    _big_buffers.add(mapping)
    return mapping


def release_pages(view: memoryview) -> None:
    """Give back the pages wholly inside ``view``, a part of a :func:`big_buffer`
    nobody will read again (they read as zeros after).  Any other buffer (a file's
    mapping, whose pages would be re-read from the file), an empty or a
    non-contiguous view: no-op."""
    mapping = view.obj
    if not (isinstance(mapping, mmap.mmap) and mapping in _big_buffers and view.nbytes and view.contiguous):
        return
    base = np.frombuffer(mapping, np.uint8, 1).ctypes.data
    start = np.frombuffer(view, np.uint8, 1).ctypes.data - base
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    last = (start + view.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        mapping.madvise(mmap.MADV_DONTNEED, first, last - first)

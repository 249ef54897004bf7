"""A local process pool whose workers end with the command that started them.

    with process_pool(workers) as pool:
        futures = [pool.submit(work, item) for item in items]
        ...

`concurrent.futures.ProcessPoolExecutor` with spawned workers (torch's thread pools and a Ray driver's threads
do not survive a fork), made safe to stop. A plain pool leaves its workers behind when the parent stops early:
its `shutdown(wait=True)` waits for the cells in flight (so a Ctrl-C's hard-exit watchdog, thoughtkv/cli.py,
ends the parent first), `kill PID` reaches the parent only, and `os._exit` skips every cleanup; the orphaned
workers then keep their memory and the multiprocessing resource tracker (which exits once every process holding
its pipe is gone) stays with them. Here:

- leaving the block by an exception (Ctrl-C, SIGTERM raised as one, an error, a generator closed early)
  cancels what has not started and terminates the workers, then joins them, instead of waiting for their work;
- every worker ignores SIGINT (a Ctrl-C at a terminal reaches the whole process group: the parent stops the
  pool, so workers do not each print a traceback) and, on Linux, asks the kernel for SIGTERM when its parent
  dies (prctl PR_SET_PDEATHSIG), so even a parent ended by SIGKILL or `os._exit` takes its workers along.

Finished work is the caller's: workers return results and the parent writes them, so a terminated worker
leaves no partial file.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager

PR_SET_PDEATHSIG = 1  # linux/prctl.h: the signal this process gets when its parent thread exits
JOIN_TIMEOUT_S = 5.0  # a terminated worker is gone in milliseconds; this bounds a stuck one


def _end_with_parent(parent_pid: int) -> None:
    """Worker initializer: ignore Ctrl-C (the parent's to handle) and die with the parent."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
        except (OSError, AttributeError):  # no prctl in this libc: the parent's own cleanup still applies
            pass
    if os.getppid() != parent_pid:  # the parent died before the request above took effect
        os._exit(1)


@contextmanager
def process_pool(workers: int) -> Iterator[ProcessPoolExecutor]:
    """A spawn pool of `workers` processes; leaving the block normally waits for submitted work, leaving it by
    an exception terminates the workers (see the module docstring)."""
    import multiprocessing

    pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_end_with_parent, initargs=(os.getpid(),))
    try:
        yield pool
    except BaseException:
        stop_pool(pool)
        raise
    pool.shutdown(wait=True)


def stop_pool(pool: ProcessPoolExecutor) -> None:
    """Cancel what has not started and terminate the workers now (what Python 3.14's terminate_workers does)."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=JOIN_TIMEOUT_S)

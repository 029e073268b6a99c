"""One writer per output folder: `run_sweep` holds `out_dir/.maskahead.lock` while it writes, so a
second eval into the same `--out` is refused with one line instead of interleaving rows.

The lock is an exclusive `flock` on the file, which the kernel drops when its process ends in any
way (exit, Ctrl-C, kill -9): a lock file left by a dead process is simply taken over. The file
holds the owner's pid, host and start time, for the message.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import time
from typing import Iterator

LOCK_NAME = ".maskahead.lock"


class OutInUse(ValueError):
    """Another live process holds the output folder's lock."""


def _owner(fd: int) -> str:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        info = json.loads(os.read(fd, 4096).decode() or "{}")
        return f"pid {info['pid']} on {info['host']}, since {info['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


def _pid_alive(fd: int) -> bool:
    """Whether the lock file names a live process other than this one (on this host)."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        info = json.loads(os.read(fd, 4096).decode() or "{}")
        pid = int(info["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if pid == os.getpid() or info.get("host") != socket.gethostname():
        return pid != os.getpid()  # another host's process cannot be checked: taken as alive
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def out_lock(out_dir: str, what: str = "--out") -> Iterator[str]:
    """Hold the lock of `out_dir` (created if missing) for the block; OutInUse when a live
    process holds it. Yields the lock file's path; the file is removed when the block ends."""
    import fcntl

    from .. import interrupt

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, LOCK_NAME)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            who = _owner(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES) and not _pid_alive(fd):
                break  # no flock on this file system: the pid in the file decides
            os.close(fd)
            raise OutInUse(f"{what} {out_dir} is in use by another eval ({who}): wait for it to end "
                           f"or use another {what}") from None
        try:  # the file we locked may have been removed by the previous holder meanwhile: retry
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps(dict(pid=os.getpid(), host=socket.gethostname(),
                                 started=time.strftime("%Y-%m-%dT%H:%M:%S"))).encode())

    def release():
        with contextlib.suppress(OSError):
            os.unlink(path)
        with contextlib.suppress(OSError):
            os.close(fd)

    forget = interrupt.on_exit(release)  # Ctrl-C leaves through os._exit: no finally
    try:
        yield path
    finally:
        forget()
        release()

"""Writing a set of files into a folder all-or-nothing: the commit protocol of every `save_pretrained`.

A model folder also holds tokenizer files and the user's own files, so the folder itself cannot be
swapped by one rename; the files are replaced one by one, and a marker says when that is under way:

1. Stage: every file is written into a hidden staging folder inside the target,
   `.xlagen-save-<pid>-<host>-<random>`, and flushed to disk (fsync). A failure here (a full disk, a bad
   value) removes the staging folder and leaves the target's files as they were. After a kill, the next
   save into the folder removes the staging folder (see "Who is still saving" below).
2. Mark: `.xlagen-save-incomplete` is created, listing the staging folder and the file names, and
   flushed together with the folder. From here on the staging folder holds a complete set of new files.
3. Commit: each staged file is renamed over its target (`os.replace`, atomic per file).
4. Finish: the marker is removed, then the staging folder.

The marker exists exactly while the folder may mix files of two saves. Loaders refuse such a folder
(`check_save_complete`), and `finish_interrupted_save` (which the next save into the folder also runs)
moves the remaining staged files into place: an interrupted commit is completed, never rolled back,
as the old files may already be gone. Readers that do not know the marker (transformers) can see a mixed
folder only after a kill inside step 3, which takes a few renames.

Who is still saving: a save holds an exclusive `flock` on the `.lock` file of its staging folder from the
moment that file appears (it is locked under another name, then renamed) until the save ends. The kernel
releases the lock when the process ends however it ends (SIGKILL included, and before a parent reaps it),
so a free lock means the save is over, and a held one that it is running, whatever its process id
(reused by another process, as in containers, which also change host names) and on any machine that shares
the lock (local file systems, NFS). A staging folder without a lock file (its save was killed before it
made one, or the file system has no locks, or an older xlagen made it) falls back on the process id: over
when that process is gone (same host), or after a day without change.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pathlib
import re
import secrets
import shutil
import socket
import time
from collections.abc import Callable

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: process ids and age only
    fcntl = None

MARKER_NAME = ".xlagen-save-incomplete"
STAGING_PREFIX = ".xlagen-save-"
# A staging folder or marker without a lock to ask, whose process cannot be checked (another host, a reused
# process id), is abandoned once it has not changed for this long.
ABANDONED_AFTER_SECONDS = 24 * 3600
LOCK_NAME = ".lock"  # inside a staging folder; flock-ed by its save while it runs
_STAGING_NAME = re.compile(re.escape(STAGING_PREFIX) + r"(\d+)-([0-9a-f]{8})-[0-9a-f]+$")
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how safetensors and tokenizers report OS errors


def write_files(folder: str | os.PathLike[str], writers: dict[str, Callable[[pathlib.Path], None]],
                overwrite: bool = False) -> tuple[str, ...]:
    """Writes several files into `folder` all-or-nothing (the protocol in this module's docstring).

    Before writing, an interrupted earlier save into the same folder is finished and staging folders
    left by dead processes are removed.

    Args:
        folder: Destination; created if needed. Other files in it are left alone.
        writers: File name -> function writing that file at the path it is given.
        overwrite: Replace files that already exist; otherwise they are an error.

    Returns:
        The written paths.

    Raises:
        FileExistsError: (an OSError) if a file exists and `overwrite` is False; nothing is written.
        NotADirectoryError: if `folder` (or a parent) is a file.
        IsADirectoryError: if one of the files to write is a folder in `folder`.
        OSError: if the files cannot be written (a full disk: errno ENOSPC; no permission:
            PermissionError), naming the folder and file; the folder keeps its previous files. Also if
            another process is saving into the folder, or if the renames fail halfway (the message says
            how to finish the save).
        Exceptions of the writers other than OSError propagate unchanged, after the staging folder is
        removed.
    """
    folder = pathlib.Path(folder)
    names = list(writers)
    if folder.is_dir():
        unresolved = _finish(folder)
        if unresolved and not set(unresolved) <= set(names):
            raise OSError(_unrecoverable_message(folder, unresolved))
        _remove_abandoned_staging(folder)
    elif folder.exists():
        raise NotADirectoryError(f"Cannot save into '{folder}': it is a file, not a folder.")
    existing = sorted(name for name in names if (folder / name).exists())
    folders = [name for name in existing if (folder / name).is_dir()]
    if folders:
        raise IsADirectoryError(f"Cannot save {', '.join(folders)} into '{folder}': a folder of that name is in "
                                "the way; move it, or save into another folder.")
    if existing and not overwrite:
        raise FileExistsError(f"{folder} already holds {', '.join(existing)}: pass overwrite=True to replace "
                              "them, or save into an empty folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise _named(error, f"Cannot create the folder '{folder}' to save into") from error
    staging = folder / f"{STAGING_PREFIX}{os.getpid()}-{_host_id()}-{secrets.token_hex(4)}"
    try:
        staging.mkdir()
        lock = _lock(staging)
    except OSError as error:
        shutil.rmtree(staging, ignore_errors=True)
        raise _named(error, f"Cannot write into the folder '{folder}'") from error
    try:
        _stage_and_commit(folder, staging, writers)
    finally:
        if lock is not None:
            os.close(lock)  # after the staging folder is gone: until then, it is this save's
    return tuple(str(folder / name) for name in names)


def _stage_and_commit(folder: pathlib.Path, staging: pathlib.Path,
                      writers: dict[str, Callable[[pathlib.Path], None]]) -> None:
    """Steps 1 to 4 of the protocol, into the (locked) staging folder."""
    names = list(writers)
    current = ""
    try:
        for name in names:
            current = name
            writers[name](staging / name)
            # Readable by all, as checkpoints are shared (safetensors creates its files owner-only).
            os.chmod(staging / name, 0o644)
            _fsync(staging / name)
        _fsync(staging)
        current = MARKER_NAME
        _mark(folder, staging.name, names)
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        os_error = _as_os_error(error)
        if os_error is None or os_error.errno is None:  # Not an OS error, or one of ours that says it all.
            raise
        hint = "Free some disk space and save again. " if os_error.errno == errno.ENOSPC else ""
        raise _named(os_error, f"Cannot write {current} into '{folder}'",
                     f"{hint}Nothing was saved: the folder keeps its previous files.") from error
    _commit(folder, staging.name, names)


def check_save_complete(folder: str | os.PathLike[str]) -> None:
    """Refuses a folder whose last save was interrupted while its files were being replaced.

    Raises:
        OSError: if `folder` holds `.xlagen-save-incomplete`; the message names the files that may
            mix two saves and says how to finish the save.
    """
    marker = _read_marker(pathlib.Path(folder))
    if marker is None or marker["staging"] is None:  # No marker, or one cut short before any rename.
        return
    files = ", ".join(marker["files"])
    if not _is_over(pathlib.Path(folder) / marker["staging"], marker["pid"], marker["host"], marker["mtime"]):
        raise OSError(f"'{folder}' is being saved into right now ({_owner(marker)} is replacing {files}); load it "
                      "when that save has finished.")
    raise OSError(f"The last save into '{folder}' was interrupted while it replaced {files}: these files may mix "
                  "two saves. Finish that save with xlagen.weights.checkpoint.finish_interrupted_save("
                  f"'{folder}') (saving into the folder again also finishes it), then load again.")


def finish_interrupted_save(folder: str | os.PathLike[str]) -> bool:
    """Completes a save into `folder` that was killed while it replaced the files.

    Moves the files left in the staging folder named by `.xlagen-save-incomplete` into place, then
    removes the marker and the staging folder. Also removes staging folders of dead processes.

    Returns:
        True if an interrupted save was finished, False if there was none.

    Raises:
        OSError: if the save is still running in another process, or cannot be finished because its
            staging folder is gone (the message names the files to save again).
    """
    folder = pathlib.Path(folder)
    had_marker = (folder / MARKER_NAME).exists()
    unresolved = _finish(folder)
    if unresolved:
        raise OSError(_unrecoverable_message(folder, unresolved))
    _remove_abandoned_staging(folder)
    return had_marker


def _finish(folder: pathlib.Path) -> list[str]:
    """Rolls an abandoned commit forward; returns the files it could not finish (staging folder gone)."""
    marker = _read_marker(folder)
    if marker is None:
        return []
    if marker["staging"] is None:  # Cut short before any rename: every file is still old.
        if time.time() - marker["mtime"] <= 60:  # Or being written right now, within microseconds.
            raise OSError(f"Another save into '{folder}' is starting to replace its files right now; save again "
                          "when it has finished.")
        (folder / MARKER_NAME).unlink(missing_ok=True)
        return []
    if not _is_over(folder / marker["staging"], marker["pid"], marker["host"], marker["mtime"]):
        raise OSError(f"Another save into '{folder}' is replacing {', '.join(marker['files'])} right now "
                      f"({_owner(marker)}); save again when it has finished.")
    if not (folder / marker["staging"]).is_dir():
        return marker["files"]
    _commit(folder, marker["staging"], marker["files"])
    return []


def _commit(folder: pathlib.Path, staging_name: str, names: list[str]) -> None:
    """Steps 3 and 4: renames the staged files into place, then removes the marker and the staging folder."""
    staging = folder / staging_name
    try:
        for name in names:
            if (staging / name).exists():  # Absent: already moved by the interrupted commit being finished.
                os.replace(staging / name, folder / name)
        _fsync(folder)
        (folder / MARKER_NAME).unlink(missing_ok=True)
        _fsync(folder)
    except OSError as error:
        _disown(folder, staging_name, names)
        raise _named(error, f"Saving into '{folder}' failed while it replaced {', '.join(names)}",
                     "These files may now mix two saves, and loading the folder is refused until the save is "
                     f"finished: once the cause is fixed, call xlagen.weights.checkpoint.finish_interrupted_save("
                     f"'{folder}'), or save again.") from error
    shutil.rmtree(staging, ignore_errors=True)


def _mark(folder: pathlib.Path, staging_name: str, names: list[str]) -> None:
    """Step 2: creates the marker, exclusively, so that commits into one folder exclude each other."""
    content = json.dumps({"staging": staging_name, "files": names, "pid": os.getpid(), "host": _host_id()})
    path = folder / MARKER_NAME
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:  # A commit that died, or that began since this save started.
        unresolved = _finish(folder)  # Raises if that commit is still running.
        if not unresolved:
            return _mark(folder, staging_name, names)
        if not set(unresolved) <= set(names):
            raise OSError(_unrecoverable_message(folder, unresolved)) from None
        # This save rewrites every file of an unfinishable one: it takes over the marker in one rename.
        temporary = folder / staging_name / MARKER_NAME
        temporary.write_text(content)
        _fsync(temporary)
        os.replace(temporary, path)
    else:
        try:
            os.write(descriptor, content.encode())
            os.fsync(descriptor)
        except BaseException:
            os.close(descriptor)
            path.unlink(missing_ok=True)
            raise
        os.close(descriptor)
    _fsync(folder)
    return None


def _disown(folder: pathlib.Path, staging_name: str, names: list[str]) -> None:
    """Marks a failed commit as abandoned (process id 0), so that this process too may finish it; best effort."""
    temporary = folder / staging_name / MARKER_NAME
    try:
        temporary.write_text(json.dumps({"staging": staging_name, "files": names, "pid": 0, "host": _host_id()}))
        _fsync(temporary)
        os.replace(temporary, folder / MARKER_NAME)
    except OSError:
        pass


def _read_marker(folder: pathlib.Path) -> dict | None:
    """The marker's content, with its mtime; `staging` None for a marker cut short while being written."""
    path = folder / MARKER_NAME
    try:
        text = path.read_text()
        mtime = path.stat().st_mtime
    except FileNotFoundError:
        return None
    try:
        content = json.loads(text)
        marker = {"staging": str(content["staging"]), "files": [str(name) for name in content["files"]],
                  "pid": int(content["pid"]), "host": str(content["host"]), "mtime": mtime}
    except (ValueError, KeyError, TypeError):
        marker = None
    # Only plain names inside the folder: the marker drives renames.
    names = [] if marker is None else [marker["staging"], *marker["files"]]
    plain = marker is not None and marker["staging"].startswith(STAGING_PREFIX) and all(
        pathlib.Path(name).name == name and name not in ("", ".", "..") for name in names)
    if not plain:
        return {"staging": None, "files": ["(unknown)"], "pid": -1, "host": "", "mtime": mtime}
    return marker


def _owner(marker: dict) -> str:
    """Names the process of a marker, and what to do if it is gone from another machine."""
    if marker["host"] == _host_id():
        return f"process {marker['pid']}"
    return (f"process {marker['pid']} of another machine; if that save was killed, run finish_interrupted_save on "
            "that machine")


def _remove_abandoned_staging(folder: pathlib.Path) -> None:
    """Removes the staging folders of saves that are over (killed: see the module docstring), but not the one
    an interrupted commit's marker names (`_finish` completes that)."""
    marker = _read_marker(folder)
    kept = None if marker is None else marker["staging"]
    for path in folder.glob(STAGING_PREFIX + "*"):
        if not path.is_dir() or path.name in (MARKER_NAME, kept):
            continue
        match = _STAGING_NAME.match(path.name)
        pid, host = (int(match.group(1)), match.group(2)) if match else (-1, "")
        try:
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            continue
        if _is_over(path, pid, host, mtime):
            shutil.rmtree(path, ignore_errors=True)


def _lock(staging: pathlib.Path) -> int | None:
    """Creates the staging folder's lock file, locked until the returned descriptor is closed; None where
    files cannot be locked (the folder is then judged by its process id)."""
    if fcntl is None:
        return None
    temporary = staging / (LOCK_NAME + ".new")
    descriptor = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # e.g. a file system without locks
        os.close(descriptor)
        temporary.unlink(missing_ok=True)
        return None
    # Renamed once locked: no other process ever finds the lock file free while this save runs.
    os.replace(temporary, staging / LOCK_NAME)
    return descriptor


def _lock_is_free(staging: pathlib.Path) -> bool | None:
    """Whether the lock of a staging folder is free (its save is over); None without a lock file to ask."""
    if fcntl is None:
        return None
    try:
        descriptor = os.open(staging / LOCK_NAME, os.O_RDONLY)
    except OSError:  # No lock file: the process id decides.
        return None
    try:
        # A shared lock conflicts with the save's exclusive one, and needs only read access (NFS too).
        fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:  # Locks unsupported here.
        return None
    finally:
        os.close(descriptor)  # also releases the lock just taken
    return True


def _is_over(staging: pathlib.Path, pid: int, host: str, mtime: float) -> bool:
    """Whether the save that owns `staging` has ended: from its lock, else from its process id and age."""
    free = _lock_is_free(staging)
    return _is_abandoned(pid, host, mtime) if free is None else free


def _is_abandoned(pid: int, host: str, mtime: float) -> bool:
    """Whether the save of process `pid` on `host` is over: the process is gone (0: it gave up), or it is old."""
    if pid == 0:
        return True
    # (On Windows, os.kill(pid, 0) would end the process.)
    if os.name == "posix" and host == _host_id() and pid > 0 and pid != os.getpid():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # Alive, owned by another user.
            pass
    return time.time() - mtime > ABANDONED_AFTER_SECONDS


def _host_id() -> str:
    """8 hex digits naming this machine, to tell whether a process id can be checked here."""
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _fsync(path: pathlib.Path) -> None:
    """Flushes a file, or a folder's entries (POSIX only), to disk."""
    if path.is_dir() and os.name != "posix":
        return
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _as_os_error(error: BaseException) -> OSError | None:
    """The OSError behind `error`: itself, or one that safetensors / tokenizers report as '(os error N)'."""
    if isinstance(error, OSError):
        return error
    match = _RUST_OS_ERROR.search(str(error)) if isinstance(error, Exception) else None
    if match is None:
        return None
    number = int(match.group(1))
    return OSError(number, os.strerror(number))


def _named(error: OSError, message: str, advice: str = "") -> OSError:
    """An OSError of the same type and errno saying `message: <the OS's reason>. advice`."""
    reason = error.strerror or str(error)
    named = type(error)(f"{message}: {reason}. {advice}".rstrip())
    named.errno = error.errno
    return named


def _unrecoverable_message(folder: pathlib.Path, files: list[str]) -> str:
    """Explains a marker whose staging folder is gone."""
    return (f"An earlier save into '{folder}' was interrupted while it replaced {', '.join(files)}, and cannot be "
            f"finished: its staging folder is gone, so these files may mix two saves. Save them again with "
            f"overwrite=True (a save that writes all of them replaces the interrupted one), or delete "
            f"'{folder / MARKER_NAME}' if you know they belong together.")

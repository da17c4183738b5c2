"""Building the native kernel library into its cache folder, and opening a cached build only if it is safe.

The kernels are compiled for one instruction set at a time (`ISAS`): AVX-512 or AVX2 with FMA, the one the
CPU runs (`host_isa`) unless asked for another. Each has its own library in the cache, named by the
instruction set and a hash of the sources and flags.

A shared library runs code as the process that loads it, so a cached build is loaded only when nobody but
this user can have written it, and only the exact bytes recorded when it was built:

- The folder is `$XLAGEN_CACHE/native` (default `~/.cache/xlagen/native`), created with mode 0o700. An
  existing folder must belong to this user (else it is refused: `NativeUnavailable` naming it); if it is
  writable by group or others (an earlier xlagen made it under umask 002), it is made 0o700 with a warning.
  Every later step works relative to the folder's open descriptor, not its path.
- A build compiles into a fresh private folder inside it (0o700), sets the library to 0o700 whatever the
  umask, fsyncs it, hashes it, writes the SHA-256 to `<library>.sha256` (0o600, `sha256sum -c` format,
  fsynced) and renames both into place, each rename atomic. Builders are serialized by an advisory lock on
  the folder (`flock`), so two processes starting at once compile once; the second takes the first's build.
- A cached library is used only if it and its record are regular files (opened with O_NOFOLLOW, so not
  symbolic links; O_NONBLOCK, so a FIFO cannot hang the open), belong to this user and are not writable by
  group or others, and the bytes read from the open library hash to the record. Otherwise (missing,
  empty, corrupt, replaced, another user's, a link) it is built again over it, then one warning names the
  file and the reason; if it cannot be built, `NativeUnavailable` says both (and nothing is logged).
- The caller `dlopen`s the verified descriptor itself, as `/proc/self/fd/N` (`opened`): the file hashed
  is the file loaded, whatever happens to the folder's names meanwhile, and only this user (or root) could
  change its bytes, since it is this user's and not writable by others. (glibc's dlopen treats two loads of
  the same `/proc/self/fd/N` name as one library; xlagen loads once per process.)
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import logging
import os
import secrets
import shutil
import stat
import subprocess
from collections.abc import Iterable, Iterator
from pathlib import Path

SOURCES = Path(__file__).parent  # the C++ kernels: every *.cc, compiled into one library, and the *.h
FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-pthread")  # and the instruction set's (ISAS)
# The instruction sets the kernels are written for (simd.h), the most capable first: the compiler flags of
# each and the /proc/cpuinfo flags a CPU needs to run its build.
ISAS = {
    # AVX-512 with VNNI and AMX's int8 and bfloat16 tiles: the many-row int8 x int8 product and bfloat16
    # weights' many-row product in tiles of 16 x 16 sums (packed_product.cc)
    "avx512amx": {"flags": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx512bf16", "-mfma",
                            "-mamx-tile", "-mamx-int8", "-mamx-bf16"),
                  "cpu": ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8",
                          "amx_bf16")},
    # AVX-512 with VNNI: the int8 x int8 product sums 4 byte products into int32 in one instruction (simd.h)
    "avx512vnni": {"flags": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma"),
                   "cpu": ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")},
    "avx512": {"flags": ("-mavx512f", "-mfma"), "cpu": ("avx512f",)},
    "avx2": {"flags": ("-mavx2", "-mfma"), "cpu": ("avx2", "fma")},
}
RECORD_SUFFIX = ".sha256"  # beside the library: its SHA-256, written when it was built
NO_COMPILER = ("xlagen's native kernels need a C++ compiler to build them once (set CXX, or install g++, "
               "e.g. `apt-get install g++`)")
_MAX_RECORD_BYTES = 4096

logger = logging.getLogger(__name__)


class NativeUnavailable(RuntimeError):
    """The native kernels cannot run on this machine; the message says why."""


class BuildFailed(NativeUnavailable):
    """The compiler ran and refused the kernels' sources or flags (an older compiler may not know an
    instruction set's flags, e.g. AMX's before GCC 11); the message has its output."""


class _Unusable(Exception):
    """Why a cached library must not be loaded, and how loudly to say so when building it again (a logging
    level; 0 for a library not built yet)."""

    def __init__(self, reason: str, level: int = logging.WARNING):
        super().__init__(reason)
        self.level = level


def _compiler() -> str | None:
    for candidate in (os.environ.get("CXX"), "g++", "c++"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    return None


def choose_isa(cpu_flags: Iterable[str]) -> str | None:
    """The instruction set of `ISAS` whose kernels a CPU with these /proc/cpuinfo flags runs: "avx512amx"
    with avx512f, avx512bw, avx512vl, avx512_vnni, avx512_bf16, amx_tile, amx_int8 and amx_bf16, else
    "avx512vnni" with the first four,
    else "avx512" with avx512f, else "avx2" with avx2 and fma; None with neither."""
    flags = set(cpu_flags)
    return next((isa for isa, needs in ISAS.items() if flags.issuperset(needs["cpu"])), None)


def supported_isas(flags: Iterable[str] | None = None) -> tuple[str, ...]:
    """Every instruction set of `ISAS` whose build a CPU with these /proc/cpuinfo flags runs (default: this
    CPU's), the most capable (`choose_isa`'s) first: an AMX CPU runs all four builds, an AVX2 one only "avx2"."""
    available = set(cpu_flags() if flags is None else flags)
    return tuple(isa for isa, needs in ISAS.items() if available.issuperset(needs["cpu"]))


def cpu_flags() -> frozenset[str]:
    """This CPU's flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(next((line.split(":", 1)[1].split() for line in text.splitlines()
                           if line.startswith("flags")), []))


def host_isa() -> str | None:
    """The instruction set this CPU runs the kernels with (`choose_isa` of its flags), or None."""
    return choose_isa(cpu_flags())


def tiles_granted() -> bool:
    """Whether this CPU has AMX's int8 and bfloat16 tiles (the "avx512amx" build) and Linux grants this
    process their register state (arch_prctl ARCH_REQ_XCOMP_PERM, Linux 5.16 and later; asking again is
    harmless). Loads nothing."""
    if host_isa() != "avx512amx":
        return False
    request_permission, tile_data, sys_arch_prctl = 0x1023, 18, 158  # asm/prctl.h, x86-64's syscall number
    return ctypes.CDLL(None).syscall(sys_arch_prctl, request_permission, tile_data) == 0


def _isa(isa: str | None) -> str:
    """`isa` checked, or this CPU's when None.

    Raises:
        ValueError: not one of `ISAS`.
        NativeUnavailable: None, and this CPU runs none of them.
    """
    if isa is None:
        isa = host_isa()
        if isa is None:
            raise NativeUnavailable("xlagen's native kernels need a CPU with AVX-512 (avx512f) or AVX2 and FMA "
                                    "(avx2, fma); this CPU reports neither")
    if isa not in ISAS:
        raise ValueError(f"isa must be one of {', '.join(ISAS)}, got {isa!r}")
    return isa


def cache_folder() -> Path:
    """The folder of cached builds: `$XLAGEN_CACHE/native`, default `~/.cache/xlagen/native`."""
    root = os.environ.get("XLAGEN_CACHE") or Path.home() / ".cache" / "xlagen"
    return Path(root) / "native"


def _flags(isa: str) -> tuple[str, ...]:
    return (*FLAGS, *ISAS[isa]["flags"])


def library_name(sources: Path = SOURCES, isa: str | None = None) -> str:
    """The cached library's file name for the kernel sources in `sources` built for `isa` (None: this CPU's):
    the instruction set and a hash of the sources' names and texts (every *.cc and *.h) and of the flags.

    Raises:
        ValueError, NativeUnavailable: as `compile_library`, before anything is built.
    """
    isa = _isa(isa)
    files = sorted(p for p in sources.iterdir() if p.suffix in (".cc", ".h"))
    text = b"".join(p.name.encode() + b"\0" + p.read_bytes() for p in files)
    key = hashlib.sha256(text + " ".join(_flags(isa)).encode()).hexdigest()[:16]
    return f"kernels-{isa}-{key}.so"


def compile_library(sources: Path, library: Path, isa: str | None = None) -> None:
    """Compiles the kernel sources in the folder `sources` (xlagen's, `SOURCES`, or a variant of them for
    `benchmarks/kernel_variants.py`: every *.cc, with the *.h beside them) into the shared library `library`
    with xlagen's flags for the instruction set `isa` (one of `ISAS`; None: this CPU's). Any of them builds
    on any x86-64 machine; only a CPU that has it can run it.

    Raises:
        ValueError: isa is not one of `ISAS`.
        NativeUnavailable: isa is None and this CPU runs none of them, no compiler, or the compiler failed
            (its message is included).
    """
    isa = _isa(isa)
    compiler = _compiler()
    if compiler is None:
        raise NativeUnavailable(NO_COMPILER)
    files = sorted(str(path) for path in Path(sources).glob("*.cc"))
    command = [compiler, *_flags(isa), *files, "-o", str(library), "-ldl"]
    try:
        result = subprocess.run(command, capture_output=True, text=True)
    except OSError as error:
        raise NativeUnavailable(f"running the C++ compiler failed ({' '.join(command)}): {error}") from error
    if result.returncode != 0:
        raise BuildFailed(f"building xlagen's native kernels failed ({' '.join(command)}):\n"
                                f"{result.stderr[-2000:]}")


def build(sources: Path = SOURCES, isa: str | None = None) -> Path:
    """Builds the kernel sources in `sources` for `isa` (None: this CPU's) into the cache folder unless a
    verified build is there; returns the library's path.

    Raises:
        ValueError: isa is not one of `ISAS`.
        NativeUnavailable: isa is None and this CPU runs none of them, the folder is unsafe or not writable, or
            the build failed (the message says which and what to do).
    """
    with opened(sources, isa):
        pass
    return cache_folder() / library_name(sources, isa)


@contextlib.contextmanager
def opened(sources: Path = SOURCES, isa: str | None = None) -> Iterator[str]:
    """Yields a path for `ctypes.CDLL` (`/proc/self/fd/N`) naming the verified cached build of `sources` for
    `isa` (None: this CPU's), built first if needed; valid within the block.

    Raises:
        ValueError, NativeUnavailable: as `build`.
    """
    fd = _library_descriptor(sources, _isa(isa))
    try:
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def _library_descriptor(sources: Path, isa: str) -> int:
    """An open descriptor of the verified cached build of `sources` for `isa` (built first if needed)."""
    folder, name = cache_folder(), library_name(sources, isa)
    folder_fd = _open_folder(folder)
    try:
        with contextlib.suppress(_Unusable):
            return _open_verified(folder_fd, name)
        with _locked(folder_fd):
            try:  # another process may have built it while this one waited for the lock
                return _open_verified(folder_fd, name)
            except _Unusable as problem:
                return _build_into(folder_fd, folder, name, sources, isa, problem)
    except OSError as error:  # reading or cleaning up (the steps that can be fixed say so themselves)
        raise NativeUnavailable(f"using the kernel cache folder {folder} failed ({error}); set XLAGEN_CACHE to "
                                "another folder of yours") from error
    finally:
        os.close(folder_fd)


def _open_folder(folder: Path) -> int:
    """Creates (0o700) and opens the cache folder, checking that it is this user's and private."""
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as error:
        raise NativeUnavailable(f"cannot create or open the kernel cache folder {folder} ({error}); set "
                                "XLAGEN_CACHE to a folder of yours") from error
    try:
        status = os.fstat(fd)
        if status.st_uid != os.geteuid():
            raise NativeUnavailable(
                f"the kernel cache folder {folder} belongs to user id {status.st_uid}, not to this user "
                f"({os.geteuid()}): a library placed there would run as you. Use a folder of your own: set "
                "XLAGEN_CACHE, or fix the folder's owner and permissions (chown, chmod 700)")
        if status.st_mode & 0o022:
            try:
                os.fchmod(fd, 0o700)
            except OSError as error:
                raise NativeUnavailable(
                    f"the kernel cache folder {folder} is writable by others (mode {status.st_mode & 0o777:o}) "
                    f"and cannot be made private ({error}); run `chmod 700 {folder}` or set XLAGEN_CACHE") \
                    from error
            logger.warning("the kernel cache folder %s was writable by others (mode %o); made it 0o700",
                           folder, status.st_mode & 0o777)
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def _locked(folder_fd: int) -> Iterator[None]:
    """Holds an exclusive advisory lock on the folder: one builder at a time (safety does not rely on it)."""
    import fcntl  # POSIX only, like the rest of this module; imported here so that importing it works anywhere

    try:
        fcntl.flock(folder_fd, fcntl.LOCK_EX)
    except OSError as error:  # e.g. a file system without flock: builders may then compile twice
        logger.debug("building without a lock on the kernel cache folder: %s", error)
        yield
        return
    try:
        yield
    finally:
        fcntl.flock(folder_fd, fcntl.LOCK_UN)


def _open_owned(name: str, folder_fd: int) -> int:
    """Opens `name` in the folder for reading if it is a regular file (not a link) of this user."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder_fd)
    except FileNotFoundError as error:
        raise _Unusable("is missing", level=0) from error
    except OSError as error:
        reason = "is a symbolic link" if error.errno == errno.ELOOP else f"cannot be opened ({error})"
        raise _Unusable(reason) from error
    status = os.fstat(fd)
    if not stat.S_ISREG(status.st_mode) or status.st_uid != os.geteuid():
        os.close(fd)
        if not stat.S_ISREG(status.st_mode):
            raise _Unusable("is not a regular file")
        raise _Unusable(f"belongs to user id {status.st_uid}, not to this user ({os.geteuid()})")
    return fd


def _open_private(name: str, folder_fd: int) -> int:
    """`_open_owned`, and only this user may write the file."""
    fd = _open_owned(name, folder_fd)
    mode = os.fstat(fd).st_mode
    if mode & 0o022:
        os.close(fd)
        raise _Unusable(f"is writable by others (mode {mode & 0o777:o})")
    return fd


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def _open_verified(folder_fd: int, name: str) -> int:
    """A descriptor of library `name`, private, whose bytes hash to its private record; else `_Unusable`."""
    fd = _open_private(name, folder_fd)
    try:
        data = _read_all(fd)
        if not data:
            raise _Unusable("is empty (0 bytes)")
        try:
            record_fd = _open_private(name + RECORD_SUFFIX, folder_fd)
        except _Unusable as problem:  # a missing record: a build of an earlier xlagen, or an interrupted one
            raise _Unusable(f"has no usable SHA-256 record ({name + RECORD_SUFFIX} {problem})",
                            level=logging.WARNING if problem.level else logging.INFO) from problem
        try:
            record = os.read(record_fd, _MAX_RECORD_BYTES).split()
        finally:
            os.close(record_fd)
        if not record or hashlib.sha256(data).hexdigest() != record[0].decode("ascii", "replace"):
            raise _Unusable(f"does not match the SHA-256 recorded in {name + RECORD_SUFFIX} when it was built "
                            "(corrupt or replaced)")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _build_into(folder_fd: int, folder: Path, name: str, sources: Path, isa: str, problem: _Unusable) -> int:
    """Compiles the kernel sources privately, records the library's hash, renames both into place; returns the
    build's descriptor.
    Says why the cached library (`problem`) was not used once: logged after a build, else in the error."""
    try:
        fd = _build_privately(folder_fd, folder, name, sources, isa)
    except NativeUnavailable as error:
        if not problem.level:
            raise
        raise NativeUnavailable(f"{error}; and the cached {folder / name} {problem}") from error
    if problem.level:
        logger.log(problem.level, "the cached kernel library %s %s; built it again", folder / name, problem)
    return fd


def _build_privately(folder_fd: int, folder: Path, name: str, sources: Path, isa: str) -> int:
    """Compiles the kernel sources in a scratch folder of its own and installs the result (`_install`)."""
    scratch = f".{name}.{secrets.token_hex(8)}"
    try:
        os.mkdir(scratch, 0o700, dir_fd=folder_fd)
        scratch_fd = os.open(scratch, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder_fd)
    except OSError as error:
        raise NativeUnavailable(f"cannot write in the kernel cache folder {folder} ({error}); set XLAGEN_CACHE "
                                "to a writable folder of yours") from error
    try:
        compile_library(sources, folder / scratch / name, isa)
        return _install(folder_fd, scratch_fd, folder, name)
    finally:
        for entry in os.listdir(scratch_fd):
            with contextlib.suppress(OSError):
                os.unlink(entry, dir_fd=scratch_fd)
        os.close(scratch_fd)
        with contextlib.suppress(OSError):
            os.rmdir(scratch, dir_fd=folder_fd)


def _install(folder_fd: int, scratch_fd: int, folder: Path, name: str) -> int:
    """Makes the compiler's output in the scratch folder private and durable, records its SHA-256 and renames
    both into the cache folder; returns the library's descriptor."""
    try:
        fd = _open_owned(name, scratch_fd)
    except _Unusable as problem:
        raise NativeUnavailable(f"the compiler's output ({name}, in a build folder inside {folder}) {problem}") \
            from problem
    try:
        os.fchmod(fd, 0o700)  # the linker's mode follows the umask (0o775 under umask 002)
        os.fsync(fd)
        digest = hashlib.sha256(_read_all(fd)).hexdigest()
        record_fd = os.open(name + RECORD_SUFFIX, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                            0o600, dir_fd=scratch_fd)
        try:
            os.fchmod(record_fd, 0o600)
            os.write(record_fd, f"{digest}  {name}\n".encode())
            os.fsync(record_fd)
        finally:
            os.close(record_fd)
        # The library first: a reader between the two renames sees a mismatch and waits for the lock.
        for entry in (name, name + RECORD_SUFFIX):
            os.replace(entry, entry, src_dir_fd=scratch_fd, dst_dir_fd=folder_fd)
        os.fsync(folder_fd)
    except OSError as error:
        os.close(fd)
        raise NativeUnavailable(f"cannot install the kernel library in {folder} ({error}); set XLAGEN_CACHE to a "
                                "writable folder of yours") from error
    except BaseException:
        os.close(fd)
        raise
    return fd

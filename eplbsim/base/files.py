"""The files a command reads and writes, handled so that no input is ever lost.

- Only regular files (or links to them) are read: a FIFO, a device or a directory where a file
  is expected is an InputError, never a read that blocks.
- An output never names an input (through any link), never lies inside an input directory,
  and a directory that is replaced whole never holds an input (`check_output`).
- Every write goes to a temporary sibling that is renamed into place only once complete
  (`atomic_file`, `atomic_dir`): a failure leaves whatever was there as it was. What is written
  has the mode `open` and `mkdir` would give it (the umask's), not a temporary file's 0600.
- Sizes are checked before they are allocated (`check_memory`): over the memory this machine
  has available (or the cap `EPLBSIM_MAX_MEMORY`, in bytes with an optional K/M/G/T suffix),
  an InputError names the size and what to change.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import tokenize
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator

import numpy as np

from .errors import InputError

MEMORY_CAP = "EPLBSIM_MAX_MEMORY"
NPY_HEADER = 1 << 20  # bytes of an .npy header read (numpy's default, 10,000, refuses valid ones)


def npy_refusal(exc: BaseException) -> str:
    """Why numpy would not load an array, in words that never advise an unsafe load: numpy's
    own messages suggest `allow_pickle=True` both for object arrays and for long headers."""
    text = str(exc)
    if "max_header_size" in text:
        return f"its .npy header is longer than the {NPY_HEADER} bytes eplbsim reads"
    if "pickle" in text:
        return "it holds Python objects, which eplbsim never unpickles"
    return text
# what numpy's .npy header parser raises on a header it cannot read (the header is Python literal
# text): `npy_header`'s failures
NPY_HEADER_ERRORS = (OSError, ValueError, EOFError, SyntaxError, TypeError, tokenize.TokenError,
                     MemoryError, RecursionError)


def npy_header(f: BinaryIO) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """The shape, Fortran order and dtype the .npy header at `f`'s position declares (format
    1.0 or 2.0, at most `NPY_HEADER` bytes), and the bytes of data they take; `f` is left at
    the data. One of `NPY_HEADER_ERRORS` when it is no such header (`npy_refusal` words it)."""
    version = np.lib.format.read_magic(f)
    read = {(1, 0): np.lib.format.read_array_header_1_0,
            (2, 0): np.lib.format.read_array_header_2_0}.get(version)
    if read is None:
        raise ValueError(f"unsupported .npy format version {version}")
    shape, fortran, dtype = read(f, max_header_size=NPY_HEADER)
    return shape, fortran, dtype, dtype.itemsize * int(np.prod(shape, dtype=object))


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def regular_file(path: str | os.PathLike, what: str = "file") -> Path:
    """`path` if it is a regular file (a link to one is fine); InputError otherwise, without
    opening it (so a FIFO cannot block)."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise InputError(f"{path}: {kind}; expected a {what}")
    return path


def _inside(child: Path, parent: Path) -> bool:
    return child != parent and parent in child.parents


def check_output(out: str | os.PathLike, inputs: Iterable[str | os.PathLike | None],
                 is_dir: bool = False, replaces: bool = False) -> Path:
    """`out` if writing it cannot touch any of `inputs` (module doc); InputError otherwise.

    is_dir:   `out` is a directory that files are written into (it must not be a file)
    replaces: `out` is written anew as a whole, so it must not hold an input either
    Also refuses an `out` under a path that is not a directory."""
    out = Path(out)
    real = Path(os.path.realpath(out))
    for given in inputs:
        if given is None:
            continue
        source = Path(os.path.realpath(given))
        if real == source:
            raise InputError(f"{out}: is also an input; write the output somewhere else")
        if source.is_dir() and _inside(real, source):
            raise InputError(f"{out}: lies inside the input directory {given}; write the output "
                             f"somewhere else")
        if replaces and _inside(source, real):
            raise InputError(f"{out}: holds the input {given}, and writing it replaces the "
                             f"directory; write the output somewhere else")
    for parent in real.parents:
        if parent.exists():
            if not parent.is_dir():
                raise InputError(f"cannot write {out}: {parent} is not a directory")
            break
    if is_dir and real.exists() and not real.is_dir():
        raise InputError(f"cannot write into {out}: it is a file, not a directory")
    if not is_dir and not replaces and real.is_dir():
        raise InputError(f"cannot write {out}: it is a directory")
    return out


def _umask() -> int:
    """The process's file mode creation mask (read by setting it, then setting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary sibling of `path` to write; renamed to `path` when the block completes,
    removed when it raises. OSErrors become InputError("cannot write PATH: why")."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
        os.close(fd)
    except OSError as exc:
        raise InputError(f"cannot write {path}: {exc.strerror or exc}") from None
    tmp = Path(name)
    try:
        tmp.chmod(0o666 & ~_umask())
        yield tmp
        os.replace(tmp, path)
    except OSError as exc:
        raise InputError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary sibling directory of `path` to fill; it replaces `path` (whatever was there)
    when the block completes, and is removed when it raises."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent))
    except OSError as exc:
        raise InputError(f"cannot write {path}: {exc.strerror or exc}") from None
    try:
        tmp.chmod(0o777 & ~_umask())
        yield tmp
        old = None
        if path.exists() or path.is_symlink():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
            os.replace(path, old / "was")
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as exc:
        raise InputError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _parse_bytes(text: str) -> int:
    number, unit = text.strip().upper().rstrip("B"), ""
    if number and number[-1] in _UNITS:
        number, unit = number[:-1], number[-1]
    try:
        return int(float(number) * _UNITS[unit])
    except ValueError:
        raise InputError(f"{MEMORY_CAP}={text!r}: expected a size such as 8G") from None


def available_memory() -> int:
    """Bytes a command may allocate: `EPLBSIM_MAX_MEMORY` when set, else what the machine has
    available (Linux's MemAvailable; else free pages)."""
    if os.environ.get(MEMORY_CAP):
        return _parse_bytes(os.environ[MEMORY_CAP])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def size_text(nbytes: float) -> str:
    """`1536` -> "1.5 KiB"; beyond 1024 PiB, "3.1e+300 bytes"."""
    if abs(nbytes) >= 1024 ** 6:
        return f"{nbytes:.2g} bytes"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(nbytes) < 1024 or unit == "PiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def check_memory(nbytes: float, what: str, change: str) -> None:
    """InputError when `what` needs more than `available_memory()`: the message gives the
    size and `change`, what to change to fit."""
    limit = available_memory()
    if nbytes > limit:
        raise InputError(f"{what} needs about {size_text(nbytes)}, more than the "
                         f"{size_text(limit)} available ({MEMORY_CAP} sets a cap); {change}")

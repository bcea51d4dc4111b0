"""The decode step's projections (and its RMSNorms) through small AVX2 kernels of our own
(native_linear.c).

Why: at batch 1 a decode step reads every weight once, so its projections are bound by
memory bandwidth. On the 2-core AMD EPYC this project benchmarks on, reading SmolLM2's
121 projections and its output head (513 MiB, float32) side by side in one run:

    a plain sum over the same bytes   19.6 ms   27.4 GB/s   (the floor)
    oneDNN on packed weights          30.3 ms   17.8 GB/s   (what PackedLinear did)
    MKL (x @ W, input-major)          35.4 ms   15.2 GB/s
    this kernel, 2 threads            23.9 ms   22.5 GB/s

oneDNN stays for steps with more rows (prefill, large batches), where the work is
compute-bound and its blocked GEMM wins; PackedLinear chooses per call by row count
(NATIVE_MAX_ROWS).

The library is compiled once per machine with the system C compiler (`cc`, else `gcc`)
and -march=native, into a cache directory keyed by the source, the flags and the CPU, and
loaded with ctypes (which releases the GIL for the call). Where it cannot be built (no
compiler, no AVX2/FMA, not Linux), `native_linear_problem()` says why and the engine
uses oneDNN alone.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("native_linear.c")
# Compiled together into one library; the header is part of the cache key.
SOURCES = (SOURCE, SOURCE.with_name("native_decode.c"))
HEADERS = (SOURCE.with_name("native_gemv.h"),)
_FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-fopenmp")
_P = ctypes.c_void_p
_I = ctypes.c_int


def cache_dir() -> Path:
    """Where built libraries are kept: $KVSERVE_CACHE_DIR, else $XDG_CACHE_HOME/kvserve,
    else ~/.cache/kvserve (read when called, never at import)."""
    if os.environ.get("KVSERVE_CACHE_DIR"):
        return Path(os.environ["KVSERVE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvserve"


def _cpu_identity() -> str:
    """The CPU model and flags: -march=native code is only valid on the CPU it was built for,
    and a home directory can be shared by nodes of different kinds."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = [line for line in lines if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(wanted)))


def _compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


def _torch_libgomp() -> Path | None:
    """The OpenMP runtime torch's CPU kernels run on. The kernel links against this very
    file, so its threads are torch's threads (see native_linear.c)."""
    found = sorted((Path(torch.__file__).parent / "lib").glob("libgomp*.so*"))
    return found[0] if found else None


class NativeLinear:
    """The loaded library: `linear()` computes x @ W.T (+ bias) (+ residual)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        self._lib.kvs_linear.argtypes = [_P, _P, _P, _P, _P, _I, _I, _I, _I]
        self._lib.kvs_linear.restype = None
        self._lib.kvs_rms_norm.argtypes = [_P, _P, ctypes.c_float, _P, _I, _I]
        self._lib.kvs_rms_norm.restype = None
        # The whole-step decode (native_decode.py wraps it).
        self._lib.kvs_decode.argtypes = [_P, _P, _I, _I, _P, _P, _P, _P, _P, _I, _I, _I, _P]
        self._lib.kvs_decode.restype = _I
        self.decode = self._lib.kvs_decode
        self._lib.kvs_sum.argtypes = [_P, ctypes.c_long, _I]
        self._lib.kvs_sum.restype = ctypes.c_double

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [T, in] @ W [out, in].T (+ bias [out]) (+ residual [T, out]) -> [T, out], where
        weight is W in the kernel's blocked layout (`blocked(W)`).

        Every tensor is float32 on CPU; weight and bias must be contiguous (the caller
        owns them and keeps them alive); x and residual are made contiguous here. As many
        threads share the call as torch's own ops use (torch.get_num_threads())."""
        rows, in_features = x.shape
        out_features = weight.shape[0]
        x = x.contiguous()
        y = torch.empty(rows, out_features, dtype=torch.float32)  # [T, out]
        if residual is not None:
            residual = residual.contiguous()
        self._lib.kvs_linear(
            x.data_ptr(),
            weight.data_ptr(),
            None if bias is None else bias.data_ptr(),
            None if residual is None else residual.data_ptr(),
            y.data_ptr(),
            rows,
            in_features,
            out_features,
            torch.get_num_threads(),
        )
        return y

    def sum(self, x: torch.Tensor) -> float:
        """The sum of a contiguous float32 CPU tensor, read once on torch's thread count: a
        plain streaming read (bench-decode's bandwidth floor)."""
        if not x.is_contiguous() or x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError("sum needs a contiguous float32 CPU tensor")
        return float(self._lib.kvs_sum(x.data_ptr(), x.numel(), torch.get_num_threads()))

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [T, n] / sqrt(mean(x^2) + eps) * weight [n] -> [T, n], float32 on CPU; weight
        contiguous (RMSNorm.kernel's signature)."""
        x = x.contiguous()
        y = torch.empty_like(x)  # [T, n]
        self._lib.kvs_rms_norm(x.data_ptr(), weight.data_ptr(), eps, y.data_ptr(), x.shape[0], x.shape[1])
        return y


def blocked(weight: torch.Tensor) -> torch.Tensor:
    """W [out, in] in the layout the kernels read (native_gemv.h): a new contiguous
    [out, in] tensor in which each block of 4 rows interleaves the rows' 8-float chunks
    (then the rows' tails past a multiple of 8), and the rows past the last whole block
    stay as they are. Same values, same size; `unblocked` undoes it."""
    out_features, in_features = weight.shape
    whole, vec = out_features - out_features % 4, in_features - in_features % 8
    result = weight.detach().to(torch.float32).contiguous().clone()
    blocks = weight[:whole].reshape(whole // 4, 4, in_features)  # [blocks, 4, in]
    chunks = blocks[:, :, :vec].reshape(whole // 4, 4, vec // 8, 8).transpose(1, 2)  # [blocks, vec/8, 4, 8]
    tails = blocks[:, :, vec:]  # [blocks, 4, in - vec]
    flat = torch.cat([chunks.reshape(whole // 4, 4 * vec), tails.reshape(whole // 4, 4 * (in_features - vec))], dim=1)
    result[:whole] = flat.reshape(whole, in_features)
    return result


def unblocked(packed: torch.Tensor) -> torch.Tensor:
    """The row-major W [out, in] of a `blocked` tensor."""
    out_features, in_features = packed.shape
    whole, vec = out_features - out_features % 4, in_features - in_features % 8
    result = packed.clone()
    flat = packed[:whole].reshape(whole // 4, 4 * in_features)
    chunks = flat[:, : 4 * vec].reshape(whole // 4, vec // 8, 4, 8).transpose(1, 2).reshape(whole // 4, 4, vec)
    tails = flat[:, 4 * vec:].reshape(whole // 4, 4, in_features - vec)
    result[:whole] = torch.cat([chunks, tails], dim=2).reshape(whole, in_features)
    return result


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def huge_page_tensor(numel: int) -> torch.Tensor:
    """A fresh float32 [numel] CPU tensor whose memory the kernel is asked to back with 2 MiB
    pages (madvise MADV_HUGEPAGE; transparent huge pages are "madvise" on most distributions).

    Why: the weights are streamed once per step, and with 4 KiB pages each page of a
    576-wide row block costs a TLB miss. Over SmolLM2's projections and head, two copies
    of the same weights read in turn on 2 threads: 19.6 against 21.0 ms and 18.1 against
    19.8 ms for a batch-1 step's projections, 5.0 against 5.5 ms for the head. Where
    madvise is refused the tensor is the same, on small pages."""
    pad = _HUGE_PAGE // 4
    storage = torch.empty(numel + pad, dtype=torch.float32)
    address = storage.data_ptr()
    start = -(-address // _HUGE_PAGE) * _HUGE_PAGE  # the first 2 MiB boundary in it
    offset = (start - address) // 4
    length = (numel * 4) // _HUGE_PAGE * _HUGE_PAGE
    if length:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise(start, length, _MADV_HUGEPAGE)  # best effort: the pages are just small otherwise
    return storage[offset: offset + numel]


def native_linear_problem() -> str | None:
    """Why the kernel cannot be used here, or None when it can (it is then built)."""
    return _load()[1]


def native_linear() -> NativeLinear:
    """The built and loaded kernel; ValueError naming the reason where there is none."""
    kernel, problem = _load()
    if kernel is None:
        raise ValueError(f"the native linear kernel cannot be used here: {problem}")
    return kernel


@functools.cache
def _load() -> tuple[NativeLinear | None, str | None]:
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, f"it is x86-64 Linux only, this is {sys.platform} on {platform.machine()}"
    identity = _cpu_identity()
    if " avx2" not in identity or " fma" not in identity:
        return None, "this CPU has no AVX2 and FMA"
    compiler = _compiler()
    if compiler is None:
        return None, "no C compiler (cc or gcc) on PATH"
    libgomp = _torch_libgomp()
    if libgomp is None:
        return None, f"torch has no libgomp of its own in {Path(torch.__file__).parent / 'lib'}"
    sources = b"\0".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    key = hashlib.sha256(b"\0".join([sources, " ".join(_FLAGS).encode(), identity.encode(), compiler.encode(),
                                      str(libgomp).encode()]))
    target = cache_dir() / "native" / f"native_linear-{key.hexdigest()[:20]}.so"
    if not target.exists():
        problem = _build(compiler, libgomp, target)
        if problem is not None:
            return None, problem
    try:
        return NativeLinear(target), None
    except OSError as error:
        return None, f"{target} does not load: {error}"


def _build(compiler: str, libgomp: Path, target: Path) -> str | None:
    """Compile into a temporary file and rename it into place, so processes that build at
    once never load a half-written library."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
        os.close(fd)
    except OSError as error:
        return f"cannot write {target.parent}: {error}"
    try:
        # Naming torch's libgomp by path (its directory as rpath) makes the library's
        # NEEDED entry that file's soname, which the loader finds already loaded by torch.
        link = [str(libgomp), f"-Wl,-rpath,{libgomp.parent}", "-lm"]
        done = subprocess.run([compiler, *_FLAGS, "-o", tmp, *map(str, SOURCES), *link], capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            return f"{compiler} failed on {', '.join(p.name for p in SOURCES)}: {done.stderr.strip()[-400:]}"
        os.replace(tmp, target)
        print(f"[kvserve] built the native kernels: {target}", file=sys.stderr)
        return None
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"{compiler} could not build {', '.join(p.name for p in SOURCES)}: {error}"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)

"""Byte planes joined into elements by a loop compiled in this process with llvmlite (pure, no I/O).

Why: joining a chunk's planes (planes.decode_grouped) is the largest part of reading a
byte-grouped chunk after its zstd frames: numpy needs a widening copy and a shift and an OR per
plane, each a pass over the chunk, 0.3-0.55 ms per MB of fp32 elements in a checkout; one
vectorised pass does it in 0.05. numba compiles the same loop (context_kernels.join4), but its
import and the loading of its cached kernels cost 0.85-1.0 s of CPU in a fresh process, more
than a checkout of a few hundred MB spends joining. llvmlite, which numba is built on, is
imported and the loop compiled in ~55 ms of CPU (measured: import 35 ms, compile 20 ms), from
the IR text below: nothing is cached on disk, so nothing is loaded that another user could have
written (compare runtime/kernel_cache.py).

The loop only reads ``n`` bytes of each plane and writes ``width * n`` bytes of its output; the
caller (``join``) checks every length and that the arrays are contiguous before calling it.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

WIDTHS = (2, 4, 8)
Kernel = Callable[..., None]


def _ir(width: int) -> str:
    """LLVM IR of ``join{width}(p0, ..., out, n)``: out[k] = p0[k] | p1[k] << 8 | ... (little-endian)."""
    bits = 8 * width
    params = ", ".join(f"i8* noalias nocapture readonly %p{j}" for j in range(width))
    body = []
    for j in range(width):
        body += [
            f"  %a{j} = getelementptr inbounds i8, i8* %p{j}, i64 %k",
            f"  %b{j} = load i8, i8* %a{j}, align 1",
            f"  %z{j} = zext i8 %b{j} to i{bits}",
        ]
        if j:
            body += [f"  %s{j} = shl i{bits} %z{j}, {8 * j}", f"  %o{j} = or i{bits} %o{j - 1}, %s{j}"]
        else:
            body.append(f"  %o0 = or i{bits} %z0, 0")
    return "\n".join(
        [
            f"define void @join{width}({params}, i{bits}* noalias nocapture %out, i64 %n) nounwind {{",
            "entry:",
            "  %empty = icmp eq i64 %n, 0",
            "  br i1 %empty, label %done, label %loop",
            "loop:",
            "  %k = phi i64 [0, %entry], [%k1, %loop]",
            *body,
            f"  %d = getelementptr inbounds i{bits}, i{bits}* %out, i64 %k",
            f"  store i{bits} %o{width - 1}, i{bits}* %d, align 1",
            "  %k1 = add nuw i64 %k, 1",
            "  %end = icmp eq i64 %k1, %n",
            "  br i1 %end, label %done, label %loop",
            "done:",
            "  ret void",
            "}",
        ]
    )


def _optimise(llvm: Any, module: Any, machine: Any) -> None:
    """Run LLVM's -O3 pipeline (loop vectorisation) with whichever pass manager llvmlite has."""
    if hasattr(llvm, "create_pass_builder"):
        builder = llvm.create_pass_builder(machine, llvm.create_pipeline_tuning_options(speed_level=3))
        builder.getModulePassManager().run(module, builder)
        return
    builder = llvm.create_pass_manager_builder()  # llvmlite before 0.44: the legacy pass manager
    builder.opt_level = 3
    manager = llvm.create_module_pass_manager()
    builder.populate(manager)
    manager.run(module)


def _compile() -> dict[int, Kernel]:
    import llvmlite.binding as llvm  # type: ignore[import-untyped]

    for init in ("initialize_native_target", "initialize_native_asmprinter"):
        getattr(llvm, init)()
    module = llvm.parse_assembly("\n".join(_ir(w) for w in WIDTHS))
    module.verify()
    target = llvm.Target.from_default_triple()
    machine = target.create_target_machine(
        opt=3, cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten()
    )
    _optimise(llvm, module, machine)
    engine = llvm.create_mcjit_compiler(module, machine)
    engine.finalize_object()
    _KEEP.append(engine)  # the machine code lives as long as its engine
    kernels: dict[int, Kernel] = {}
    for w in WIDTHS:
        # CFUNCTYPE (not PYFUNCTYPE): the GIL is released during the call, so threads join at once.
        signature = ctypes.CFUNCTYPE(None, *([ctypes.c_void_p] * (w + 1)), ctypes.c_int64)
        kernels[w] = signature(engine.get_function_address(f"join{w}"))
    return kernels


_KEEP: list[Any] = []
_KERNELS: list[dict[int, Kernel] | None] = []  # empty until tried; [None] when llvmlite failed
_LOCK = threading.Lock()


def kernels() -> dict[int, Kernel] | None:
    """The compiled joins by element width, compiled by the first caller; None meanwhile for the
    other threads (they join with numpy rather than wait), and for good when llvmlite is missing
    or cannot compile for this machine (numpy then joins the same bytes)."""
    if not _KERNELS and _LOCK.acquire(blocking=False):
        try:
            if not _KERNELS:
                try:
                    _KERNELS.append(_compile())
                except Exception:  # an old, broken or missing llvmlite: numpy joins the same bytes
                    _KERNELS.append(None)
        finally:
            _LOCK.release()
    return _KERNELS[0] if _KERNELS else None


def loaded() -> dict[int, Kernel] | None:
    """The joins if this process compiled them already, else None (never compiles)."""
    return _KERNELS[0] if _KERNELS else None


def join(kernel: Kernel, planes: Sequence[np.ndarray], out: np.ndarray) -> None:
    """``out`` (uint8, ``len(planes) * n``) from the byte ``planes`` (uint8, ``n`` each, plane i
    holding byte i of every little-endian element)."""
    n = out.size // len(planes)
    if out.size != n * len(planes) or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError("join output must be a writable contiguous array of whole elements")
    for plane in planes:
        if plane.size != n or plane.itemsize != 1 or not plane.flags.c_contiguous:
            raise ValueError(f"plane of {plane.size} bytes for {n} elements")
    kernel(*(p.ctypes.data for p in planes), out.ctypes.data, n)

"""What this x86 CPU allows an int8 GEMM step: instruction-mix throughput.

The W8A8 prefill tiles' inner step decides their ceiling.  This script JITs
(llvmlite, inline assembly) loops of the steps the int8 kernels and their
peers use and reports multiply-adds per cycle, with the clock estimated from a
dependent ``add`` chain (one cycle per add on every x86 core since 2011)::

    python benchmarks/bench_avx2_bound.py

Steps measured (each on 6 independent accumulators, registers only, so
nothing but the execution ports limits them):

``exact avx2`` (ours)
    ``vpsignb`` + ``vpmaddubsw`` + ``vpmaddwd`` (by ones) + ``vpaddd``: the
    sign trick of :func:`opscope_nb.kernels.make_i8_panel_tile` on ``avx2``,
    exact for int8 codes in [-127, 127] (int16 pair sums at most
    ``2 * 127 * 127``).
``saturating avx2`` (ONNX Runtime / MLAS ``u8s8`` on AVX2)
    ``vpmaddubsw`` + ``vpmaddwd`` + ``vpaddd`` on ``x + 128``: one instruction
    fewer, but int16 pair sums up to ``2 * 255 * 127`` saturate -- the 0.07
    relative error bench section 9 reports for ORT on AVX2 hosts.
``panel loop body``
    One k-step of our 8-row x 6-output AVX2 panel as compiled: a panel load,
    ``vpabsb``, six weight broadcasts from memory and six exact products.
``vnni`` (when the host has AVX-512 VNNI; not measured on AVX-VNNI-only CPUs)
    ``vpdpbusd``: the exact step of the VNNI paths.
``f32 fma``
    ``vfmadd231ps`` ymm: the vendor sgemm's ceiling (8 multiply-adds each).

The ratios printed at the end are ceilings, not measurements of the
kernels: ``exact / saturating`` bounds our W8A8 against ORT's AVX2 kernel at
equal efficiency, ``exact / f32`` our W8A8 against sgemm.
"""
from __future__ import annotations

import ctypes
import platform
import time

import llvmlite.binding as llvm

from opscope_nb import kernels as K

_CLOBBER = ",".join([f"~{{ymm{i}}}" for i in range(16)] + ["~{rax}", "~{flags}"])
_ITERS = 2_000_000


def _jit(body: str):
    """A ``void f(int64 n)`` running ``body`` (AT&T assembly, ``;``-separated)
    ``n`` times; returns (callable, engine) -- keep the engine alive."""
    asm = body.replace(";", "\\0A")
    ir = f"""
define void @f(i64 %n) {{
entry:
  br label %loop
loop:
  %i = phi i64 [0, %entry], [%i2, %loop]
  call void asm sideeffect "{asm}", "{_CLOBBER}"()
  %i2 = add i64 %i, 1
  %c = icmp ult i64 %i2, %n
  br i1 %c, label %loop, label %done
done:
  ret void
}}"""
    tm = llvm.Target.from_default_triple().create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten())
    ee = llvm.create_mcjit_compiler(llvm.parse_assembly(ir), tm)
    ee.finalize_object()
    return ctypes.CFUNCTYPE(None, ctypes.c_int64)(ee.get_function_address("f")), ee


def _ns_per_iter(body: str, reps: int = 7) -> float:
    """Best of ``reps`` runs of ``_ITERS`` iterations, in ns per iteration."""
    fn, ee = _jit(body)
    fn(10_000)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn(_ITERS)
        best = min(best, time.perf_counter() - t)
    del ee
    return best / _ITERS * 1e9


def _six(step) -> str:
    """``step(tmp, acc)`` on six independent accumulators ymm1..ymm6."""
    return ";".join(step(7 + j, 1 + j) for j in range(6))


#: name -> (loop body, multiply-adds per iteration)
def _steps(vnni: str) -> dict:
    # ymm0: int16 ones; ymm14: |x| (or x + 128); ymm15: x; ymm13: weights
    steps = {
        "exact avx2 (ours)": (_six(lambda t, a: (
            f"vpsignb %ymm15, %ymm13, %ymm{t};vpmaddubsw %ymm{t}, %ymm14, %ymm{t};"
            f"vpmaddwd %ymm0, %ymm{t}, %ymm{t};vpaddd %ymm{t}, %ymm{a}, %ymm{a}")), 6 * 32),
        "saturating avx2 (MLAS u8s8)": (_six(lambda t, a: (
            f"vpmaddubsw %ymm13, %ymm14, %ymm{t};vpmaddwd %ymm0, %ymm{t}, %ymm{t};"
            f"vpaddd %ymm{t}, %ymm{a}, %ymm{a}")), 6 * 32),
        "panel loop body (ours, 8 x 6)": (
            "vmovdqu (%rsp), %ymm15;vpabsb %ymm15, %ymm14;" + _six(lambda t, a: (
                f"vpbroadcastd {4 * (a - 1)}(%rsp), %ymm13;vpsignb %ymm15, %ymm13, %ymm{t};"
                f"vpmaddubsw %ymm{t}, %ymm14, %ymm{t};vpmaddwd %ymm0, %ymm{t}, %ymm{t};"
                f"vpaddd %ymm{t}, %ymm{a}, %ymm{a}")), 6 * 32),
        "f32 fma (vendor sgemm)": (";".join(
            f"vfmadd231ps %ymm13, %ymm14, %ymm{1 + j}" for j in range(12)), 12 * 8),
    }
    if vnni:
        # the EVEX form (AVX-512 VL): an AVX-VNNI-only CPU is not measured
        steps["vnni (ours, exact)"] = (";".join(
            f"vpdpbusd %ymm13, %ymm14, %ymm{1 + j}" for j in range(12)), 12 * 32)
    return steps


def main() -> None:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        print("bench_avx2_bound: x86-64 only (this host is "
              f"{platform.machine()}); nothing to measure")
        return
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    llvm.initialize_native_asmparser()
    feats = llvm.get_host_cpu_features()
    vnni = "avx512vnni" if feats.get("avx512vnni") and feats.get("avx512vl") else ""
    print(f"# CPU {K.target_cpu_name()}, int8 path {K.HOST_I8_PATH}, "
          f"VNNI: {vnni or 'none'}; {_ITERS} iterations, best of 7")
    cyc = _ns_per_iter(";".join(["add $$1, %rax"] * 32)) / 32
    print(f"clock (dependent add chain): {1 / cyc:.2f} GHz")
    rate = {}
    for name, (body, macs) in _steps(vnni).items():
        ns = _ns_per_iter(body)
        rate[name] = macs * cyc / ns
        print(f"{name:32s} {rate[name]:6.1f} multiply-adds / cycle")
    ex, sat = rate["exact avx2 (ours)"], rate["saturating avx2 (MLAS u8s8)"]
    f32 = rate["f32 fma (vendor sgemm)"]
    print(f"ceiling exact / saturating avx2: {ex / sat:.2f}  "
          f"(our W8A8 vs ORT's AVX2 kernel at equal efficiency)")
    print(f"ceiling exact avx2 / f32 fma:    {ex / f32:.2f}  (our W8A8 vs sgemm)")
    if vnni:
        print(f"ceiling vnni / f32 fma:          {rate['vnni (ours, exact)'] / f32:.2f}")


if __name__ == "__main__":
    main()

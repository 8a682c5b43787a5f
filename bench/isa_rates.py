"""The issue rate of the CPU's product instructions, each alone and two interleaved: what a kernel built
on them can reach at most, per core.

    python -m bench.isa_rates [--iters 20000000] [--cpu 0] [--chains 12] [--mix] [--blocks]

For each instruction the CPU has (FMA ``VFMADD231PS``, AVX-512 VNNI ``VPDPBUSD``, AVX-VNNI's VEX form,
AVX-512 BF16 ``VDPBF16PS``), in ymm and zmm: a loop of ``--chains`` independent accumulators written as
one asm block (so the compiler adds no moves or loads), compiled with gcc, run pinned to one CPU, the
best of 7 runs. Prints instructions per ns and multiply-adds per ns (VPDPBUSD: 4 int8 products a 32-bit
lane; VDPBF16PS: 2; FMA: 1); ``--mix`` also runs each pair of instructions interleaved, which says whether
they share execution ports; ``--blocks`` times VPDPBUSD beside the float work specjet's quantized GEMM
does per Q8_0 or Q4_1 block and row (the bound that format puts on a kernel). Kernel bounds in
bench/RESULTS.md are quoted from this tool, not from a datasheet: what a core issues can differ from
what its documentation implies.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import shutil
import subprocess
import tempfile

from bench.common import command_line, machine_info, now, report_header_lines
from specjet.kernels.cpu_features import cpu_flags


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str  # what the report calls it
    mnemonic: str  # as the assembler takes it, register form: op src2, src1, acc
    cpu_flag: str  # /proc/cpuinfo flag the instruction needs
    products_per_lane: int  # multiply-adds into one 32-bit lane per instruction
    widths: tuple[str, ...] = ("ymm", "zmm")


INSTRUCTIONS = (
    Instruction("fma_fp32", "vfmadd231ps", "fma", 1),
    Instruction("vnni_int8", "vpdpbusd", "avx512_vnni", 4),
    # braces in an asm template are written %{ %}
    Instruction("avxvnni_int8", "%{vex%} vpdpbusd", "avx_vnni", 4, ("ymm",)),
    Instruction("bf16_pairs", "vdpbf16ps", "avx512_bf16", 2),
)
LANES = {"ymm": 8, "zmm": 16}
BY_NAME = {ins.name: ins for ins in INSTRUCTIONS}


def widths(ins: Instruction, flags: frozenset[str] | set[str]) -> tuple[str, ...]:
    """The register widths ``ins`` runs in on a CPU with ``flags`` (zmm needs AVX-512)."""
    return tuple(w for w in ins.widths if w != "zmm" or "avx512f" in flags)


def timed_asm_program(setup: list[str], loop: list[str], clobbers: list[str], counts: dict[str, int]) -> str:
    """C source of a program that runs the asm ``loop`` lines (after ``setup``) argv[1] times, 7 times
    over, and prints ``<name> <per ns>`` for each of ``counts`` (that name's instructions an iteration)
    from the best run. Lines are asm template text: registers written %%zmm0."""
    asm = "".join(f'"{line}\\n"\n' for line in [*setup, "1:", *loop, "dec %0", "jnz 1b"])
    prints = "".join(f'  printf("{name} %.4f\\n", (double)iters * {n} / ns);\n' for name, n in counts.items())
    clobber_list = ", ".join(f'"{c}"' for c in clobbers)
    return f"""#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(void) {{ struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }}
int main(int argc, char **argv) {{
  long iters = atol(argv[1]);
  double best = 1e30;
  for (int rep = 0; rep < 7; rep++) {{
    long n = iters;
    double t0 = now();
    asm volatile(
{asm}      : "+r"(n) : : {clobber_list}, "cc");
    double dt = now() - t0;
    if (dt < best) best = dt;
  }}
  double ns = best * 1e9;
{prints}  return 0;
}}
"""


def loop_source(parts: list[tuple[Instruction, int]], width: str) -> str:
    """C source timing one asm loop holding ``count`` independent accumulator chains of each instruction
    in ``parts``, interleaved, on ``width`` registers; it prints ``<name> <instructions per ns>`` per
    instruction. The accumulators are registers 0 .. total - 1 and the two operands the next two (below
    16 for 14 chains or fewer: an AVX2-only CPU has 16 vector registers)."""
    total = sum(count for _, count in parts)
    if not 0 < total <= 30:
        raise ValueError(f"{total} chains: 1 to 30 fit beside the two operand registers")
    a, b = total, total + 1
    setup = ["mov $0x7f3c19a5, %%eax", f"vmovd %%eax, %%xmm{a}", f"vpbroadcastd %%xmm{a}, %%{width}{a}",
             "mov $0x01f02d3b, %%eax", f"vmovd %%eax, %%xmm{b}", f"vpbroadcastd %%xmm{b}, %%{width}{b}"]
    # chain k of instruction i sits at position (k + 0.5) / count in the loop, so the kinds alternate
    slots = sorted(((k + 0.5) / count, i, k) for i, (_, count) in enumerate(parts) for k in range(count))
    loop = [f"{parts[i][0].mnemonic} %%{width}{a}, %%{width}{b}, %%{width}{n}" for n, (_, i, _) in enumerate(slots)]
    clobbers = ["eax", *(f"xmm{n}" for n in range(total + 2))]
    return timed_asm_program(setup, loop, clobbers, {ins.name: count for ins, count in parts})


# The float work a quantized block adds per row in specjet's GEMM (csrc/qgemm_body.h), after its 8
# integer steps: convert the sum, scale (d x dx), add; Q4_1 also adds its minimum's term.
BLOCK_WORK = {
    "int8 steps alone": (),
    "q8_0 block": ("vcvtdq2ps %%zmm{r}, %%zmm{t}", "vmulps %%zmm29, %%zmm28, %%zmm25",
                   "vfmadd231ps %%zmm{t}, %%zmm25, %%zmm{a}"),
    "q4_1 block": ("vcvtdq2ps %%zmm{r}, %%zmm{t}", "vmulps %%zmm29, %%zmm28, %%zmm25",
                   "vfmadd231ps %%zmm{t}, %%zmm25, %%zmm{a}", "vfmadd231ps %%zmm27, %%zmm26, %%zmm{a}"),
}
BLOCK_ROWS = 8  # the AVX-512 kernel's tile (csrc/qgemm.cpp, kRows)


def block_loop_source(work: tuple[str, ...], rows: int = BLOCK_ROWS) -> str:
    """C source timing a block of ``rows`` rows as the zmm kernel computes it: each row's sum zeroed,
    8 VPDPBUSD steps a row (rows inner, so the rows' chains interleave), then ``work`` per row
    (``{r}`` the row's integer sum, ``{t}`` a temporary, ``{a}`` the row's float accumulator). Prints
    ``vnni_int8 <instructions per ns>``. The weights' nibble unpacking is left out."""
    if not 1 <= rows <= 8:
        raise ValueError("1 to 8 rows: each takes three registers beside the operands")
    setup = [f"vpxord %%zmm{k}, %%zmm{k}, %%zmm{k}" for k in (26, 27, 28, 29, 30, 31)]
    loop = [f"vpxord %%zmm{r}, %%zmm{r}, %%zmm{r}" for r in range(rows)]
    loop += [f"vpdpbusd %%zmm30, %%zmm31, %%zmm{r}" for _ in range(8) for r in range(rows)]
    loop += [op.format(r=r, t=16 + r, a=8 + r) for r in range(rows) for op in work]
    return timed_asm_program(setup, loop, [f"xmm{k}" for k in range(32)], {"vnni_int8": 8 * rows})


def run_loop(source: str, stem: str, iters: int, cpu: int, workdir: pathlib.Path) -> dict:
    """{instruction name: instructions per ns} of one compiled loop."""
    src, exe = workdir / f"{stem}.c", workdir / stem
    src.write_text(source)
    # gcc names registers 16-31 in a clobber list only when it targets AVX-512
    wide = ["-mavx512f"] if "zmm" in source or "xmm16" in source else []
    built = subprocess.run(["gcc", "-O2", *wide, "-o", str(exe), str(src)], capture_output=True, text=True)
    if built.returncode != 0:
        raise RuntimeError(f"gcc could not build {src.name}:\n{built.stderr}")
    cmd = [str(exe), str(iters)]
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", str(cpu), *cmd]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return {name: float(rate) for name, rate in (line.split() for line in out.splitlines())}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.isa_rates", description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=20_000_000, help="loop iterations a run (7 runs, the best kept)")
    p.add_argument("--cpu", type=int, default=0, help="the CPU the loops run on")
    p.add_argument("--chains", type=int, default=12,
                   help="independent accumulators an instruction (enough to cover its latency)")
    p.add_argument("--mix", action="store_true", help="also each pair of instructions interleaved, in zmm")
    p.add_argument("--blocks", action="store_true",
                   help="also VPDPBUSD's rate beside the float work of a Q8_0 and a Q4_1 block (AVX-512 VNNI)")
    args = p.parse_args(argv)
    if args.iters < 1 or not 1 <= args.chains <= 14:  # 14: the VEX-encoded loops' accumulators fit ymm0-ymm15
        p.error("--iters >= 1, --chains 1 to 14")
    usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    if args.cpu < 0 or (usable is not None and args.cpu not in usable):
        p.error(f"--cpu must be one this process may run on ({usable}), got {args.cpu}")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if shutil.which("gcc") is None:
        raise SystemExit("bench.isa_rates needs gcc")
    flags = cpu_flags()
    present = [ins for ins in INSTRUCTIONS if ins.cpu_flag in flags]
    machine, date = machine_info(), now()
    for line in report_header_lines(command_line(), date, machine):
        print(line)
    absent = [ins.name for ins in INSTRUCTIONS if ins.cpu_flag not in flags]
    print(f"# one core (CPU {args.cpu}), {args.chains} chains an instruction, best of 7 runs of {args.iters:,} "
          f"iterations" + (f"; not on this CPU: {', '.join(absent)}" if absent else ""))
    print(f"{'instructions':34s} {'width':5s} {'per ns':>22s} {'multiply-adds/ns':>16s}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="isa_rates_") as tmp:
        workdir = pathlib.Path(tmp)
        plans = [([(ins, args.chains)], width) for ins in present for width in widths(ins, flags)]
        if args.mix:
            zmm = [ins for ins in present if "zmm" in widths(ins, flags)]
            plans += [([(a, args.chains), (b, args.chains)], "zmm")
                      for i, a in enumerate(zmm) for b in zmm[i + 1:]]
        for parts, width in plans:
            stem = "_".join(f"{ins.name}{count}" for ins, count in parts) + f"_{width}"
            rates = run_loop(loop_source(parts, width), stem, args.iters, args.cpu, workdir)
            macs = sum(rates[ins.name] * ins.products_per_lane * LANES[width] for ins, _ in parts)
            names = " + ".join(ins.name for ins, _ in parts)
            per_ns = " + ".join(f"{rates[ins.name]:.2f}" for ins, _ in parts)
            print(f"{names:34s} {width:5s} {per_ns:>22s} {macs:16.1f}")
            rows.append({"instructions": [ins.name for ins, _ in parts], "width": width,
                         "per_ns": rates, "multiply_adds_per_ns": macs})
        vnni = BY_NAME["vnni_int8"]
        if args.blocks and "zmm" in widths(vnni, flags) and vnni in present:
            print(f"# a quantized block's work, {BLOCK_ROWS} rows interleaved (the kernel's zmm tile, weights' "
                  "unpacking left out): VPDPBUSD per ns and its share of the instruction alone")
            alone = None
            for name, work in BLOCK_WORK.items():
                stem = "block_" + name.split()[0]
                rate = run_loop(block_loop_source(work), stem, max(1, args.iters // 8), args.cpu, workdir)[vnni.name]
                alone = alone or rate
                macs = rate * vnni.products_per_lane * LANES["zmm"]
                print(f"{name:34s} {'zmm':5s} {rate:22.2f} {macs:16.1f}  ({100 * rate / alone:.0f}%)")
                rows.append({"instructions": [vnni.name], "block": name, "width": "zmm",
                             "per_ns": {vnni.name: rate}, "multiply_adds_per_ns": macs})
    print(f"# cores usable: {len(os.sched_getaffinity(0))}; a kernel's bound is the multiply-adds per ns of its "
          "instruction times the cores it runs on")
    return rows


if __name__ == "__main__":
    from bench.common import run_cli

    run_cli(main)

"""bench.isa_rates: the product instructions' issue rates from asm loops built with gcc."""
from __future__ import annotations

import re
import shutil

import pytest

from bench.isa_rates import BLOCK_WORK, BY_NAME, INSTRUCTIONS, LANES, block_loop_source, loop_source, main, widths
from specjet.kernels.cpu_features import cpu_flags


def test_a_loop_holds_each_instructions_chains_interleaved_on_their_own_accumulators():
    fma, vnni = BY_NAME["fma_fp32"], BY_NAME["vnni_int8"]
    src = loop_source([(fma, 3), (vnni, 6)], "zmm")
    lines = re.findall(r'"(v\S+) %%zmm(\d+), %%zmm(\d+), %%zmm(\d+)\\n"', src)
    assert [op for op, *_ in lines].count("vfmadd231ps") == 3
    assert [op for op, *_ in lines].count("vpdpbusd") == 6
    assert sorted(int(acc) for *_, acc in lines) == list(range(9))  # one register a chain
    assert {(a, b) for _, a, b, _ in lines} == {("9", "10")}  # the operands beside them
    kinds = "".join("f" if op == "vfmadd231ps" else "v" for op, *_ in lines)
    assert "fff" not in kinds and "vvv" not in kinds  # spread through the loop, not in runs
    assert 'printf("fma_fp32 %.4f\\n", (double)iters * 3 / ns)' in src
    # an AVX2-only CPU has 16 registers: 12 chains keep their operands below 16
    assert "%%ymm13" in loop_source([(fma, 12)], "ymm") and "%%ymm14" not in loop_source([(fma, 12)], "ymm")
    assert widths(fma, {"fma", "avx2"}) == ("ymm",) and widths(fma, {"fma", "avx512f"}) == ("ymm", "zmm")
    with pytest.raises(ValueError, match="31 chains"):
        loop_source([(fma, 16), (vnni, 15)], "zmm")


def test_a_block_loop_holds_each_rows_steps_then_its_float_work():
    src = block_loop_source(BLOCK_WORK["q4_1 block"], rows=4)
    loop = src.split('"1:')[1].split('"dec %0')[0]
    ops = re.findall(r'"(v\w+) [^"]*\\n"', loop)
    assert ops[:4] == ["vpxord"] * 4 and ops[4:36] == ["vpdpbusd"] * 32
    assert ops[36:] == ["vcvtdq2ps", "vmulps", "vfmadd231ps", "vfmadd231ps"] * 4
    assert "%%zmm17, %%zmm25, %%zmm9" in src  # row 1: its temporary and its float accumulator
    assert block_loop_source(BLOCK_WORK["int8 steps alone"], rows=8).count("vpdpbusd") == 64
    with pytest.raises(ValueError, match="1 to 8 rows"):
        block_loop_source((), rows=9)


@pytest.mark.skipif(shutil.which("gcc") is None or "fma" not in cpu_flags(), reason="needs gcc and an x86 CPU with FMA")
def test_isa_rates_measures_every_instruction_the_cpu_has(capsys):
    rows = main(["--iters", "20000", "--chains", "4", "--mix", "--blocks"])
    blocks = [r for r in rows if "block" in r]
    rows = [r for r in rows if "block" not in r]
    vnni_zmm = "avx512_vnni" in cpu_flags() and "avx512f" in cpu_flags()
    assert [r["block"] for r in blocks] == (list(BLOCK_WORK) if vnni_zmm else [])
    assert all(r["per_ns"]["vnni_int8"] > 0 for r in blocks)
    flags = cpu_flags()
    present = [ins for ins in INSTRUCTIONS if ins.cpu_flag in flags]
    singles = [(r["instructions"][0], r["width"]) for r in rows if len(r["instructions"]) == 1]
    assert singles == [(ins.name, w) for ins in present for w in widths(ins, flags)]
    for r in rows:
        assert all(rate > 0 for rate in r["per_ns"].values())
        assert r["multiply_adds_per_ns"] == pytest.approx(
            sum(r["per_ns"][n] * BY_NAME[n].products_per_lane * LANES[r["width"]] for n in r["instructions"]))
    zmm = [ins for ins in present if "zmm" in widths(ins, flags)]
    assert sum(len(r["instructions"]) == 2 for r in rows) == len(zmm) * (len(zmm) - 1) // 2
    out = capsys.readouterr().out
    assert out.startswith("# command: ") and "multiply-adds/ns" in out


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_every_loop_assembles(tmp_path):
    """Each instruction's loop in each of its widths builds, whether or not this CPU could run it (the
    assembler takes any x86 instruction): AVX-VNNI's {vex} prefix, the zmm registers past 15."""
    import subprocess

    for ins in INSTRUCTIONS:
        for width in ins.widths:
            src = tmp_path / f"{ins.name}_{width}.c"
            src.write_text(loop_source([(ins, 12)], width))
            built = subprocess.run(["gcc", "-O2", "-mavx512f", "-c", "-o", str(src.with_suffix(".o")), str(src)],
                                   capture_output=True, text=True)
            assert built.returncode == 0, built.stderr
    objdump = shutil.which("objdump")
    if objdump:
        obj = tmp_path / "avxvnni_int8_ymm.o"
        text = subprocess.run([objdump, "-d", str(obj)], capture_output=True, text=True).stdout
        # VEX-encoded (a 3-byte VEX prefix, c4), not AVX-512's EVEX (62), whatever objdump calls it
        encodings = [line.split("\t")[1].split()[0] for line in text.splitlines() if "vpdpbusd" in line]
        assert encodings == ["c4"] * 12

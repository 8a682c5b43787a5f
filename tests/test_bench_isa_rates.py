"""bench.isa_rates: the product instructions' issue rates from asm loops built with gcc."""
from __future__ import annotations

import re
import shutil

import pytest

from bench.isa_rates import INSTRUCTIONS, cpu_flags, loop_source, main, widths

BY_NAME = {ins.name: ins for ins in INSTRUCTIONS}


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


@pytest.mark.skipif(shutil.which("gcc") is None or "fma" not in cpu_flags(), reason="needs gcc and an x86 CPU with FMA")
def test_isa_rates_measures_every_instruction_the_cpu_has(capsys):
    rows = main(["--iters", "20000", "--chains", "4", "--mix"])
    flags = cpu_flags()
    present = [ins for ins in INSTRUCTIONS if ins.cpu_flag in flags]
    singles = [(r["instructions"][0], r["width"]) for r in rows if len(r["instructions"]) == 1]
    assert singles == [(ins.name, w) for ins in present for w in widths(ins, flags)]
    for r in rows:
        assert all(rate > 0 for rate in r["per_ns"].values())
        lanes = {"ymm": 8, "zmm": 16}[r["width"]]
        assert r["multiply_adds_per_ns"] == pytest.approx(
            sum(r["per_ns"][n] * BY_NAME[n].products_per_lane * lanes for n in r["instructions"]))
    zmm = [ins for ins in present if "zmm" in widths(ins, flags)]
    assert sum(len(r["instructions"]) == 2 for r in rows) == len(zmm) * (len(zmm) - 1) // 2
    out = capsys.readouterr().out
    assert out.startswith("# command: ") and "multiply-adds/ns" in out

"""The built kernels keep their software prefetches (csrc/prefetch.h). GCC at -O3 once deleted every
prefetch of the AVX-512 and AMX Q4_1 GEMMs without a trace in the source or the results: the weights of
a verify then streamed from memory behind the compute instead of ahead of it. This reads the machine
code of the built extension and requires a prefetch instruction in each kernel whose source asks for one,
and each bf16 GEMM path's fetches into L2."""
from __future__ import annotations

import re
import shutil
import subprocess
from collections import Counter

import pytest

from specjet.kernels import cpu_ops

pytestmark = [
    pytest.mark.skipif(cpu_ops.extension() is None, reason="the C++ extension is not built"),
    pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) is not installed"),
]

# Each kernel family: the demangled function names that hold its inner loops (whether the compiler
# inlined a tile into its caller or not).
KERNELS = {
    "AVX-512 Q4_1 GEMM": r"^qgemm_avx512::(q4_1|lane_group<qgemm_avx512::Q41Lanes>|tile<\d+, qgemm_avx512::Q41Lanes>)",
    "AVX-512 int8 GEMM": r"^qgemm_avx512::(int8|lane_group<qgemm_avx512::Int8Lanes>|tile<\d+, qgemm_avx512::Int8Lanes>)",
    "AVX2 Q4_1 GEMM": r"^qgemm_avx2::(q4_1|lane_group<qgemm_avx2::Q41Lanes>|tile<\d+, qgemm_avx2::Q41Lanes>)",
    "AVX2 int8 GEMM": r"^qgemm_avx2::(int8|lane_group<qgemm_avx2::Int8Lanes>|tile<\d+, qgemm_avx2::Int8Lanes>)",
    "AMX Q4_1 GEMM": r"^qgemm_amx::(q4_1|AmxQ41::prepare|tile<\d+, qgemm_amx::AmxQ41>)",
    "AVX-512 bf16 GEMM": r"^bf16_avx512::",
    "AVX-512 attention (bf16 pool)": r"^isa_avx512::attend_tile<float, c10::BFloat16>",
    "AVX2 attention (bf16 pool)": r"^isa_avx2::attend_tile<float, c10::BFloat16>",
    # A decode step's weights x V read the pool's values in place, fetched ahead (kValuesAhead).
    "AVX-512 attention values (bf16 pool)": r"^(auto )?isa_avx512::weigh_all_values<isa_avx512::attend_tile<float, c10::BFloat16>",
    "AVX2 attention values (bf16 pool)": r"^(auto )?isa_avx2::weigh_all_values<isa_avx2::attend_tile<float, c10::BFloat16>",
}


@pytest.fixture(scope="module")
def prefetches_by_function() -> dict[str, Counter]:
    """Demangled function name -> its prefetch instructions by mnemonic, over the extension's machine code."""
    library = cpu_ops.extension().__file__
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", library], check=True,
                             capture_output=True, text=True).stdout
    counts: dict[str, Counter] = {}
    function = None
    for line in listing.splitlines():
        header = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if header:
            function = re.sub(r"^void ", "", header.group(1))
            counts.setdefault(function, Counter())
        elif function is not None:
            fetch = re.search(r"\t(prefetch\w*)", line)
            if fetch:
                counts[function][fetch.group(1)] += 1
    return counts


def kernel_prefetches(prefetches_by_function, kernel: str) -> Counter:
    pattern = re.compile(KERNELS[kernel])
    functions = {name: n for name, n in prefetches_by_function.items() if pattern.search(name)}
    assert functions, f"no function of the {kernel} in the extension (symbols stripped or renamed?)"
    return sum(functions.values(), Counter())


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_kernel_keeps_its_prefetches(prefetches_by_function, kernel):
    assert sum(kernel_prefetches(prefetches_by_function, kernel).values()) > 0, f"the {kernel} has no prefetch"


@pytest.mark.parametrize("path", ["groups", "interleaved"])
def test_the_bf16_gemm_fetches_the_next_columns_into_l2(prefetches_by_function, path):
    """Both paths of a bf16 call of more than one row block fetch weights they read next into L2 (PREFETCHT1):
    groups() from its later blocks (csrc/prefetch.h's L2Ahead), beside the first block's fetches into L1
    (PREFETCHT0); interleaved() (7-10 rows) the next chunk from its first block. Asked per path, so that one
    path's fetches cannot stand in for the other's."""
    pattern = re.compile(rf"^bf16_avx512::{path}<")
    functions = {name: n for name, n in prefetches_by_function.items() if pattern.search(name)}
    assert functions, f"no bf16_avx512::{path} function in the extension (inlined, stripped or renamed?)"
    fetches = sum(functions.values(), Counter())
    assert fetches["prefetcht1"] > 0, (path, fetches)
    if path == "groups":
        assert fetches["prefetcht0"] > 0, fetches

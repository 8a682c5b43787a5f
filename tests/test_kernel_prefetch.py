"""The built kernels keep their software prefetches (csrc/prefetch.h). GCC at -O3 once deleted every
prefetch of the AVX-512 and AMX Q4_1 GEMMs without a trace in the source or the results: the weights of
a verify then streamed from memory behind the compute instead of ahead of it. This reads the machine
code of the built extension and requires a prefetch instruction in each kernel whose source asks for one."""
from __future__ import annotations

import re
import shutil
import subprocess

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
}


@pytest.fixture(scope="module")
def prefetches_by_function() -> dict[str, int]:
    """Demangled function name -> prefetch instructions in it, over the extension's machine code."""
    library = cpu_ops.extension().__file__
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", library], check=True,
                             capture_output=True, text=True).stdout
    counts: dict[str, int] = {}
    function = None
    for line in listing.splitlines():
        header = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if header:
            function = re.sub(r"^void ", "", header.group(1))
            counts.setdefault(function, 0)
        elif function is not None and re.search(r"\tprefetch", line):
            counts[function] += 1
    return counts


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_kernel_keeps_its_prefetches(prefetches_by_function, kernel):
    pattern = re.compile(KERNELS[kernel])
    functions = {name: n for name, n in prefetches_by_function.items() if pattern.search(name)}
    assert functions, f"no function of the {kernel} in the extension (symbols stripped or renamed?)"
    assert sum(functions.values()) > 0, f"the {kernel} has no prefetch instruction: {sorted(functions)}"

// Functions cloned per instruction set: GCC compiles one copy for AVX-512F, one for AVX2 and a baseline one, and
// the loader picks the widest the CPU runs. Each copy makes the same IEEE operations in the same order (no fused
// products: -ffp-contract=off), so every CPU gets the same bits; only the speed differs.
#pragma once

#define SJ_ISA_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

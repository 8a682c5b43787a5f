"""Builds specjet's C++ extension (csrc/: paged attention, layer ops, quantized GEMM, the layer stack) at install time.

pyproject.toml holds the package's metadata; this file only adds the extension. Building needs
torch in the build environment, so install with ``pip install --no-build-isolation`` after torch
(scripts/setup.sh does). Without torch or a compiler the package installs without the extension
and the kernels run their torch references (specjet/kernels/qgemm.py logs a warning once).
"""
import glob
import os
import sys

from setuptools import setup

ext_modules, cmdclass = [], {}
try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:
    print("specjet: torch is not importable at build time; the C++ extension is not built "
          "(install torch first and use pip install --no-build-isolation)", file=sys.stderr)
else:
    ext = CppExtension(
        "specjet.kernels._cpu_ops",
        ["csrc/module.cpp", "csrc/attention.cpp", "csrc/layer_ops.cpp", "csrc/qgemm.cpp", "csrc/bf16_gemm.cpp", "csrc/fp32_gemm.cpp",
         "csrc/layer_stack.cpp",
         "csrc/draft_ops.cpp", "csrc/argmax_bound.cpp", "csrc/dflash_block.cpp", "csrc/head_loss.cpp", "csrc/sampling.cpp", "csrc/thread_pinning.cpp"],
        # Every header (a list by hand left one out: the sdist lacked it, and a change to it rebuilt nothing).
        depends=sorted("csrc/" + h for h in glob.glob("*.h", root_dir=os.path.join(os.path.dirname(__file__) or ".", "csrc"))),
        # No -march: each file compiles each instruction set's kernels under its own target pragma (or
        # target_clones) and picks one at run time, so one build runs on any x86-64 CPU.
        # -fopenmp: at::parallel_for.
        # -ffp-contract=off: no product fused into its sum unless the source says so (the quantized GEMM's
        # explicit fmas), so every instruction set's build gives the same bits.
        # -fno-trapping-math: lets GCC turn exp_float's clamps into selects and so vectorise the loops over
        # it (the SiLU rows); it changes no value (no reassociation, no fusing), only which instructions.
        extra_compile_args=["-O3", "-fopenmp", "-std=c++17", "-ffp-contract=off", "-fno-trapping-math",
                            "-Wno-maybe-uninitialized"],
        extra_link_args=["-fopenmp"],
    )
    # A failed compile leaves the torch path, not a failed install.
    ext.optional = True
    ext_modules = [ext]

    class OptionalBuild(BuildExtension.with_options(use_ninja=False)):
        """A compiler that cannot build at all (torch checks its version before any compile: a missing or broken
        one raised there, past ``optional``) leaves the torch path too, saying why."""

        def build_extensions(self):
            try:
                super().build_extensions()
            except Exception as error:  # noqa: BLE001 - whatever the toolchain raised, the install goes on
                print(f"specjet: the C++ extension was not built ({type(error).__name__}: {error}); the kernels "
                      f"will run their torch references", file=sys.stderr)

    cmdclass = {"build_ext": OptionalBuild}

setup(ext_modules=ext_modules, cmdclass=cmdclass)

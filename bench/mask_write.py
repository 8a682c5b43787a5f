"""Writing a grammar's token bitmask into CPU float32 logits: specjet's ``apply_token_bitmask_`` (the C++
``apply_token_bitmask_rows`` where the extension is built) against xgrammar's own CPU kernel, same rows.

    python -m bench.mask_write [--rows 4 12] [--vocab 49152] [--allowed 3200] [--repeats 500]

Each row's mask allows its first ``--allowed`` tokens and a scattered few beyond (a JSON schema's row: most
words of the mask all-forbidden). Prints the median µs of one call per path and row count, the paths taking
turns, after checking that both write the same logits.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import xgrammar as xgr

from bench.common import command_line, machine_info, now, report_header_lines
from specjet.grammar import apply_token_bitmask_


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.mask_write", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[4, 12], help="masked rows per call")
    p.add_argument("--vocab", type=int, default=49152, help="logits columns (the default model's vocabulary)")
    p.add_argument("--allowed", type=int, default=3200, help="allowed tokens at the front of each row's mask")
    p.add_argument("--repeats", type=int, default=500)
    args = p.parse_args(argv)
    if min(args.rows) < 1 or args.vocab < 32 or not 0 <= args.allowed <= args.vocab or args.repeats < 1:
        p.error("--rows and --repeats must be >= 1, --vocab >= 32, 0 <= --allowed <= --vocab")
    if args.vocab % 32:  # xgrammar 0.2.9's CPU kernel writes past such rows (a -inf, or the heap's end)
        p.error(f"--vocab must be a multiple of 32 (xgrammar's CPU kernel, compared here, needs it), got {args.vocab}")
    return args


def case(rows: int, vocab: int, allowed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rows)
    bits = torch.zeros(rows, (vocab + 31) // 32 * 32, dtype=torch.bool)
    bits[:, :allowed] = True
    bits[:, torch.randint(0, vocab, (rows, 16), generator=gen)] = True
    weights = 2 ** torch.arange(32, dtype=torch.int64)
    words = (bits.view(rows, -1, 32).to(torch.int64) * weights).sum(-1)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return torch.randn(rows, vocab, generator=gen), bitmask


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    machine, date = machine_info(), now()
    paths = {"specjet": lambda x, m, idx: apply_token_bitmask_(x, m, indices=idx),
             "xgrammar": lambda x, m, idx: xgr.apply_token_bitmask_inplace(x, m, indices=idx, backend="cpu")}
    results = {}
    for rows in args.rows:
        logits, bitmask = case(rows, args.vocab, args.allowed)
        idx = list(range(rows))
        written = {}
        for name, write in paths.items():
            written[name] = logits.clone()
            write(written[name], bitmask, idx)
        if not torch.equal(written["specjet"], written["xgrammar"]):
            raise SystemExit("the two paths wrote different logits")
        times = {name: [] for name in paths}
        for _ in range(args.repeats):
            for name, write in paths.items():
                x = logits.clone()
                start = time.perf_counter()
                write(x, bitmask, idx)
                times[name].append(time.perf_counter() - start)
        results[rows] = {name: 1e6 * statistics.median(t) for name, t in times.items()}
    lines = report_header_lines(command_line(), date, machine)
    lines.append(f"# {args.vocab} columns, {args.allowed} allowed at the front of each row, median of {args.repeats} calls")
    lines.append("rows  specjet us  xgrammar us  ratio")
    for rows, r in results.items():
        lines.append(f"{rows:4d}  {r['specjet']:10.1f}  {r['xgrammar']:11.1f}  {r['xgrammar'] / r['specjet']:5.1f}x")
    print("\n".join(lines))
    return results


if __name__ == "__main__":
    from bench.common import run_cli

    run_cli(main)

"""Where a plain decode iteration goes on a GPU (run by ``scripts/gpu_check.sh split`` on a lent machine):
the engine's iteration (``get_server_info()["stats"]["overlap"]``) against the GPU's own time for one
decode step's CUDA graph (CUDA events around replays, nothing else queued) and its host-side launch.

The weights are random with the default model's configuration (.gpu/tok/config.json): a step's kernels
and their times do not depend on the weights' values, and no 98 MB GGUF has to travel. Prints one JSON line.
"""
from __future__ import annotations

import json
import pathlib
import shutil
import statistics
import sys
import time

import torch


def random_model(tok_dir: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tok_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (tok_dir / name).exists():
            shutil.copy(tok_dir / name, out / name)
    return out


def main(tok_dir: str, work: str, device: str = "cuda", batch_sizes=(1, 4)) -> None:
    import specjet

    model_dir = random_model(pathlib.Path(tok_dir), pathlib.Path(work))
    report = {"device": torch.cuda.get_device_name() if device == "cuda" else device}
    with specjet.Engine(model_path=str(model_dir), device=device, dtype="bfloat16") as eng:
        graphs = eng.worker.runner.graphs
        for batch in batch_sizes:
            params = {"temperature": 0, "max_new_tokens": 128, "ignore_eos": True}
            prompts = [f"Request {i}: tell me a long story about the sea." for i in range(batch)]
            eng.generate(prompts, params)  # warm-up (the iteration medians cover both runs)
            start = time.perf_counter()
            eng.generate(prompts, params)
            wall = time.perf_counter() - start
            stats = eng.get_server_info()["stats"]["overlap"]
            row = {"tok_s": round(batch * 128 / wall, 1), "iteration_ms": round(stats["iteration_ms_median"], 3),
                   "forward_ms": round(stats["forward_ms_median"], 3)}
            if graphs is not None:
                # One step's graph alone: token 1 at position 100 of table rows 0 .. batch-1 (the engine is
                # idle; the slots written are scratch).
                requests = torch.tensor([[1, 100, r] for r in range(batch)], dtype=torch.int64, device="cuda")
                graphs.decode(requests)
                torch.cuda.synchronize()
                gpu, launch = [], []
                for _ in range(200):
                    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    begin.record()
                    t = time.perf_counter()
                    graphs.decode(requests)
                    launch.append(time.perf_counter() - t)
                    end.record()
                    torch.cuda.synchronize()
                    gpu.append(begin.elapsed_time(end))
                row.update(graph_gpu_ms=round(statistics.median(gpu), 3),
                           graph_launch_ms=round(1000 * statistics.median(launch), 3))
            report[f"batch {batch}"] = row
    print(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:4])

"""bench.step: one model forward timed with the invariant attention (layer stack on and off) and with SDPA."""
from __future__ import annotations

from bench.step import main
from specjet.kernels import cpu_ops
from specjet.kernels.cpu_features import describe_cpu

# The engine's CPU path (the forward from host lists) is timed where the layer stack is built.
PATHS = ({"lists"} if cpu_ops.extension() is not None else set()) | {"invariant", "loop", "sdpa"}


def test_bench_step_times_both_attention_paths(tiny_model_dir, capsys):
    """bench.step on the tiny model: a decode step and a 3-node verify, invariant (the layer stack and
    the Python loop) and SDPA."""
    for nodes in ("1", "3"):
        results = main(["--model-path", str(tiny_model_dir), "--batch-size", "3", "--context", "20",
                        "--nodes", nodes, "--repeats", "2", "--dtype", "float32"])
        assert set(results) == PATHS
        assert all(0 < r["min_s"] <= r["median_s"] <= r["max_s"] for r in results.values())
    out = capsys.readouterr().out
    assert "batch 3, 20 cached tokens per request, 3 new token(s) per request" in out
    assert all(out.count(f"\n{name} ") == 2 for name in PATHS)
    assert out.count(f"# machine: {describe_cpu()}; ") == 2


def test_bench_step_dtype_follows_the_cpu(tiny_model_dir, capsys, monkeypatch):
    """No --dtype: fp32 on a CPU without native bf16 (emulated bf16 is ~8x slower), bf16 with it."""
    for native, dtype in (("0", "float32"), ("1", "bfloat16")):
        monkeypatch.setenv("SPECJET_CPU_NATIVE_BF16", native)
        main(["--model-path", str(tiny_model_dir), "--batch-size", "2", "--context", "8", "--repeats", "1"])
        out = capsys.readouterr().out
        assert f"\n# {dtype}, batch 2," in out
        assert ("no native bf16" in out) == (native == "0")


def test_bench_step_several_node_counts_take_turns(tiny_model_dir, capsys):
    """--nodes 1 4: both steps in one process, the verify's line with its ratio to the decode step."""
    results = main(["--model-path", str(tiny_model_dir), "--batch-size", "2", "--context", "12",
                    "--nodes", "1", "4", "--repeats", "2", "--dtype", "float32"])
    assert set(results) == PATHS
    for by_nodes in results.values():
        assert set(by_nodes) == {1, 4}
        assert all(0 < r["min_s"] <= r["median_s"] <= r["max_s"] for r in by_nodes.values())
    out = capsys.readouterr().out
    assert "12 cached tokens per request, 1 new token(s)" in out and "12 cached tokens per request, 4 new token(s)" in out
    verify = out.split("4 new token(s) per request")[1]
    assert "/ N=1" in verify
    for name, by_nodes in results.items():
        line = next(l for l in verify.splitlines() if l.startswith(name + " "))
        ratio = by_nodes[4]["median_s"] / by_nodes[1]["median_s"]
        paired = by_nodes[4]["paired_ratio"]
        assert line.split()[-2:] == [f"{ratio:.2f}x", f"{paired:.2f}x"], line
        assert "paired_ratio" not in by_nodes[1]


def test_a_verify_step_computes_every_nodes_logits_as_the_engines_verify_does(tiny_model_dir, monkeypatch):
    """A verify checks each node's children against that node's logits, so its step computes all N rows'
    logits (the LM head's share of a verify); a decode step computes its token's."""
    from specjet.models.llama import LlamaForCausalLM
    from specjet.models.runner import ModelRunner

    rows = []
    real = ModelRunner.forward

    def forward(self, batch):
        out = real(self, batch)
        rows.append((batch.mode.name, batch.input_ids.shape[0], None if out.logits is None else out.logits.shape[0]))
        return out

    lists = []
    real_lists = LlamaForCausalLM.forward_lists

    def forward_lists(self, ids, *args, **kwargs):
        out = real_lists(self, ids, *args, **kwargs)
        lists.append((len(ids), out.logits.shape[0]))
        return out

    monkeypatch.setattr(ModelRunner, "forward", forward)
    monkeypatch.setattr(LlamaForCausalLM, "forward_lists", forward_lists)
    main(["--model-path", str(tiny_model_dir), "--batch-size", "2", "--context", "6", "--nodes", "1", "5",
          "--repeats", "1", "--dtype", "float32"])
    steps = {(mode, tokens, logits) for mode, tokens, logits in rows if mode != "EXTEND"}
    assert steps == {("DECODE", 2, 2), ("VERIFY", 10, 10)}
    assert set(lists) == ({(2, 2), (10, 10)} if "lists" in PATHS else set())

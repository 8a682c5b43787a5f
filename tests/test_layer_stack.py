"""The decoder layers as one C++ call (kernels/layer_stack.py, csrc/layer_stack.cpp) against the Python
loop over the same layers: the same kernels in the same order, so the same bits: logits, captured
hidden states and every KV slot written. Each test runs the same forwards twice in one process, once
with the stack and once without, and checks that the stack really ran (or, for a prefix cascade,
really stood aside).
"""
from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_model_dir
from model_harness import count_stack_runs

from specjet.kernels import cpu_ops
from specjet.kernels.linear import PackedLinear
from specjet.models import llama
from specjet.models.forward_batch import FeatureLayers, ForwardBatch, ForwardMode

pytestmark = pytest.mark.skipif(cpu_ops.extension() is None, reason="the C++ CPU ops are not built")


def make_runner(model_dir, dtype: str, quantization: str | None, slots: int = 512):
    from transformers import AutoConfig

    from specjet.models.config import ModelConfig
    from specjet.models.runner import ModelRunner
    from specjet.models.weights import load_state_dict

    config = ModelConfig.from_hf(AutoConfig.from_pretrained(model_dir))
    return ModelRunner(config, load_state_dict(model_dir), dtype, "cpu", slots, 0.0, 1, quantization=quantization)


@pytest.fixture
def stack_calls(monkeypatch):
    """How many forwards the stack ran (run_layer_stack returned a result) and stood aside (None)."""
    return count_stack_runs(monkeypatch)


def forward(runner, table, ids, kv_lens, q_lens, mode, mask=None, capture=None):
    """Request b's new tokens are its positions kv_len - q_len .. kv_len - 1, in slots table[b, p]."""
    positions = torch.cat([torch.arange(k - q, k) for k, q in zip(kv_lens, q_lens)])
    rows = torch.cat([torch.full((q,), b) for b, q in enumerate(q_lens)])
    batch = ForwardBatch.build(
        mode, input_ids=ids[rows, positions], positions=positions, out_cache_loc=table[rows, positions],
        req_to_token=table, req_pool_indices=torch.arange(len(q_lens)), kv_lens=torch.tensor(kv_lens),
        q_lens=torch.tensor(q_lens), custom_mask=mask, logits="all", capture_hidden=capture)
    return runner.forward(batch)


def tree_mask(batch: int, q_len: int, gen) -> torch.Tensor:
    mask = torch.rand(batch, q_len, q_len, generator=gen) < 0.5
    return (mask | torch.eye(q_len, dtype=torch.bool)) & torch.tril(torch.ones(q_len, q_len, dtype=torch.bool))


def workload(runner, use_stack: bool) -> list[torch.Tensor]:
    """A prefill of three requests of different lengths (feature layers captured), a tree verify of 5
    nodes each (two layers captured), then one capturing only the first layer and one capturing none
    (later layers add the MLP output in their input norm); every output and the KV pools afterwards."""
    model = runner.model
    stack = model.layer_stack
    model.layer_stack = stack if use_stack else None
    runner.kv_cache.k.zero_()
    runner.kv_cache.v.zero_()
    gen = torch.Generator().manual_seed(3)
    table = (torch.arange(3 * 40).view(3, 40) + 1)[:, torch.randperm(40, generator=gen)]  # scattered slots
    ids = torch.randint(0, model.config.vocab_size, (3, 40), generator=gen)
    last = model.config.num_layers - 1
    try:
        pre = forward(runner, table, ids, [17, 5, 30], [17, 5, 30], ForwardMode.EXTEND,
                      capture=FeatureLayers((0, last)))
        ver = forward(runner, table, ids, [22, 10, 35], [5, 5, 5], ForwardMode.VERIFY, mask=tree_mask(3, 5, gen),
                      capture=(last, 0))
        first = forward(runner, table, ids, [25, 13, 37], [3, 3, 2], ForwardMode.VERIFY, mask=tree_mask(3, 3, gen),
                        capture=(0,))
        plain = forward(runner, table, ids, [28, 16, 39], [3, 3, 2], ForwardMode.VERIFY, mask=tree_mask(3, 3, gen))
    finally:
        model.layer_stack = stack
    return [pre.logits, pre.hidden, ver.logits, ver.layer_hidden[0], ver.layer_hidden[last], first.logits,
            first.layer_hidden[0], plain.logits, runner.kv_cache.k.clone(), runner.kv_cache.v.clone()]


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and x.shape == y.shape, i
        assert torch.equal(x, y), f"output {i} differs: max |d| {(x.float() - y.float()).abs().max().item()}"


@pytest.mark.parametrize("dtype,quantization", [("float32", None), ("bfloat16", None), ("float32", "int8"),
                                                ("float32", "int4"), ("bfloat16", "int8")])
def test_the_stack_gives_the_python_loops_bits(tiny_model_dir, stack_calls, dtype, quantization):
    runner = make_runner(tiny_model_dir, dtype, quantization)
    assert runner.model.layer_stack is not None and len(runner.model.layer_stack) == runner.config.num_layers
    with_stack = workload(runner, True)
    assert stack_calls == {"ran": 4, "aside": 0, "lists": 0}
    assert_same(with_stack, workload(runner, False))
    assert with_stack[0].abs().sum() > 0 and with_stack[8].abs().sum() > 0  # something was computed and written


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory, default_model_dir):
    """Projections wide enough that a verify's GEMMs run on a team of threads (csrc/qgemm.cpp's quantize_and_run,
    csrc/cpu_ops.h's run_team: hidden 256, so a 15-row call has 120 activation blocks and q|k|v's 32 column groups
    are two threads' worth), where the stack runs its norms, RoPE and SiLU inside the projections' teams."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("wide-llama"), default_model_dir, hidden_size=256,
                               intermediate_size=1024, weight_std=0.05)


@pytest.mark.parametrize("dtype,quantization", [("float32", "int4"), ("float32", "int8"), ("bfloat16", None),
                                                ("float32", None)])
@pytest.mark.parametrize("threads", [2, 3])
def test_row_ops_in_a_projections_team_give_the_python_loops_bits(wide_model_dir, stack_calls, monkeypatch, request,
                                                                  dtype, quantization, threads):
    """Quantized weights on float32 rows, bf16 weights on specjet's VDPBF16PS kernel (bf16 rows) and float32 weights on
    specjet's float32 GEMM."""
    if dtype == "float32" and quantization is None:
        from specjet.kernels import fp32_gemm

        if fp32_gemm.default_isa() == "onednn":
            pytest.skip("no float32 GEMM of specjet's here")
    elif quantization is None:
        from specjet.kernels import bf16_gemm

        if "avx512_bf16" not in bf16_gemm.supported_isas():
            pytest.skip("this CPU does not run the avx512_bf16 bf16 GEMM")
        request.addfinalizer(bf16_gemm.default_isa.cache_clear)
        monkeypatch.setenv(bf16_gemm.ISA_ENV, "avx512_bf16")
        bf16_gemm.default_isa.cache_clear()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        runner = make_runner(wide_model_dir, dtype, quantization)
        teams = cpu_ops.extension().team_runs()
        with_stack = workload(runner, True)
        assert stack_calls == {"ran": 4, "aside": 0, "lists": 0}
        assert cpu_ops.extension().team_runs() > teams  # the row ops did run in a projection's team
        assert_same(with_stack, workload(runner, False))
        torch.set_num_threads(1)  # every call on the calling thread: no team
        assert_same(with_stack, workload(runner, True))
    finally:
        torch.set_num_threads(previous)
    assert with_stack[0].abs().sum() > 0 and with_stack[8].abs().sum() > 0


@pytest.mark.parametrize("bf16_gemm_isa", ["onednn", "avx512_bf16", "amx"])
def test_bf16_weights_on_each_gemm_give_the_python_loops_bits(tiny_model_dir, stack_calls, monkeypatch, request,
                                                              bf16_gemm_isa):
    """bf16 projections on oneDNN's plans and on each of specjet's bf16 kernels this CPU runs: the stack
    calls the operand the Python loop calls."""
    from specjet.kernels import bf16_gemm

    if bf16_gemm_isa not in bf16_gemm.supported_isas():
        pytest.skip(f"this CPU does not run the {bf16_gemm_isa} bf16 GEMM")
    request.addfinalizer(bf16_gemm.default_isa.cache_clear)
    monkeypatch.setenv(bf16_gemm.ISA_ENV, bf16_gemm_isa)
    bf16_gemm.default_isa.cache_clear()
    runner = make_runner(tiny_model_dir, "bfloat16", None)
    kind = PackedLinear if bf16_gemm_isa == "onednn" else bf16_gemm.Bf16Linear
    assert all(isinstance(m.packed, kind) for m in runner.model.modules() if isinstance(m, llama.Linear))
    with_stack = workload(runner, True)
    assert stack_calls == {"ran": 4, "aside": 0, "lists": 0}
    assert_same(with_stack, workload(runner, False))


def test_a_float_weights_row_plan_is_followed_chunk_by_chunk(tiny_model_dir, stack_calls, onednn_float32):
    """Projections on oneDNN whose plan pads calls below 2 rows and splits calls above 3 (PackedLinear's chunks):
    the stack's padding, slicing and concatenation give every row the loop's bits."""
    runner = make_runner(tiny_model_dir, "float32", None)
    planned = [m.packed for m in runner.model.modules() if isinstance(m, llama.Linear)]
    assert planned and all(isinstance(p, PackedLinear) for p in planned)
    for packed in planned:
        packed.min_rows, packed.max_rows = 2, 3
    runner.model.use_native_ops()  # rebuilds the stack from the changed operands
    with_stack = workload(runner, True)
    assert stack_calls["ran"] == 4
    assert_same(with_stack, workload(runner, False))


def test_requests_sharing_cached_slots_take_the_stack_with_the_bits_of_their_own_slots(tiny_model_dir, stack_calls):
    """Three requests holding the same 1,100 cached slots (a prefix-cache hit) run through the stack,
    the C++ attention reading the shared keys in place (no cascade), and a decode step gives each the
    bits it gets with its prefix in slots of its own."""
    runner = make_runner(tiny_model_dir, "float32", None, slots=4 * 1104)
    shared, gen = 1100, torch.Generator().manual_seed(8)
    prompt = torch.randint(0, runner.config.vocab_size, (shared + 1,), generator=gen)
    ids = torch.stack([torch.cat([prompt[:shared], torch.tensor([t])]) for t in (11, 12, 13)])
    own = torch.arange(1, 3 * (shared + 1) + 1).view(3, shared + 1)  # no slot shared
    common = own.clone()
    common[:, :shared] = own[0, :shared]  # the prefix in request 0's slots for all three
    results = []
    for table in (common, own):
        runner.kv_cache.k.zero_()
        runner.kv_cache.v.zero_()
        for b in range(3 if table is own else 1):  # prefill each prefix (shared: once)
            forward(runner, table[b:b + 1], ids[b:b + 1], [shared], [shared], ForwardMode.EXTEND)
        before = stack_calls["ran"]
        results.append(forward(runner, table, ids, [shared + 1] * 3, [1, 1, 1], ForwardMode.DECODE).logits)
        assert stack_calls["ran"] == before + 1
    assert torch.equal(results[0], results[1])


def test_the_stack_goes_with_the_native_ops_and_with_reloaded_weights(tiny_model_dir):
    from specjet.models.weights import load_state_dict

    runner = make_runner(tiny_model_dir, "float32", None)
    model = runner.model
    assert model.layer_stack is not None
    model.use_native_ops(False)
    assert model.layer_stack is None
    model.use_native_ops()
    assert model.layer_stack is not None
    model.load_weights(load_state_dict(tiny_model_dir))
    assert model.layer_stack is None, "a stack holding the old packed weights must not survive a reload"


def test_an_operand_without_a_cpp_form_leaves_the_loop(tiny_model_dir):
    """A projection with no inference operand (packed None, as in training) has no C++ form."""
    runner = make_runner(tiny_model_dir, "float32", None)
    runner.model.layers[1].mlp.down_proj.packed = None
    runner.model.use_native_ops()
    assert runner.model.layer_stack is None


def test_the_stack_refuses_bad_arguments_before_writing_anything(tiny_model_dir):
    """A KV pool of another depth, a capture list out of range or out of order: a clear error, and
    no layer has run (the pool is untouched)."""
    runner = make_runner(tiny_model_dir, "float32", None)
    stack, layers, cfg = runner.model.layer_stack, runner.config.num_layers, runner.config
    x = torch.ones(1, cfg.hidden_size)
    cos, sin = torch.ones(1, cfg.head_dim // 2), torch.zeros(1, cfg.head_dim // 2)
    one, zero = torch.ones(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    k, v = runner.kv_cache.k, runner.kv_cache.v
    k.zero_()
    v.zero_()

    def run(k_pool, v_pool, capture, kv_indices=one.view(1, 1), kv_lens=one, q_lens=one, q_starts=zero, mask=None):
        return stack.run(x, cos, sin, k_pool, v_pool, one, kv_indices, kv_lens, q_lens, q_starts, mask, cpu_ops.isa(),
                         capture)

    wrong = torch.zeros(layers + 1, 8, cfg.num_kv_heads, cfg.head_dim)
    with pytest.raises(RuntimeError, match="KV caches"):
        run(wrong, wrong, [])
    for capture in ([layers], [-1], [1, 0], [0, 0]):
        with pytest.raises(RuntimeError, match="capture must list increasing layer indices"):
            run(k, v, capture)
    # The attention's metadata is checked before layer 0 writes its keys and values (slot 1, in bounds): a slot
    # outside the pool, a query longer than its context, a start past the tokens, a mask of another shape.
    slots = k.shape[1]
    bad_metadata = [({"kv_indices": torch.tensor([[slots]])}, "outside the cache"),
                    ({"kv_lens": torch.zeros(1, dtype=torch.int64)}, "outside its tensors"),
                    ({"q_starts": one}, "outside its tensors"),
                    ({"mask": torch.ones(2, 1, 1, dtype=torch.bool)}, "custom_mask")]
    for metadata, message in bad_metadata:
        with pytest.raises(RuntimeError, match=message):
            run(k, v, [], **metadata)
    assert k.abs().sum() == 0 and v.abs().sum() == 0, "a refused call wrote the KV pools"
    out, taken = run(k, v, [0, layers - 1])  # the same call with a good capture list runs
    assert len(taken) == 2 and torch.equal(taken[1], out) and k.abs().sum() > 0


@pytest.mark.parametrize("kwargs", [{}, {"speculative_algorithm": "NGRAM", "page_size": 16},
                                    {"speculative_algorithm": "NGRAM", "disable_overlap_schedule": True},
                                    {"speculative_algorithm": "EAGLE"}], ids=["plain", "ngram-p16", "ngram-no-overlap",
                                                                              "eagle"])
def test_the_engine_with_the_stack_gives_the_ids_of_the_python_loop(tiny_model_dir, tmp_path, monkeypatch,
                                                                     stack_calls, kwargs):
    """Through the engine (scheduler, overlap loop, speculation): greedy ids with the stack equal plain
    decoding's ids through the Python loop; the KV allocator's invariant holds after each."""
    import specjet
    from test_spec_eagle import copy_head

    prompts = [[1, 9, 42, 42, 7, 100 + i, 42, 7] * (2 + i) for i in range(3)]
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    with monkeypatch.context() as loop_only:
        loop_only.setattr(llama, "build_layer_stack", lambda *args, **kw: None)
        with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=2048) as eng:
            expected = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
            eng.check_kv_invariant()
    assert stack_calls["ran"] == 0
    if kwargs.get("speculative_algorithm") == "EAGLE":
        kwargs = dict(kwargs, speculative_draft_model_path=str(copy_head(tmp_path, tiny_model_dir, expected)))
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=2048, **kwargs) as eng:
        got = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
        eng.check_kv_invariant()
    assert stack_calls["ran"] > 0 and stack_calls["lists"] > 0  # the CPU's steps go from host lists
    assert got == expected


def test_a_projection_the_cpp_side_refuses_leaves_the_loop_with_a_warning(tiny_model_dir, monkeypatch, caplog):
    """E.g. a torch whose oneDNN linear op has another signature: the stack's construction fails, is
    logged, and the model runs its Python loop (with the same bits) instead of failing forwards."""
    runner = make_runner(tiny_model_dir, "float32", None)

    def refuse(*args):
        raise RuntimeError("mkldnn::_linear_pointwise: unexpected signature")

    monkeypatch.setattr(cpu_ops.extension(), "float_projection", refuse)
    monkeypatch.setattr(cpu_ops.extension(), "fp32_projection", refuse)  # float32 weights on specjet's GEMM
    with caplog.at_level("WARNING"):
        runner.model.use_native_ops()
    assert runner.model.layer_stack is None
    assert "the C++ layer stack is off" in caplog.text and "unexpected signature" in caplog.text

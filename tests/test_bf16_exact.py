"""Batch invariance: a row's logits depend only on its token, its position and the KV it sees - never on
the other rows of the forward or on the mode (EXTEND / DECODE / VERIFY). Lossless speculative decoding
in bf16 rests on it: a verify forward runs a whole draft tree per request where plain decoding runs one
row, and bf16 kernels that round differently at another row count flip argmaxes."""
from __future__ import annotations

import pytest
import torch

import specjet
from model_harness import load_runner, tree_mask
from specjet.kernels.cpu_features import has_native_bf16
from specjet.models.forward_batch import ForwardBatch, ForwardMode

PREFIXES = [[1, 520, 3303, 28, 2185, 16, 4785, 1024, 88, 9, 701, 45, 6000, 13, 300],
            [1, 77, 1200, 5, 9000, 31, 64],
            [1, 4000, 12, 812, 7, 7, 19, 2222, 301, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52]]
CHAIN = [700, 701, 702, 703]  # the accepted path: decoded one token at a time, or as tree nodes
MAX_LEN = 64


class Pool:
    """A request-to-token table over one runner's KV cache; row r owns slots [1 + r*MAX_LEN, ...)."""

    def __init__(self, runner, rows: int):
        self.runner = runner
        self.table = (1 + torch.arange(rows * MAX_LEN)).view(rows, MAX_LEN)

    def forward(self, mode, reqs, custom_mask=None):
        """reqs: (row, start, ids, positions or None) per request; the new tokens write slots
        table[row, start:start + len(ids)]. Returns the fp32 logits of every new token, flat (on the CPU)."""
        ids = [t for _, _, toks, _ in reqs for t in toks]
        positions = torch.cat([torch.tensor(pos) if pos is not None else torch.arange(start, start + len(toks))
                               for _, start, toks, pos in reqs])
        slots = torch.cat([self.table[row, start:start + len(toks)] for row, start, toks, _ in reqs])
        on = self.runner.device
        batch = ForwardBatch.build(
            mode, input_ids=torch.tensor(ids, device=on), positions=positions.to(on), out_cache_loc=slots.to(on),
            req_to_token=self.table.to(on), req_pool_indices=torch.tensor([row for row, *_ in reqs], device=on),
            kv_lens=torch.tensor([start + len(toks) for _, start, toks, _ in reqs], device=on),
            q_lens=torch.tensor([len(toks) for _, _, toks, _ in reqs], device=on),
            custom_mask=None if custom_mask is None else custom_mask.to(on), logits="all")
        return self.runner.forward(batch).logits.cpu()


def tree_with_chain(chain: list[int]):
    """A draft tree whose path root->chain[1]->chain[2]->... interleaves with decoy branches, so each
    path node's ancestors are not contiguous among the tree's nodes. Returns tokens, parents, path nodes."""
    tokens, parents, path = [chain[0]], [-1], [0]
    for depth, tok in enumerate(chain[1:], start=1):
        for decoy in range(2):  # siblings of the path node, placed before it, each with a child
            tokens.append(900 + 10 * depth + decoy)
            parents.append(path[-1])
            tokens.append(950 + 10 * depth + decoy)
            parents.append(len(tokens) - 2)
        tokens.append(tok)
        parents.append(path[-1])
        path.append(len(tokens) - 1)
    return tokens, parents, path


# The CUDA runs (a lent GPU: scripts/gpu_check.sh) check the Triton attention and RMSNorm and the
# projections' row plans there.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module", params=[(d, dev) for dev in DEVICES for d in ("bfloat16", "float32")],
                ids=lambda p: "-".join(p))
def runner(request, tiny_model_dir):
    dtype, device = request.param
    return load_runner(tiny_model_dir, dtype=dtype, device=device)


def test_logits_do_not_depend_on_batch_or_mode(runner):
    pool = Pool(runner, rows=12)
    # Prefill every prefix alone in rows 0-2, and all three in one EXTEND batch in rows 3-5.
    alone_prefill = [pool.forward(ForwardMode.EXTEND, [(r, 0, p, None)]) for r, p in enumerate(PREFIXES)]
    batched_prefill = pool.forward(ForwardMode.EXTEND, [(3 + r, 0, p, None) for r, p in enumerate(PREFIXES)])
    assert torch.equal(torch.cat(alone_prefill), batched_prefill), "EXTEND logits changed with the batch"

    # Rows 6-8 share rows 0-2's prefix slots; from there on each row has its own slots.
    for r, p in enumerate(PREFIXES):
        pool.table[6 + r, :len(p)] = pool.table[r, :len(p)]
        pool.table[9 + r, :len(p)] = pool.table[r, :len(p)]

    # Reference: request 0 decodes CHAIN alone, one DECODE row per step (row 0).
    n0 = len(PREFIXES[0])
    alone = torch.cat([pool.forward(ForwardMode.DECODE, [(0, n0 + i, [t], None)]) for i, t in enumerate(CHAIN)])

    # The same steps inside multi-request DECODE batches (rows 6, 1, 2 decoding other tokens).
    batched = []
    for i, t in enumerate(CHAIN):
        reqs = [(1, len(PREFIXES[1]) + i, [800 + i], None), (6, n0 + i, [t], None),
                (2, len(PREFIXES[2]) + i, [810 + i], None)]
        batched.append(pool.forward(ForwardMode.DECODE, reqs)[1:2])
    assert torch.equal(torch.cat(batched), alone), "DECODE logits changed with the batch size"

    # The chain as one EXTEND after the cached prefix (row 9).
    extend = pool.forward(ForwardMode.EXTEND, [(9, n0, CHAIN, None)])
    assert torch.equal(extend, alone), "EXTEND logits differ from DECODE logits"

    # The chain as the path of a draft tree with decoy branches, verified together with another
    # request's tree (rows 10 and 11 share rows 0's and 1's prefixes).
    pool.table[10, :n0] = pool.table[0, :n0]
    pool.table[11, :len(PREFIXES[1])] = pool.table[1, :len(PREFIXES[1])]
    tokens, parents, path = tree_with_chain(CHAIN)
    other_tokens, other_parents, _ = tree_with_chain([805, 806, 807])
    depth = tree_mask(parents).sum(-1) - 1
    other_depth = tree_mask(other_parents).sum(-1) - 1
    n = max(len(tokens), len(other_tokens))
    mask = torch.zeros(2, n, n, dtype=torch.bool)
    mask[0, :len(other_tokens), :len(other_tokens)] = tree_mask(other_parents)
    mask[1, :len(tokens), :len(tokens)] = tree_mask(parents)
    n1 = len(PREFIXES[1]) + len(CHAIN)  # row 1 has decoded len(CHAIN) tokens
    pool.table[11, len(PREFIXES[1]):n1] = pool.table[1, len(PREFIXES[1]):n1]
    verify = pool.forward(ForwardMode.VERIFY, [(11, n1, other_tokens, (n1 + other_depth).tolist()),
                                               (10, n0, tokens, (n0 + depth).tolist())], custom_mask=mask)
    tree_logits = verify[len(other_tokens):][torch.tensor(path)]
    assert torch.equal(tree_logits, alone), "VERIFY logits of the tree's path differ from DECODE logits"


def test_linear_rows_are_invariant(runner):
    """Every projection of the model: a row's output is the same alone and among 1..40 other rows."""
    torch.manual_seed(0)
    for name, module in runner.model.named_modules():
        if not hasattr(module, "packed") or module.packed is None:
            continue
        x = torch.randn(41, module.weight_t.shape[0]).to(module.weight_t.dtype).to(module.weight_t.device)
        alone = torch.cat([module(x[i:i + 1]) for i in range(41)])
        for rows in (2, 3, 12, 33, 41):
            assert torch.equal(module(x[:rows]), alone[:rows]), f"{name}: rows changed with {rows} rows per call"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1536, 576), (576, 1536), (576, 576), (576, 192), (576, 49152)])
def test_linear_rows_are_invariant_at_the_default_models_shapes(shape, dtype, device):
    """The default model's projection shapes, with inputs other than the plan check's (another seed,
    256 distinct rows): a row alone equals the same row among 2..256. A lone bf16 row of the
    1536 -> 576 projection once took a kernel 1 ulp apart on AVX-512 BF16 (Zen 4), which a 16-row
    check missed; speculative output then differed from plain decoding under a JSON schema."""
    from specjet.kernels.linear import pack_weight

    gen = torch.Generator().manual_seed(7)
    weight_t = (0.05 * torch.randn(*shape, generator=gen)).to(dtype).to(device)
    packed = pack_weight(weight_t)
    x = torch.randn(256, shape[0], generator=gen).to(dtype).to(device)
    # The LM head: fewer rows, same property (its 24 rows still end a 17-row call with a short one).
    rows = 256 if shape[1] < 10000 else 24
    with torch.inference_mode():
        alone = torch.cat([packed(x[i:i + 1]) for i in range(rows)])
        for m in sorted({min(m, rows) for m in (2, 3, 17, 64, 128, 256)}):
            calls = torch.cat([packed(x[i:min(i + m, rows)]) for i in range(0, rows, m)])
            assert torch.equal(calls, alone), f"{shape} {dtype}: rows changed with {m} rows per call"


# ---------------------------------------------------------------- end to end on the real default model
QUESTIONS = [
    "Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for her "
    "friends every day with four. She sells the remainder at the farmers' market daily for $2 per fresh duck egg. "
    "How much in dollars does she make every day at the farmers' market?",
    "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total does it take?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue, and mention Rayleigh scattering by name please.",
    "Copy this list exactly: red, green, blue, red, green, blue, red, green, blue.",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn?",
]
PARAMS = {"temperature": 0, "max_new_tokens": 48}


@pytest.mark.e2e
@pytest.mark.skipif(not has_native_bf16(), reason=(
    "no native bf16 on this CPU: every bf16 matmul is emulated (~8x fp32), so three bf16 engines on the "
    "default model take tens of minutes, and dtype auto runs fp32 here (test_e2e_spec checks that); "
    "the tiny-model tests above check the bf16 kernels' batch invariance on every CPU"))
def test_bf16_speculative_greedy_equals_plain_bf16():
    outputs = {}
    for algo in (None, "EAGLE", "NGRAM"):
        kwargs = {"disable_guided_drafting": True} if algo is None else {"speculative_algorithm": algo}
        with specjet.Engine(max_total_tokens=8192, dtype="bfloat16", **kwargs) as eng:
            prompts = [eng.apply_chat_template(q) for q in QUESTIONS]
            outputs[algo] = [o["output_ids"] for o in eng.generate(prompts, PARAMS)]
            if algo is not None:
                eng.check_kv_invariant()
    assert outputs["EAGLE"] == outputs[None]
    assert outputs["NGRAM"] == outputs[None]


@pytest.mark.e2e
@pytest.mark.skipif(not has_native_bf16(), reason="no native bf16 on this CPU: see the test above")
def test_bf16_speculation_under_the_demos_schema_equals_plain():
    """make demo's request in bf16: EAGLE and NGRAM give plain decoding's ids (they parted at token 13
    on a Zen 4 CPU before lone rows were padded to two)."""
    from specjet.demo import PROMPT, SCHEMA

    ids = {}
    for algo in (None, "EAGLE", "NGRAM"):
        kwargs = {"disable_guided_drafting": True} if algo is None else {"speculative_algorithm": algo}
        with specjet.Engine(max_total_tokens=4096, dtype="bfloat16", **kwargs) as eng:
            out = eng.generate(eng.apply_chat_template(PROMPT),
                               {"json_schema": SCHEMA, "temperature": 0, "max_new_tokens": 128})
            ids[algo] = out["output_ids"]
            eng.check_kv_invariant()
    assert ids["EAGLE"] == ids[None] and ids["NGRAM"] == ids[None]

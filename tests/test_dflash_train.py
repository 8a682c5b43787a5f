"""DFlash training on a tiny random target: anchors and labels, a short run that lowers the loss and
resumes exactly, the held-out acceptance against drafts from the dense oracle of
test_dflash_model, and the CLI end to end (its draft then runs in a DFLASH engine, losslessly)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import SHARED_DATA
from model_harness import load_runner
from specjet.models.dflash import DFlashDraftModel, DFlashShape, read_dflash_config
from specjet.models.forward_batch import FeatureLayers
from specjet.train import data as D
from specjet.train import dflash_trainer as T
from specjet.train.features import Sequence, extract_features, load_sequences
from test_dflash_model import dense_block_logits

GSM8K_TRAIN = SHARED_DATA / "gsm8k" / "train.jsonl"
BLOCK = 4


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    runner = load_runner(tiny_model_dir, tokens=1024)
    runner.model.requires_grad_(False)
    runner.model.lm_head.packed = None  # as the pipeline does: the draft's logits train through the head
    return runner


@pytest.fixture(scope="module")
def sequences(runner, tiny_model_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    samples = D.gsm8k_human_samples(tokenizer, D.read_jsonl(GSM8K_TRAIN)[:6], max_len=160)
    out = tmp_path_factory.mktemp("dflash-features")
    extract_features(runner, samples, out, "features", shard_size=4, max_tokens=300, capture=FeatureLayers((0,)))
    return load_sequences(out)


def new_draft(runner, seed=0, root_context=False, layers=1) -> DFlashDraftModel:
    torch.manual_seed(seed)
    shape = DFlashShape(layers, (0,), BLOCK, runner.config.vocab_size - 1, root_context)
    return DFlashDraftModel(runner.config, shape).bind_target(runner.model)


def test_anchors_and_labels():
    seqs = [Sequence(torch.arange(10, 20), torch.zeros(10, 1), 4, "x"), Sequence(torch.arange(5), torch.zeros(5, 1), 4, "x")]
    anchors = T.sample_anchors(seqs, 3, torch.Generator().manual_seed(0))
    a = anchors[0].tolist()
    assert len(set(a)) == 3 and all(4 <= x <= 8 for x in a) and a == sorted(a)  # reply positions with a next token
    assert anchors[1].tolist() == [-1, -1, -1]  # the second has no reply position with a token after it
    ids, _, lengths = T.collate(seqs)
    labels, valid = T.block_labels(ids, lengths, torch.tensor([[8, -1], [0, 3]]), BLOCK)
    assert labels[0, 0, :1].tolist() == [19] and valid[0, 0].tolist() == [True, False, False]  # the sequence ends
    assert not valid[0, 1].any()
    assert labels[1, 0].tolist() == [1, 2, 3] and valid[1, 1].tolist() == [True, False, False]


def test_known_prefixes_are_drawn_within_the_block_and_not_scored(runner, sequences):
    """``sample_known`` gives a fraction of the real blocks 1 .. S - 2 known tokens, leaving a scored
    position inside the sequence; their blocks hold the text's tokens there; the loss ignores a known
    position's label but not the first mask's; without a rate nothing is drawn."""
    gen = torch.Generator().manual_seed(0)
    anchors = torch.tensor([[0, 3, 5, -1]] * 200)
    lengths = torch.full((200,), 8)
    assert T.sample_known(anchors, lengths, 0.0, BLOCK, gen) is None
    state = gen.get_state()
    known = T.sample_known(anchors, lengths, 0.5, BLOCK, gen)
    assert not torch.equal(gen.get_state(), state)
    assert known.shape == anchors.shape and (known[:, 3] == 0).all()  # a padded anchor knows nothing
    assert 0.35 < float((known[:, :3] > 0).float().mean()) < 0.65  # about half of the real blocks
    assert known.max() == BLOCK - 2 and (known[:, 2] <= 1).all()  # anchor 5 of 8 tokens: 1 known leaves position 7
    ids = torch.arange(100, 108)[None]
    blocks = T.known_block_ids(ids, torch.tensor([[1, 4]]), torch.tensor([[0, 2]]), BLOCK, 99)
    assert blocks.tolist() == [[[101, 99, 99, 99], [104, 105, 106, 99]]]

    draft = new_draft(runner, seed=4)
    seq = sequences[0]
    ids, feats, lengths = T.collate([seq])
    anchors = torch.tensor([[seq.prompt_len, seq.prompt_len + 5]])
    known = torch.tensor([[0, 2]])
    cfg = T.DFlashTrainConfig()
    source = ids.clone()

    def loss(src):
        with torch.no_grad():
            return float(T.batch_loss(draft, ids, feats, lengths, anchors, cfg, src, known)["loss"])

    base = loss(source)
    known_pos, first_mask = seq.prompt_len + 5 + 2, seq.prompt_len + 5 + 3
    changed = source.clone()
    changed[0, known_pos] = (changed[0, known_pos] + 1) % runner.config.vocab_size
    assert loss(changed) == base  # the block holds that token: not scored
    changed[0, first_mask] = (changed[0, first_mask] + 1) % runner.config.vocab_size
    assert loss(changed) != base


@pytest.mark.parametrize("layers", [1, 2])
def test_the_loss_over_scored_rows_is_the_weighted_loss_over_every_block_row(runner, sequences, layers):
    """``batch_loss`` sends only the scored positions past the last layer's attention (its output projection,
    MLP, the norm and the head); its loss, top-1 and accept length equal the position-weighted cross-entropy
    written here over every block row's logits, with known, padded and past-the-end positions weighted 0
    (and the same gradient). Two layers: the first one's every row feeds the second's keys and values."""
    draft = new_draft(runner, seed=5, root_context=True, layers=layers)
    batch = sequences[:3]
    ids, feats, lengths = T.collate(batch)
    anchors = T.sample_anchors(batch, 6, torch.Generator().manual_seed(3))
    anchors[2, 4:] = -1
    anchors[0, -1] = int(lengths[0]) - 2  # its block runs past the sequence's end
    known = torch.zeros_like(anchors)
    known[1, 0], known[0, 2] = 2, 1
    cfg = T.DFlashTrainConfig(decay=3.0)
    source = ids.roll(1, dims=1)  # labels other than the block's own tokens

    got = T.batch_loss(draft, ids, feats, lengths, anchors, cfg, source, known)
    params = [draft.fc.weight_t, draft.layers[-1].mlp.down_proj.weight_t, draft.layers[0].self_attn.qkv_proj.weight_t]
    grads = torch.autograd.grad(got["loss"], params)

    block_ids = T.known_block_ids(ids, anchors, known, BLOCK, draft.shape.mask_token_id)
    logits = draft.forward_train(ids, feats, anchors, None, block_ids)  # [B, A, S - 1, V], every row
    weight, first, accepted, blocks = 0.0, 0, 0, 0
    total = torch.zeros(())
    for b in range(len(batch)):
        for j, a in enumerate(anchors[b].tolist()):
            n_known = int(known[b, j])
            if a < 0:
                continue
            run = 0  # leading drafts equal to their labels
            for k in range(n_known + 1, BLOCK):
                if a + k >= int(lengths[b]):
                    break
                w = torch.exp(torch.tensor(-(k - 1) / 3.0))
                label = int(source[b, a + k])
                total = total + w * F.cross_entropy(logits[b, j, k - 1][None], torch.tensor([label]))
                weight += float(w)
                hit = int(logits[b, j, k - 1].argmax()) == label
                run = run + 1 if hit and run == k - 1 else run
            if n_known == 0:  # top-1 and accept length: blocks without known tokens
                blocks += 1
                first += int(logits[b, j, 0].argmax()) == int(source[b, a + 1])
                accepted += run
    expected = total / weight
    torch.testing.assert_close(got["loss"].detach(), expected.detach(), rtol=1e-5, atol=1e-6)
    for grad, want in zip(grads, torch.autograd.grad(expected, params)):
        assert grad.abs().max() > 0
        torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-7)
    assert float(got["top1"]) == pytest.approx(first / blocks)
    assert float(got["accept_length"]) == pytest.approx(1 + accepted / blocks)


def test_a_distilled_block_position_learns_the_targets_distribution_after_the_position_before(runner, sequences):
    """``distill``: block position k of root a also learns the target's distribution over the draft's columns
    after a + k - 1 (its LM head over the final normed hidden state the features end with), mixed with the
    one-hot label; written out here over every block row, known positions weighted 0."""
    draft = new_draft(runner, seed=7, root_context=True)
    batch = sequences[:3]
    ids, feats, lengths = T.collate(batch)
    anchors = T.sample_anchors(batch, 5, torch.Generator().manual_seed(8))
    known = torch.zeros_like(anchors)
    known[1, 1] = 2
    cfg = T.DFlashTrainConfig(decay=3.0, distill=0.7)
    source = ids.roll(1, dims=1)
    got = T.batch_loss(draft, ids, feats, lengths, anchors, cfg, source, known)["loss"]
    params = [draft.fc.weight_t, draft.layers[0].mlp.down_proj.weight_t]
    grads = torch.autograd.grad(got, params)

    h, head = runner.config.hidden_size, draft.head_weight_t()
    block_ids = T.known_block_ids(ids, anchors, known, BLOCK, draft.shape.mask_token_id)
    logits = draft.forward_train(ids, feats, anchors, None, block_ids)
    total, weight = torch.zeros(()), 0.0
    for b in range(len(batch)):
        for j, a in enumerate(anchors[b].tolist()):
            for k in range(int(known[b, j]) + 1, BLOCK):
                if a < 0 or a + k >= int(lengths[b]):
                    break
                w = torch.exp(torch.tensor(-(k - 1) / 3.0))
                log_probs = logits[b, j, k - 1].log_softmax(-1)
                teacher = (feats[b, a + k - 1, -h:] @ head).softmax(-1)
                total = total - w * (0.3 * log_probs[int(source[b, a + k])] + 0.7 * (teacher * log_probs).sum())
                weight += float(w)
    expected = total / weight
    torch.testing.assert_close(got.detach(), expected.detach(), rtol=1e-5, atol=1e-6)
    for grad, want in zip(grads, torch.autograd.grad(expected, params)):
        assert grad.abs().max() > 0
        torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-7)


def test_padding_the_training_rows_to_a_bucket_changes_no_loss_or_gradient(runner, sequences, monkeypatch):
    """``forward_train`` pads its context and scored rows to a multiple of ``TRAIN_ROW_BUCKET`` (a few
    matmul shapes for oneDNN): the loss and every parameter's gradient equal an unpadded step's."""
    import specjet.models.dflash as M

    batch = sequences[:3]
    ids, feats, lengths = T.collate(batch)
    assert (len(batch) * ids.shape[1]) % M.TRAIN_ROW_BUCKET != 0  # the context rows do get padded
    anchors = T.sample_anchors(batch, 5, torch.Generator().manual_seed(4))
    known = T.sample_known(anchors, lengths, 0.5, BLOCK, torch.Generator().manual_seed(5))
    cfg = T.DFlashTrainConfig()
    results = []
    for bucket in (M.TRAIN_ROW_BUCKET, 1):
        monkeypatch.setattr(M, "TRAIN_ROW_BUCKET", bucket)
        draft = new_draft(runner, seed=6, root_context=True)
        loss = T.batch_loss(draft, ids, feats, lengths, anchors, cfg, ids, known)["loss"]
        params = [p for p in draft.parameters() if p.requires_grad]
        results.append((loss.detach(), torch.autograd.grad(loss, params)))
    (loss_padded, grads_padded), (loss_plain, grads_plain) = results
    torch.testing.assert_close(loss_padded, loss_plain, rtol=1e-6, atol=1e-7)
    assert len(grads_padded) > 5
    for got, expected in zip(grads_padded, grads_plain):  # float sums in another blocking: last bits only
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5 * float(expected.abs().max()))


@pytest.mark.parametrize("flag, bad, good", [
    *[("--known-prefix-rate", rate, 0.3) for rate in ("1.5", "-0.1", "nan", "x")],  # a fraction
    *[("--weight-decay", decay, 0.0) for decay in ("-0.1", "nan", "inf", "x")],  # finite, >= 0
    *[("--distill", weight, 0.5) for weight in ("1.5", "-0.1", "nan")],  # a fraction
])
def test_a_value_out_of_range_is_refused_by_the_parser(flag, bad, good, capsys):
    """Refused before the data and feature stages, not by the trainer or the optimizer after them."""
    from specjet.train.dflash import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args([flag, bad])
    assert flag in capsys.readouterr().err
    assert getattr(build_parser().parse_args([flag, str(good)]), flag[2:].replace("-", "_")) == good


def test_target_labels_are_the_targets_greedy_tokens(runner, sequences):
    """labels="target": position t learns what the target's own forward (run here over the
    sequence) ranks first after ids[:t]; on this reference text that often differs from the text."""
    from model_harness import OneRequest

    seq = sequences[1]
    ids, feats, _ = T.collate([seq])
    greedy = T.target_greedy_ids(new_draft(runner), ids, feats)[0]
    logits = OneRequest(runner).extend(seq.ids.tolist(), logits="all").logits
    expected = logits.argmax(-1)[:-1]
    agree = (greedy[1:] == expected).float().mean()
    assert agree > 0.97, agree  # the features are stored in fp16: a near-tie may flip
    assert greedy[0] == seq.ids[0] and (greedy[1:] != seq.ids[1:]).any()
    # Precomputed once per sequence for training: the same at every reply position (a chunk
    # boundary inside the reply included), the sequence's own ids before.
    first = seq.prompt_len + 1
    (labels,) = T.target_labels(new_draft(runner), [seq], chunk=7)
    assert torch.equal(labels[first:], greedy[first:len(seq.ids)]) and torch.equal(labels[:first], seq.ids[:first])


def test_a_reply_the_target_wrote_greedily_is_its_own_labels(runner, sequences, tmp_path):
    """A ``target_reply`` (the features' own target wrote it greedily) takes its tokens as labels with no pass of
    the head; any other sequence the head's greedy tokens, here reference text they differ from. The kept
    labels are keyed by which sequences are their own: a file of the head's labels is not read for them."""
    import dataclasses

    draft = new_draft(runner)
    seq = sequences[1]
    own = dataclasses.replace(seq, target_reply=True)
    (head,) = T.target_labels(draft, [seq])
    (labels,) = T.target_labels(draft, [own])
    first = seq.prompt_len + 1
    assert torch.equal(labels, seq.ids) and not torch.equal(head[first:], seq.ids[first:])
    path = tmp_path / "labels.safetensors"
    assert torch.equal(T.cached_target_labels(draft, [seq], path)[0], head)
    assert torch.equal(T.cached_target_labels(draft, [own], path)[0], seq.ids)
    assert torch.equal(T.cached_target_labels(draft, [seq], path)[0], head)


def test_only_greedy_unconstrained_requests_write_their_models_greedy_tokens():
    from specjet.train.generate import writes_greedy_choices

    assert writes_greedy_choices({"temperature": 0, "max_new_tokens": 8})
    assert writes_greedy_choices({"temperature": 0.0, "max_new_tokens": 8, "stop": ["Question"], "seed": 3})
    for params in ({"max_new_tokens": 8}, {"temperature": 0.7, "max_new_tokens": 8},
                   {"temperature": 0, "json_schema": {"type": "object"}}, {"temperature": 0, "logit_bias": {"5": 1.0}},
                   {"temperature": 0, "ignore_eos": True}, {"temperature": 0, "regex": "[a-z]+"}):
        assert not writes_greedy_choices(params), params


def test_generated_samples_say_whether_the_engine_wrote_them_greedily(tiny_model_dir, tmp_path):
    """From the request, for a reply just generated and for one read back from the reply cache (which keeps only
    ids, prompt length and source, as before)."""
    import json

    import specjet

    from specjet.train.generate import generate_cached

    prompt = [1, 2, 3, 4]
    cache = tmp_path / "replies.jsonl"
    jobs = {cache: [(prompt, {"temperature": 0, "max_new_tokens": 6}, "a"),
                    (prompt, {"temperature": 0.8, "max_new_tokens": 6, "seed": 1}, "b")]}
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=1024) as engine:
        (fresh,) = generate_cached(lambda: engine, jobs).values()
        engine.check_kv_invariant()
    (cached,) = generate_cached(lambda: pytest.fail("every reply is cached"), jobs).values()
    assert [s.greedy for s in fresh] == [True, False] and cached == fresh
    assert all(set(json.loads(line)) == {"index", "ids", "prompt_len", "source", "params"}
               for line in cache.read_text().splitlines())


def test_a_cached_reply_is_taken_only_for_its_own_sampling_parameters(tmp_path):
    """A JSON instance cached under one schema was taken for a request with the same prompt under another (an edited
    schema, another --jsonschema-dir whose prompt reads the same): the reply cache keeps each request's parameters.
    A record from before they were kept stands for a GSM8K request (no schema) only."""
    import json

    from specjet.train.generate import _read_cache, params_key

    prompt = [1, 2, 3]
    old = {"json_schema": {"type": "object"}, "temperature": 0, "max_new_tokens": 8, "seed": 0}
    new = dict(old, json_schema={"type": "array"})
    greedy = {"temperature": 0, "max_new_tokens": 8}
    cache = tmp_path / "replies.jsonl"
    record = {"index": 0, "ids": prompt + [7, 2], "prompt_len": 3, "source": "json_target"}
    cache.write_text(json.dumps(dict(record, params=params_key(old))) + "\n")
    assert set(_read_cache(cache, [(prompt, old, "json_target")])) == {0}
    assert _read_cache(cache, [(prompt, new, "json_target")]) == {}
    cache.write_text(json.dumps(record) + "\n")  # written before the parameters were kept
    assert _read_cache(cache, [(prompt, old, "json_target")]) == {}
    assert set(_read_cache(cache, [(prompt, greedy, "gsm8k_target")])) == {0}


def test_bf16_collation_keeps_the_fp16_features_values(sequences):
    """Collated in bf16 (the training loop under autocast): float32's collation rounded to bf16, bit for bit,
    zero past each sequence's end."""
    batch = sequences[:3]
    ids, bf, lengths = T.collate(batch, torch.bfloat16)
    ids32, f32, lengths32 = T.collate(batch, torch.float32)
    assert bf.dtype == torch.bfloat16 and torch.equal(ids, ids32) and torch.equal(lengths, lengths32)
    assert torch.equal(bf.view(torch.int16), f32.to(torch.bfloat16).view(torch.int16))
    assert all((bf[i, n:] == 0).all() for i, n in enumerate(lengths.tolist()))
    assert torch.equal(f32[0, :len(batch[0].ids)], batch[0].features.float())


def test_the_label_pass_takes_the_tiles_where_the_cpu_has_them(runner, sequences, monkeypatch):
    """On a CPU with AMX tiles the head's products are three bf16 tile products each (Bf16x3Linear): the labels
    are float32's but for a tie within ~2^-16 of a logit (two kernels: agreement, not bits); elsewhere oneDNN's
    float32."""
    from specjet.kernels.bf16_gemm import bf16x3_available

    draft = new_draft(runner)
    tiles = bf16x3_available()
    assert T.label_kernel(draft) == ("bf16x3" if tiles else "float32")
    if not tiles:
        return
    seqs = sequences[:4]
    with_tiles = torch.cat(T.target_labels(draft, seqs))
    monkeypatch.setattr(T, "label_kernel", lambda model: "float32")
    float32 = torch.cat(T.target_labels(draft, seqs))
    assert (with_tiles == float32).float().mean() >= 0.99


def test_target_labels_are_kept_beside_the_features_for_the_next_run(runner, sequences, tmp_path, monkeypatch):
    """A run's label pass is saved (training writes it beside its checkpoint) and read back by the next
    run over the same sequences; other sequences get their own labels, not the file's."""
    draft = new_draft(runner)
    T.train(draft, sequences, T.DFlashTrainConfig(steps=1, batch_tokens=400, blocks_per_seq=2), tmp_path / "a.pt")
    path = tmp_path / "labels-prompt256.safetensors"
    assert path.is_file()
    real, calls = T.target_labels, []
    monkeypatch.setattr(T, "target_labels", lambda model, seqs: calls.append(len(seqs)) or real(model, seqs))
    seqs = [T.crop_prompt(s, 256) for s in sequences]
    expected = real(draft, seqs)
    cached = T.cached_target_labels(draft, seqs, path)
    assert calls == [] and all(torch.equal(a, b) for a, b in zip(cached, expected))
    fewer = T.cached_target_labels(draft, seqs[1:], path)  # other sequences: computed again, and kept
    assert calls == [len(seqs) - 1] and all(torch.equal(a, b) for a, b in zip(fewer, expected[1:]))
    assert all(torch.equal(a, b) for a, b in zip(T.cached_target_labels(draft, seqs[1:], path), expected[1:]))
    assert calls == [len(seqs) - 1]


def test_training_lowers_the_loss_and_resumes_exactly(runner, sequences, tmp_path, monkeypatch):
    cfg = T.DFlashTrainConfig(steps=80, batch_tokens=400, blocks_per_seq=6, lr=5e-3, warmup_steps=3,
                              checkpoint_every=20, seed=0)
    draft = new_draft(runner)
    result = T.train(draft, sequences, cfg, tmp_path / "a.pt")
    # Reference text from a random target is hard to draft: what it learns in seconds is the text's
    # common tokens, still a clear drop from the untrained draft's ~ln(vocab).
    assert result["final"]["loss"] < 0.85 * result["first"]["loss"], result
    assert result["final"]["top1"] > result["first"]["top1"] and result["final"]["accept_length"] > 1.0

    calls = {"n": 0}
    real = T.batch_loss

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 33:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(T, "batch_loss", flaky)
    with pytest.raises(KeyboardInterrupt):
        T.train(new_draft(runner), sequences, cfg, tmp_path / "b.pt")
    monkeypatch.setattr(T, "batch_loss", real)
    resumed = new_draft(runner)
    T.train(resumed, sequences, cfg, tmp_path / "b.pt")  # from its step-20 checkpoint
    for (name, p), q in zip(draft.named_parameters(), resumed.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=name)
    with pytest.raises(ValueError, match="another training config"):
        T.train(new_draft(runner), sequences, T.DFlashTrainConfig(steps=5), tmp_path / "b.pt")


@pytest.mark.parametrize("autocast,root_context", [(False, True), (True, True)])
def test_bf16_autocast_and_root_context_train(runner, sequences, autocast, root_context):
    """bf16 matmuls (weights and loss in fp32) and the root-context draft both learn; under
    autocast the labels are still the fp32 target's greedy tokens. Half the steps under autocast: a step's bf16
    products are emulated on a CPU without bf16 instructions (~2 s a step on AVX2), and 20 steps already take the
    loss ~20% down."""
    cfg = T.DFlashTrainConfig(steps=20 if autocast else 40, batch_tokens=400, blocks_per_seq=6, lr=5e-3, warmup_steps=3,
                              seed=0, autocast_bf16=autocast)
    draft = new_draft(runner, root_context=root_context)
    ids, feats, _ = T.collate(sequences[:2])
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        labels = T.target_greedy_ids(draft, ids, feats)
    assert torch.equal(labels, T.target_greedy_ids(draft, ids, feats))
    result = T.train(draft, sequences, cfg, None)
    assert result["final"]["loss"] < 0.9 * result["first"]["loss"], result
    assert all(p.dtype == torch.float32 for p in draft.parameters())


def leading_matches(drafts: list[int], truth: list[int]) -> int:
    n = 0
    while n < min(len(drafts), len(truth)) and drafts[n] == truth[n]:
        n += 1
    return n


def test_acceptance_counts_the_oracles_leading_matches(runner, sequences):
    draft = new_draft(runner, seed=1)
    with torch.no_grad():
        draft.mask_embedding.normal_(0, 1.0)
    seq = sequences[0]
    drafts, accepted = T.draft_every_position(draft, seq, chunk=5)
    first = seq.prompt_len
    assert len(accepted) == len(seq.ids) - 1 - first
    feats = seq.features.float()
    for a in (first, first + 3, len(seq.ids) - 2):
        with torch.no_grad():
            expected = dense_block_logits(draft, runner, feats[:a], torch.arange(a), int(seq.ids[a]), a).argmax(-1)
        assert drafts[a - first].tolist() == expected.tolist()
        assert int(accepted[a - first]) == leading_matches(expected.tolist(), seq.ids[a + 1:a + BLOCK].tolist())
    # After a known token: the drafts of the positions after it, the oracle's with that token in the block.
    drafts, accepted = T.draft_every_position(draft, seq, chunk=5, known=1)
    assert len(accepted) == len(seq.ids) - 2 - first
    for a in (first, len(seq.ids) - 3):
        with torch.no_grad():
            expected = dense_block_logits(draft, runner, feats[:a], torch.arange(a), int(seq.ids[a]), a,
                                          known=[int(seq.ids[a + 1])]).argmax(-1)[1:]
        assert drafts[a - first].tolist() == expected.tolist()
        assert int(accepted[a - first]) == leading_matches(expected.tolist(), seq.ids[a + 2:a + BLOCK].tolist())
    assert set(T.evaluate(draft, sequences[:2], known=2)["all"]["accept_length"]) == {1}
    with pytest.raises(ValueError, match="no drafted position"):
        T.evaluate(draft, sequences[:2], known=3)
    report = T.evaluate(draft, sequences[:2])
    assert set(report) == {"gsm8k_human", "all"} and report["all"]["positions"] > 0
    lengths = list(report["all"]["accept_length"].values())
    assert lengths == sorted(lengths) and all(1.0 <= x <= BLOCK for x in lengths)
    assert "k=3" in T.format_report(report)


def test_the_held_out_acceptance_is_the_chains_not_the_positions(runner):
    """The engine accepts a block's drafts up to the first miss, plus the bonus token: the report must count leading
    matches, never matches anywhere in the block. A hand-built case where the two differ: a draft whose final norm is
    zero gives every logit 0, so every block position drafts column 0 (argmax's first of equals): token 0 (no hot
    vocabulary). The text after the prompt [5] is 0 7 0 0 0 7 0; blocks of 4 (3 drafts) rooted at positions 1..6:

      root pos  next tokens   leading 0s (chain)   0s anywhere (per position)
         1      7 0 0              0                     2
         2      0 0 0              3                     3
         3      0 0 7              2                     2
         4      0 7 0              1                     2
         5      7 0 (end)          0                     1
         6      0   (end)          1                     1

    chain: 7 accepted over 6 blocks, accept length 1 + 7/6 = 2.167 (per position it would read 1 + 11/6 = 2.833);
    cut at 2 drafts: 0+2+2+1+0+1 = 6, 1 + 6/6 = 2.0; cut at 1: 4 blocks start with a hit, 1 + 4/6 = 1.667 = the
    top-1 rate 0.6667 plus the bonus."""
    draft = new_draft(runner)
    with torch.no_grad():
        draft.norm.weight.zero_()
    ids = torch.tensor([5, 0, 7, 0, 0, 0, 7, 0])
    width = 2 * runner.config.hidden_size  # target layer 0 and the final normed hidden state
    seq = Sequence(ids=ids, features=torch.randn(len(ids), width).half(), prompt_len=1, source="hand")
    drafts, accepted = T.draft_every_position(draft, seq)
    assert drafts.tolist() == [[0, 0, 0]] * 6  # the construction: every position drafts token 0
    assert accepted.tolist() == [0, 3, 2, 1, 0, 1]
    report = T.evaluate(draft, [seq])["all"]
    assert report["positions"] == 6
    assert report["accept_length"] == {1: 1.667, 2: 2.0, 3: 2.167}
    assert report["top1"] == 0.6667


def test_cli_end_to_end(tiny_model_dir, tmp_path):
    """Generation through the Engine, features, training, evaluation, the saved draft; a rerun finds
    it all cached; a run from nothing in other caches writes the same draft; the draft drafts in a
    DFLASH engine with the plain engine's ids."""
    import specjet
    from specjet.train.__main__ import main

    flags = ["--json-per-schema", "0",
             "--num-target-replies", "2", "--num-human-replies", "4", "--num-eval", "2", "--num-few-shot-replies", "0",
             "--num-few-shot-eval", "0", "--max-new-tokens", "12", "--max-len", "128", "--steps", "4",
             "--batch-tokens", "512", "--block-size", "4", "--blocks-per-seq", "4", "--num-layers", "1",
             "--warmup-steps", "1", "--threads", "1", "--hot-vocab", "300", "--known-prefix-rate", "0.5",
             "--prev-token-input", "--weight-decay", "0.1", "--distill", "0.5"]

    def recipe(root):
        return ["dflash", "--model-path", str(tiny_model_dir), "--work-dir", str(root / "work"),
                "--data-dir", str(root / "data"), "--out", str(root / "draft"), *flags]

    out = tmp_path / "draft"
    argv = recipe(tmp_path)
    main(argv)
    meta = read_dflash_config(out)
    assert (meta["block_size"], meta["num_layers"], meta["target_layers"], meta["hot_vocab_size"]) == (4, 1, [0], 300)
    assert meta["known_prefix"] is True and meta["prev_token_input"] is True
    training = meta["training"]
    assert training["eval_after_known"]["known"] == 2 and set(training["eval_after_known"]["all"]["accept_length"]) == {"1"}
    assert training["steps"] == 4 and training["data"]["train"]["gsm8k_human"]["sequences"] == 4
    assert training["train_config"]["weight_decay"] == 0.1 and "--weight-decay 0.1" in training["command"]
    assert training["train_config"]["distill"] == 0.5 and "--distill 0.5" in training["command"]
    assert "--target-quantization none" in training["command"]  # "auto", resolved: a float model's own weights
    assert training["data"]["train"]["gsm8k_target"]["sequences"] == 2
    assert set(training["eval"]["all"]["accept_length"]) == {"1", "2", "3"}
    main(argv)  # everything cached: no generation, no features, the finished checkpoint reused
    assert read_dflash_config(out)["training"]["timings_s"]["features"] < 1.0
    # From nothing again, in empty caches: the same draft, byte for byte (the shipped draft is what its
    # recorded command writes; every stage is seeded and greedy).
    again = tmp_path / "again"
    main(recipe(again))
    assert (again / "draft" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()

    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    prompts = ["The cat sat on the mat. The cat", "1 2 3 4 1 2"]
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=1024) as eng:
        expected = [o["output_ids"] for o in eng.generate(prompts, params)]
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=1024, speculative_algorithm="DFLASH",
                        speculative_draft_model_path=str(out), speculative_num_draft_tokens=4) as eng:
        assert [o["output_ids"] for o in eng.generate(prompts, params)] == expected
        eng.check_kv_invariant()


def test_parser_defaults_are_the_shipped_drafts_recipe():
    """`python -m specjet.train dflash` with no flags trains what specjet ships: every flag the shipped
    draft's config records equals the parser's default (the target-derived ones as run() derives them)."""
    from specjet.models.dflash import default_dflash_path, default_target_layers
    from specjet.train.dflash import build_parser

    meta = read_dflash_config(default_dflash_path())
    recorded = meta["training"]["command"].split()
    flags = recorded[recorded.index("dflash") + 1:]
    defaults = vars(build_parser().parse_args([]))
    derived = {"target_layers": " ".join(map(str, default_target_layers(meta["target"]["num_layers"], 5))),
               "mask_token_id": str(meta["target"]["vocab_size"] - 1)}
    checked = set()
    i = 0
    while i < len(flags):
        name, values = flags[i][2:].replace("-", "_"), []
        i += 1
        while i < len(flags) and not flags[i].startswith("--"):
            values.append(flags[i])
            i += 1
        if name.removeprefix("no_") in ("root_context", "prev_token_input", "position_masks"):
            assert defaults[name.removeprefix("no_")] == (not name.startswith("no_"))
            continue
        expected = derived[name] if defaults[name] is None and name in derived else str(defaults[name])
        if name == "target_quantization":  # recorded as resolved: "auto" is the GGUF's blocks for the default model
            assert defaults[name] == "auto"
            expected = "gguf"
        assert " ".join(values) == expected, name
        checked.add(name)
    assert {"num_layers", "steps", "num_target_replies", "json_per_schema", "block_size"} <= checked


def test_a_run_under_another_thread_count_is_another_run():
    """The draft's bits depend on the torch thread count, which its config's command records: a run resumed (or a
    finished one taken again) under another --threads went on from the other count's checkpoint, writing a draft
    that the recorded command does not reproduce. The count names the checkpoint as the other settings do."""
    from specjet.train.dflash import dflash_run_key

    shape = DFlashShape(1, (0,), BLOCK, 7, True)
    cfg = T.DFlashTrainConfig(steps=10)
    assert dflash_run_key(cfg, shape, 300, 2) == dflash_run_key(T.DFlashTrainConfig(steps=10, checkpoint_every=3),
                                                                 shape, 300, 2)
    assert dflash_run_key(cfg, shape, 300, 1) != dflash_run_key(cfg, shape, 300, 2)
    assert dflash_run_key(cfg, shape, 300, 2) != dflash_run_key(T.DFlashTrainConfig(steps=11), shape, 300, 2)

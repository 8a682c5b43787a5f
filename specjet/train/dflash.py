"""``python -m specjet.train dflash``: train a DFlash block draft for a target model on CPU.

The EAGLE trainer's pipeline (train/eagle.py), stage for stage, each cached so a rerun skips what is
done:
  1. data      the same samples (target replies in chat and few-shot form, reference solutions, JSON
               instances, ``--extra-jsonl``), by default from the EAGLE trainer's own data cache, so
               the slow generation is shared (``--data-dir``);
  2. features  the target's residual stream after ``--target-layers`` and its final normed hidden
               state at every position (the draft's context), fp16 shards;
  3. train     random anchors per sequence, many isolated blocks per forward, position-weighted
               block cross-entropy (train/dflash_trainer.py);
  4. evaluate  greedy chain acceptance on held-out target replies, per block cut;
  5. save      the draft (its own weights, fp16) and a config.json with this run's summary.

The defaults are the recipe of the draft shipped in specjet/assets/dflash (bench/RESULTS.md, sessions
18, 32, 33, 34 and 87: one layer, 2,800 target replies, 6,000 steps, each block row reading the token before
it, 30% of the blocks with known tokens, AdamW weight decay 0.3, and for a GGUF model the GGUF file's own
blocks as the target that writes the replies and gives the features, as the engine runs it by default: its
int8 products make the feature stage faster than the float32 target's, which brought the recipe from nothing
under the hour on a 2-core AMD EPYC Zen 4 too, with a draft as good in the engine).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import pathlib
import time

from specjet.arg_types import (block_size, fraction, non_negative_float, non_negative_int, positive_float,
                              positive_int)
from specjet.train.eagle import (_gguf_name, _threads, add_data_arguments, check_flag, check_writable, claim_work_dir,
                                 cli_main, default_work_dir, describe, frozen_target, generate_dtype, target_features,
                                 target_fingerprint, target_quantization, timed_samples)


EVAL_KNOWN = 2  # known tokens of the held-out report's second table


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m specjet.train dflash", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="target model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--work-dir", type=pathlib.Path, default=None,
                   help="cache for features and checkpoints (default: <specjet cache>/train/dflash-<model>-<its "
                        "fingerprint>; a folder that holds another target's data is refused)")
    p.add_argument("--data-dir", type=pathlib.Path, default=None,
                   help="cache of the generated target replies (default: the EAGLE trainer's, "
                        "<specjet cache>/train/eagle-<model>-<its fingerprint>/data)")
    p.add_argument("--out", type=pathlib.Path, default=None, help="where to write the draft (default: <work-dir>/draft)")
    add_data_arguments(p)
    # More target replies than the EAGLE trainer's default: the shipped draft's recipe (each doubling
    # lifted held-out acceptance and narrowed the train/held-out gap; bench/RESULTS.md, sessions 16, 18, 34).
    # The target the draft learns is the one the engine runs by default: a GGUF model's own blocks write its
    # replies and give its features (a faster feature stage than the float32 target's on every CPU measured, and a
    # draft as good in the engine; bench/RESULTS.md, sessions 71 and 87).
    p.set_defaults(num_target_replies=2800, json_per_schema=4, target_quantization="auto")
    model = p.add_argument_group("draft and training")
    model.add_argument("--num-layers", type=positive_int, default=1, help="draft decoder layers")
    model.add_argument("--hot-vocab", type=non_negative_int, default=8192, help="hot token head size (0: the full vocabulary)")
    model.add_argument("--target-layers", type=int, nargs="*", default=None,
                       help="target layers whose residual stream the context reads (default: 5 spread over 1 .. L-3)")
    model.add_argument("--block-size", type=block_size, default=8, help="block tokens, root included")
    model.add_argument("--mask-token-id", type=int, default=None,
                       help="id standing for a mask token in a block (default: the vocabulary's last id; its "
                            "embedding is learned, the id only labels block positions)")
    model.add_argument("--root-context", action=argparse.BooleanOptionalAction, default=True,
                       help="every block row also reads the last verified position's context (specjet's "
                            "addition, models/dflash.py); --no-root-context: DFlash as published")
    model.add_argument("--prev-token-input", action=argparse.BooleanOptionalAction, default=True,
                       help="every block row also reads the token before it (the root, or a known token) through "
                            "its own projection (specjet's addition, models/dflash.py); --no-prev-token-input: "
                            "DFlash as published, whose one-layer draft does not read its own block")
    model.add_argument("--position-masks", action=argparse.BooleanOptionalAction, default=False,
                       help="a mask embedding per block position instead of one for all (specjet's addition, "
                            "models/dflash.py)")
    model.add_argument("--known-prefix-rate", type=fraction, default=0.3,
                       help="fraction of training blocks holding their next 1 .. S-2 tokens after the root in place "
                            "of mask tokens (a grammar's forced text, which the drafter then puts in its blocks); "
                            "0: DFlash's blocks as published")
    model.add_argument("--feature-dtype", default="float32", choices=["float32", "bfloat16"],
                       help="dtype of the target whose features the draft learns from (bfloat16: half the "
                            "stage's time where bf16 is native, but a draft worse held out, bench/RESULTS.md session 43)")
    model.add_argument("--feature-gemm", default="auto", choices=["auto", "float32"],
                       help="how the float32 target's layers multiply: auto: on a CPU with AMX tiles as three bf16 "
                            "tile products each (within ~2^-16 of float32 a product, the features kept in fp16 anyway; "
                            "the stage 1.1-1.4x faster: kernels/bf16_gemm.py's Bf16x3Linear), else oneDNN's float32; "
                            "float32: oneDNN's float32 everywhere")
    model.add_argument("--autocast", default="auto", choices=["auto", "bf16", "off"],
                       help="train with bf16 matmuls (fp32 weights and loss); auto: where the CPU has native bf16")
    model.add_argument("--steps", type=positive_int, default=6000)
    model.add_argument("--batch-tokens", type=positive_int, default=2048)
    model.add_argument("--max-prompt", type=positive_int, default=256, help="prompt tokens kept before each reply")
    model.add_argument("--blocks-per-seq", type=positive_int, default=32, help="random anchors per sequence per step")
    model.add_argument("--decay", type=positive_float, default=4.0, help="loss weight of block position k: exp(-(k-1)/decay)")
    model.add_argument("--window", type=positive_int, default=None, help="context positions a block sees (default: all)")
    model.add_argument("--labels", default="target", choices=["target", "sequence"],
                       help="what a block position learns: the target's greedy token after the text's prefix "
                            "(the same as the text on the target's own replies), or the text's token")
    model.add_argument("--distill", type=fraction, default=0.0,
                       help="weight of the target's distribution in each block position's label (knowledge "
                            "distillation through its LM head; the rest is the greedy one-hot label). 0 in the "
                            "shipped recipe: its held-out gain at the recipe's steps did not carry into the engine's "
                            "acceptance (bench/RESULTS.md, session 95)")
    model.add_argument("--lr", type=positive_float, default=2e-3)
    model.add_argument("--weight-decay", type=non_negative_float, default=0.3,
                       help="AdamW's decoupled weight decay on the draft's parameters (the shipped draft's: "
                            "bench/RESULTS.md, sessions 33 and 34)")
    model.add_argument("--warmup-steps", type=non_negative_int, default=30)
    model.add_argument("--checkpoint-every", type=positive_int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads (default: the cores this process may use; the DFlash draft's bits depend "
                        "on the count, which the draft's config records)")
    return p


def main(argv: list[str] | None = None) -> None:
    cli_main("dflash", build_parser, run, argv)


def run(args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from specjet.models.config import ModelConfig
    from specjet.models.dflash import FORMAT as DFLASH_FORMAT
    from specjet.models.dflash import DFlashDraftModel, DFlashShape, check_shape_for, default_target_layers, save_dflash
    from specjet.models.eagle import check_draft_dir
    from specjet.models.forward_batch import FeatureLayers
    from specjet.models.weights import resolve_model_path
    from specjet.train import data as D
    from specjet.train.dflash_trainer import DFlashTrainConfig, evaluate, format_report, train

    model_dir = resolve_model_path(args.model_path)
    target = target_fingerprint(model_dir)
    work = args.work_dir or default_work_dir("dflash", model_dir)
    data_dir = args.data_dir or default_work_dir("eagle", model_dir) / "data"
    for folder in (work, data_dir):
        claim_work_dir(folder, target, model_dir)
    out = args.out or work / "draft"
    check_draft_dir(out, DFLASH_FORMAT)  # before the hour of work, not after
    check_writable(out, "--out")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = ModelConfig.from_hf(AutoConfig.from_pretrained(model_dir))
    target_layers = tuple(args.target_layers) if args.target_layers else default_target_layers(config.num_layers, 5)
    mask_id = config.vocab_size - 1 if args.mask_token_id is None else args.mask_token_id
    shape = DFlashShape(args.num_layers, target_layers, args.block_size, mask_id, args.root_context,
                        known_prefix=args.known_prefix_rate > 0, prev_token_input=args.prev_token_input,
                        position_masks=args.position_masks)
    check_flag(check_shape_for, shape, config, ("--target-layers", "--mask-token-id"))  # not after the data
    timings: dict[str, float] = {}
    started = time.perf_counter()

    # ---- 1. data (the EAGLE trainer's samples and cache)
    train_samples, eval_samples = timed_samples(args, tokenizer, data_dir, timings)

    # ---- 2. features: the draft's context at every position
    tag = "-L" + "-".join(map(str, target_layers))
    runner, train_dir, train_seqs, eval_seqs = target_features(args, config, model_dir, work,
                                                               FeatureLayers(target_layers), tag, train_samples,
                                                               eval_samples, timings)

    # ---- 3. train (fp32, against the fp32 target's embedding and LM head)
    target, hot = frozen_target(args, config, tokenizer, runner, train_samples, eval_samples)
    torch.manual_seed(args.seed)
    draft = DFlashDraftModel(config, shape, hot_token_ids=hot).bind_target(target)
    cfg = DFlashTrainConfig(steps=args.steps, batch_tokens=args.batch_tokens, max_prompt=args.max_prompt,
                            blocks_per_seq=args.blocks_per_seq, decay=args.decay, window=args.window,
                            labels=args.labels, lr=args.lr, weight_decay=args.weight_decay,
                            autocast_bf16=_autocast(args.autocast),
                            warmup_steps=args.warmup_steps, seed=args.seed, checkpoint_every=args.checkpoint_every,
                            known_prefix_rate=args.known_prefix_rate, distill=args.distill)
    run_key = dflash_run_key(cfg, shape, args.hot_vocab, torch.get_num_threads())
    t0 = time.perf_counter()
    result = train(draft, train_seqs, cfg, train_dir / f"checkpoint-dflash-{run_key}.pt")
    timings["train"] = round(time.perf_counter() - t0, 1)
    print(f"training: {result['steps']} steps, first step {result['first']}, last steps (mean) {result['final']}")

    # ---- 4. evaluate
    t0 = time.perf_counter()
    with torch.no_grad():
        report = evaluate(draft, eval_seqs, args.window)
        # The same chains drafted after two known tokens (a grammar's forced text in the block).
        known = min(EVAL_KNOWN, shape.block_size - 2)
        report_known = evaluate(draft, eval_seqs, args.window, known=known) if known > 0 else {}
    timings["evaluate"] = round(time.perf_counter() - t0, 1)
    if report:
        print(format_report(report))
    if report_known:
        print(f"after {known} known tokens in the block:")
        print(format_report(report_known))

    # ---- 5. save
    timings["total"] = round(time.perf_counter() - started, 1)
    summary = {
        "command": "python -m specjet.train dflash " + " ".join(_argv_for_summary(args, target_layers, mask_id)),
        "data": {"train": describe(train_samples), "eval": describe(eval_samples)},
        "hot_vocab_coverage_eval": round(D.coverage(eval_samples, hot), 4) if hot is not None else 1.0,
        "steps": result["steps"],
        "final": result["final"],
        "first": result["first"],
        "train_config": result["config"],
        "eval": report,
        "eval_after_known": {"known": known, **report_known} if report_known else {},
        "timings_s": timings,
        "torch_threads": torch.get_num_threads(),
    }
    save_dflash(draft, out, target_gguf=_gguf_name(args.model_path), training=summary)
    print(f"wrote {out}")
    return summary


def dflash_run_key(cfg, shape, hot_vocab: int, threads: int) -> str:
    """12 hex digits naming a training run's checkpoint: what changes its result, the torch thread count included
    (the draft's bits depend on it: a run resumed, or a finished one taken again, under another count would write
    a draft that its recorded command does not reproduce)."""
    from specjet.train.trainer import result_config

    return hashlib.sha256(json.dumps([result_config(cfg), dataclasses.asdict(shape), hot_vocab, threads])
                          .encode()).hexdigest()[:12]


def _autocast(choice: str) -> bool:
    if choice == "auto":
        from specjet.kernels.cpu_features import has_native_bf16

        return has_native_bf16()
    return choice == "bf16"


def _argv_for_summary(args, target_layers, mask_id) -> list[str]:
    """The flags that change the result (paths left out: they differ between machines)."""
    flags = []
    for key in ("num_target_replies", "num_few_shot_replies", "num_human_replies", "num_eval", "num_few_shot_eval",
                "json_per_schema", "max_new_tokens", "json_max_new_tokens", "max_len", "num_layers", "hot_vocab", "block_size",
                "steps", "batch_tokens", "max_prompt", "blocks_per_seq", "decay", "window", "labels", "lr", "autocast",
                "warmup_steps", "known_prefix_rate", "weight_decay", "distill",
                "generate_dtype", "generate_quantization", "feature_dtype", "feature_gemm", "target_quantization",
                "seed"):
        value = getattr(args, key)
        if key == "target_quantization":  # as resolved for this model: "auto" alone would not say which target
            value = target_quantization(args) or "none"
        elif key == "generate_dtype":
            value = generate_dtype(args)
        if value is not None:  # (a flag left at None, --window's "all", is left out: "None" would not parse)
            flags += [f"--{key.replace('_', '-')}", str(value)]
    return flags + ["--root-context" if args.root_context else "--no-root-context",
                    "--prev-token-input" if args.prev_token_input else "--no-prev-token-input",
                    "--position-masks" if args.position_masks else "--no-position-masks",
                    "--mask-token-id", str(mask_id),
                    "--target-layers", *map(str, target_layers), "--threads", str(_threads())]

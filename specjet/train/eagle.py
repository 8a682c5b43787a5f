"""``python -m specjet.train eagle``: train an EAGLE draft head for a target model on CPU.

Stages, each cached under ``--work-dir`` so a rerun (or a run after an interruption) skips what
is done:
  1. data      GSM8K *train* questions answered by the target itself (greedy; in the chat
               template, and in the GSM8K benchmark's plain few-shot form) and by GSM8K's
               reference solutions, JSON instances the target writes under the schemas of
               ``--jsonschema-dir`` (chat), and any ``--extra-jsonl``;
  2. features  the target's final normed hidden state at every position (fp16 shards), and the
               residual stream after `--feature-layers` (EAGLE-3 features) when given;
  3. train     EAGLE-1 loss (feature regression + the target's next-token distribution), at
               teacher forcing and at ``--depths - 1`` unrolled draft steps (training-time test);
  4. evaluate  chain-drafting accept length on held-out target-greedy replies;
  5. save      the head (own weights + hot ids, fp16) and a config.json with this run's summary.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import pathlib
import signal
import sys
import threading
import time

from specjet.arg_types import (existing_file, non_negative_float, non_negative_int, positive_float,
                              positive_int, sequence_len)

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
GENERATE_PAGE_SIZE = 16  # the generation engine's KV page (see get_engine in collect_samples)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m specjet.train eagle", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="target model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--work-dir", type=pathlib.Path, default=None,
                   help="cache for generated data, features and checkpoints (default: <specjet "
                        "cache>/train/eagle-<model>-<its fingerprint>; a folder that holds another target's data is "
                        "refused)")
    p.add_argument("--out", type=pathlib.Path, default=None, help="where to write the head (default: <work-dir>/head)")
    add_data_arguments(p)
    model = p.add_argument_group("head and training")
    model.add_argument("--hot-vocab", type=non_negative_int, default=8192, help="hot token head size (0: the full vocabulary)")
    model.add_argument("--feature-layers", type=int, nargs="*", default=None,
                       help="EAGLE-3 features: the head also reads the target's residual stream after these layers "
                            "(default: a low and a middle layer, 1 and L/2 - 1: 1 14 of the default model's 30; give "
                            "the flag alone for the final hidden state only, EAGLE-1)")
    model.add_argument("--feature-dtype", default="float32", choices=["float32", "bfloat16"],
                       help="dtype of the target whose features the head learns from (bf16 features drafted no "
                            "better in a bf16 engine: bench/RESULTS.md)")
    model.add_argument("--feature-gemm", default="auto", choices=["auto", "float32"],
                       help="how the float32 target's layers multiply: auto: on a CPU with AMX tiles as three bf16 "
                            "tile products each (within ~2^-16 of float32 a product, the features kept in fp16 anyway; "
                            "the stage 1.1-1.4x faster: kernels/bf16_gemm.py's Bf16x3Linear), else oneDNN's float32; "
                            "float32: oneDNN's float32 everywhere")
    model.add_argument("--steps", type=positive_int, default=800)
    model.add_argument("--batch-tokens", type=positive_int, default=2048)
    model.add_argument("--max-prompt", type=positive_int, default=256,
                       help="training sees at most this many prompt tokens before a reply (the few-shot prompts are ~750)")
    model.add_argument("--lr", type=positive_float, default=1e-3)
    model.add_argument("--warmup-steps", type=non_negative_int, default=40)
    model.add_argument("--noise", type=non_negative_float, default=0.2, help="width of the uniform noise on input features")
    model.add_argument("--p-weight", type=non_negative_float, default=0.3,
                       help="weight of the cross-entropy term (the paper: 0.1; 0.3 drafted better here)")
    model.add_argument("--depths", type=positive_int, default=3,
                       help="draft depths trained: 1 = teacher forcing only (EAGLE-1); d > 1 also trains draft "
                            "steps 1..d-1 on the head's own hidden states (training-time test)")
    model.add_argument("--depth-decay", type=positive_float, default=0.8, help="loss weight of depth d: decay ** d")
    model.add_argument("--checkpoint-every", type=positive_int, default=100)
    model.add_argument("--eval-steps", type=positive_int, default=5, help="draft steps k evaluated: 1..n")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads (default: the cores this process may use; the head's bits depend on the "
                        "count, which the head's config records)")
    return p


def add_data_arguments(p: argparse.ArgumentParser) -> None:
    """The data stage's options (``collect_samples`` reads them), shared by every draft trainer."""
    data = p.add_argument_group("data")
    data.add_argument("--gsm8k", type=existing_file, default=SHARED_DATA / "gsm8k" / "train.jsonl",
                      help="GSM8K *train* jsonl (question, answer); never point this at the test split")
    data.add_argument("--jsonschema-dir", type=lambda text: pathlib.Path(text) if text else None,
                      default=SHARED_DATA / "jsonschema", help="folder with index.json (schema files and prompts); '' "
                                                               "to skip")
    data.add_argument("--extra-jsonl", type=pathlib.Path, action="append", default=[],
                      help='extra training data: lines of {"messages": [...]} or {"text": ...} (repeatable)')
    data.add_argument("--target-quantization", default="none", choices=["none", "gguf", "auto"],
                      help="the target the draft learns: its replies and features come from the model with these "
                           "weights; auto: gguf for a GGUF model (the engine's default on CPU), else none. Default "
                           "%(default)s (the EAGLE trainer's none: a head trained on the GGUF target drafted no "
                           "better for it; the DFlash trainer's auto: a faster feature stage and a draft as good; "
                           "bench/RESULTS.md, sessions 15 and 87)")
    data.add_argument("--num-target-replies", type=non_negative_int, default=617,
                      help="GSM8K train questions the target answers greedily for training")
    data.add_argument("--num-few-shot-replies", type=non_negative_int, default=64,
                      help="GSM8K train questions the target answers greedily in the benchmark's few-shot form")
    data.add_argument("--num-human-replies", type=non_negative_int, default=200, help="GSM8K reference solutions for training")
    data.add_argument("--num-eval", type=positive_int, default=40, help="held-out GSM8K train questions for evaluation (chat)")
    data.add_argument("--num-few-shot-eval", type=non_negative_int, default=24,
                      help="of those, how many are also evaluated in the few-shot form")
    data.add_argument("--json-per-schema", type=non_negative_int, default=2, help="instances per training schema (1 greedy, rest sampled)")
    data.add_argument("--json-eval-every", type=positive_int, default=5, help="every n-th schema is held out for evaluation")
    data.add_argument("--max-new-tokens", type=positive_int, default=320, help="longest target reply to a GSM8K question")
    data.add_argument("--json-max-new-tokens", type=positive_int, default=256, help="longest JSON instance")
    data.add_argument("--max-len", type=sequence_len, default=1024, help="longest sequence (prompt and reply), in tokens")
    data.add_argument("--max-running-requests", type=positive_int, default=64, help="generation batch")
    data.add_argument("--generate-quantization", default="target", choices=["target", "none", "gguf"],
                      help="weights of the engine that writes the target's replies (the text the draft reads; its "
                           "features and labels still come from --target-quantization's target); target: the same. "
                           "gguf: the GGUF file's 4-bit blocks, which write a batch of 64 ~3x faster than float32 where "
                           "bf16 is emulated (bench/RESULTS.md, session 83)")
    data.add_argument("--generate-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                      help="dtype of the engine that writes the target's replies; auto: bf16 where the CPU has native "
                           "bf16 (a batch decodes ~2x faster than fp32), fp32 where bf16 is emulated (~8x slower)")


def default_threads() -> int:
    """The cores this process may run on. Not fewer on a busy machine: a draft's bits depend on the thread
    count (its training step's sums split by thread), so the same command must give the same draft at any load,
    and a run resumed must go on as it began. On a shared machine, pass --threads."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def target_fingerprint(model_dir: pathlib.Path) -> str:
    """12 hex digits naming the target a work folder's replies and features come from: config.json's bytes and each
    weight file's name, size and modification time. A model of the same folder name elsewhere, or one changed in
    place, gets its own (a copy of the same model gets one too: its data is made again, which costs time, never a
    draft of another model)."""
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for f in sorted(model_dir.iterdir()):
        if f.suffix in (".safetensors", ".bin", ".gguf", ".pt", ".pth"):
            stat = f.stat()
            h.update(f"{f.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return h.hexdigest()[:12]


def claim_work_dir(directory: pathlib.Path, fingerprint: str, model_dir: pathlib.Path) -> None:
    """``directory`` (made if missing) marked as holding the data of the target ``fingerprint`` names; a
    FileExistsError when it holds another target's (its cached replies and features would train a draft of that
    one)."""
    directory.mkdir(parents=True, exist_ok=True)
    marker = directory / "target.json"
    if marker.is_file():
        held = json.loads(marker.read_text())
        if held.get("fingerprint") != fingerprint:
            raise FileExistsError(f"{directory} holds the data of another target ({held.get('model')}, fingerprint "
                                  f"{held.get('fingerprint')}; this one is {model_dir}, {fingerprint}): pass another "
                                  f"folder, or remove it")
        return
    marker.write_text(json.dumps({"fingerprint": fingerprint, "model": str(model_dir)}) + "\n")


def check_writable(directory: pathlib.Path, flag: str) -> None:
    """``TrainArgumentError`` unless a file can be made in ``directory`` or, while it does not exist, in its nearest
    existing parent (where it will be made): an unwritable ``--out`` was found by the save, after the whole run. Probed
    by making a file and removing it (permission bits say nothing of a read-only mount or an immutable folder, and
    nothing to root)."""
    import tempfile

    directory = pathlib.Path(directory)
    probe = directory.absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise TrainArgumentError(f"{flag} {directory}: cannot be made, {probe} is not a folder")
    try:
        fd, name = tempfile.mkstemp(prefix=".specjet-write-probe-", dir=probe)
    except OSError as error:
        where = "" if probe == directory.absolute() else f" (its nearest existing parent, {probe})"
        raise TrainArgumentError(f"{flag} {directory}: not writable{where}: {error.strerror or error}; choose a "
                                 f"folder this user can write to") from None
    os.close(fd)
    os.unlink(name)


def default_work_dir(kind: str, model_dir: pathlib.Path) -> pathlib.Path:
    """<specjet cache>/train/<kind>-<model folder's name>-<target_fingerprint>."""
    from specjet.models.weights import specjet_cache_dir

    return specjet_cache_dir() / "train" / f"{kind}-{model_dir.name}-{target_fingerprint(model_dir)}"


def main(argv: list[str] | None = None) -> None:
    cli_main("eagle", build_parser, run, argv)


def missing_data(args: argparse.Namespace) -> str | None:
    """The data option whose file or folder is not there, said before anything runs (it was a traceback after the
    engine had loaded): the defaults are a checkout's ../shared/data, which an installed copy has not. Also no
    training data at all (a traceback after the data and feature stages)."""
    where = f" (the default is the project checkout's {SHARED_DATA})"
    if not pathlib.Path(args.gsm8k).is_file():
        return f"--gsm8k: no such file: {args.gsm8k}{where}"
    schemas = args.jsonschema_dir
    if schemas is not None and args.json_per_schema > 0 and not (schemas / "index.json").is_file():
        return f"--jsonschema-dir: no index.json in {args.jsonschema_dir}{where}; '' skips the JSON data"
    if (args.num_target_replies + args.num_few_shot_replies + args.num_human_replies == 0 and not args.extra_jsonl
            and (schemas is None or args.json_per_schema == 0)):
        return ("no training data: --num-target-replies, --num-few-shot-replies, --num-human-replies and "
                "--json-per-schema are 0 (or --jsonschema-dir '') and no --extra-jsonl is given")
    return None


class TrainArgumentError(ValueError):
    """A flag's value that only the target's config shows wrong (a layer list, the mask token id), said before any
    work as the parser says a range error."""


def check_flag(check, *args) -> None:
    """``check(*args)``, its ValueError a ``TrainArgumentError``."""
    try:
        check(*args)
    except ValueError as error:
        raise TrainArgumentError(str(error)) from None


def cli_main(name: str, parser, run_args, argv: list[str] | None) -> None:
    """A draft trainer's command (``python -m specjet.train <name>``): its arguments parsed, the torch threads set,
    the run, and its data and timings printed."""
    args = parser().parse_args(argv)
    missing = missing_data(args)
    if missing:
        parser().error(missing)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(args.threads or default_threads())
    print(f"specjet.train {name}: {torch.get_num_threads()} torch thread(s)")
    from specjet.train.data import InputFileError
    from specjet.train.features import DamagedFileError
    from specjet.train.trainer import Stopped

    def stop(signum, frame):  # SIGTERM ended the process with no word; the training loop itself stops at a step's end
        raise Stopped(signal.Signals(signum).name)

    in_main = threading.current_thread() is threading.main_thread()  # (signal handlers are the main thread's)
    previous = signal.signal(signal.SIGTERM, stop) if in_main else None
    try:
        summary = run_args(args)
    except FileExistsError as error:  # a folder that holds something else: nothing was overwritten
        print(f"python -m specjet.train {name}: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except (TrainArgumentError, InputFileError) as error:
        print(f"python -m specjet.train {name}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except DamagedFileError as error:  # left in place: the message says what to remove
        print(f"python -m specjet.train {name}: error: {error}", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt as error:  # Ctrl-C, or a Stopped: SIGINT or SIGTERM
        signal_name = error.signal_name if isinstance(error, Stopped) else "SIGINT"
        saved = ""
        if isinstance(error, Stopped) and error.step is not None:
            saved = (f" after step {error.step}, its checkpoint written to {error.checkpoint}"
                     if error.checkpoint is not None else f" after step {error.step} (no checkpoint kept)")
        print(f"python -m specjet.train {name}: stopped by {signal_name}{saved}. To resume, run the same command "
              f"again (the same command resumes from what is cached and the last checkpoint):\n"
              f"  {resume_command(name, sys.argv[1:] if argv is None else argv)}", file=sys.stderr)
        raise SystemExit(128 + signal.Signals[signal_name].value) from None
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
    print(json.dumps({k: summary[k] for k in ("data", "timings_s")}, indent=2))


def resume_command(name: str, argv: list[str]) -> str:
    """The command that resumes a run of ``argv``: the same, with the thread count it ran under when none was
    given (the default follows the cores the process may use, and a run under another count is another run)."""
    import shlex

    import torch

    if not any(a == "--threads" or a.startswith("--threads=") for a in argv):
        argv = [*argv, "--threads", str(torch.get_num_threads())]
    return shlex.join(["python", "-m", "specjet.train", name, *argv])


def run(args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from specjet.models.config import ModelConfig
    from specjet.models.eagle import FORMAT as EAGLE_FORMAT
    from specjet.models.eagle import EagleDraftModel, check_draft_dir, check_layer_ids, save_eagle
    from specjet.models.forward_batch import FeatureLayers
    from specjet.models.weights import resolve_model_path
    from specjet.train import data as D
    from specjet.train.evaluate import evaluate, format_report
    from specjet.train.trainer import TrainConfig, train

    model_dir = resolve_model_path(args.model_path)
    work = args.work_dir or default_work_dir("eagle", model_dir)
    claim_work_dir(work, target_fingerprint(model_dir), model_dir)
    out = args.out or work / "head"
    check_draft_dir(out, EAGLE_FORMAT)  # before the hour of work, not after
    check_writable(out, "--out")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = ModelConfig.from_hf(AutoConfig.from_pretrained(model_dir))
    if args.feature_layers is None:
        args.feature_layers = default_feature_layers(config.num_layers)
    check_flag(check_layer_ids, args.feature_layers, config.num_layers, "--feature-layers")  # not after the data
    timings: dict[str, float] = {}
    started = time.perf_counter()

    # ---- 1. data
    train_samples, eval_samples = timed_samples(args, tokenizer, work / "data", timings)

    # ---- 2. features
    # The head trains in fp32 against an fp32 target (its embedding and LM head); the features it
    # reads come from a target in --feature-dtype, the dtype it will draft for.
    feature_layers = tuple(args.feature_layers)
    capture = FeatureLayers(feature_layers) if feature_layers else "last"
    tag = "-L" + "-".join(map(str, feature_layers)) if feature_layers else ""
    runner, train_dir, train_seqs, eval_seqs = target_features(args, config, model_dir, work, capture, tag,
                                                               train_samples, eval_samples, timings)

    # ---- 3. train
    target, hot = frozen_target(args, config, tokenizer, runner, train_samples, eval_samples)
    torch.manual_seed(args.seed)
    head = EagleDraftModel(config, hot_token_ids=hot, feature_layers=feature_layers).bind_target(target)
    cfg = TrainConfig(steps=args.steps, batch_tokens=args.batch_tokens, max_prompt=args.max_prompt, lr=args.lr,
                      warmup_steps=args.warmup_steps,
                      noise=args.noise, p_weight=args.p_weight, seed=args.seed, checkpoint_every=args.checkpoint_every,
                      depths=args.depths, depth_decay=args.depth_decay)
    t0 = time.perf_counter()
    run_key = eagle_run_key(cfg, args.hot_vocab, torch.get_num_threads())
    result = train(head, train_seqs, cfg, train_dir / f"checkpoint-{run_key}.pt")
    timings["train"] = round(time.perf_counter() - t0, 1)
    print(f"training: {result['steps']} steps, first step {result['first']}, last steps (mean) {result['final']}")

    # ---- 4. evaluate
    t0 = time.perf_counter()
    report = evaluate(head, eval_seqs, args.eval_steps)
    timings["evaluate"] = round(time.perf_counter() - t0, 1)
    print(format_report(report))

    # ---- 5. save
    timings["total"] = round(time.perf_counter() - started, 1)
    summary = {
        "command": "python -m specjet.train eagle " + " ".join(_argv_for_summary(args)),
        "data": {"train": describe(train_samples), "eval": describe(eval_samples)},
        "hot_vocab_coverage_eval": round(D.coverage(eval_samples, hot), 4) if hot is not None else 1.0,
        "steps": result["steps"],
        "final_losses": result["final"],
        "initial_losses": result["first"],
        "train_config": result["config"],
        "eval": report,
        "timings_s": timings,
        "torch_threads": torch.get_num_threads(),
    }
    save_eagle(head, out, target_gguf=_gguf_name(args.model_path), training=summary)
    print(f"wrote {out}")
    return summary


def eagle_run_key(cfg, hot_vocab: int, threads: int) -> str:
    """12 hex digits naming a training run's checkpoint: what changes its result, the torch thread count included
    (the head's bits depend on it: a run resumed, or a finished one taken again, under another count would write a
    head that its recorded command does not reproduce)."""
    from specjet.train.trainer import result_config

    return hashlib.sha256(json.dumps([result_config(cfg), hot_vocab, threads]).encode()).hexdigest()[:12]


def timed_samples(args, tokenizer, data_dir: pathlib.Path, timings: dict) -> tuple[list, list]:
    """A draft trainer's stage 1: the (train, eval) samples (``collect_samples``), timed and described."""
    t0 = time.perf_counter()
    train_samples, eval_samples = collect_samples(args, tokenizer, data_dir)
    timings["data"] = round(time.perf_counter() - t0, 1)
    for name, samples in (("train", train_samples), ("eval", eval_samples)):
        print(f"{name}: {describe(samples)}")
    if not train_samples:  # (a traceback in the training loop, after the feature stage)
        raise TrainArgumentError("the data stage gave no training sample (every reply empty, or an --extra-jsonl "
                                 "without one)")
    return train_samples, eval_samples


def target_features(args, config, model_dir, work: pathlib.Path, capture, tag: str, train_samples, eval_samples,
                    timings: dict):
    """A draft trainer's stage 2: the target's features of both sample sets (``capture``d from the target
    ``feature_target`` picks), cached under ``work``/features in folders named by the samples, ``tag`` and the
    target. Returns (the float32 runner the draft trains against, the train features' folder, the train and the
    eval sequences; a train sequence is a ``target_reply`` where the feature target wrote it greedily)."""
    from specjet.models.runner import ModelRunner
    from specjet.models.weights import load_state_dict
    from specjet.train.features import extract_features, load_sequences, mark_target_replies

    state_dict = load_state_dict(model_dir)
    runner = ModelRunner(config, state_dict, "float32", "cpu", 2048 + 64, 0.0, 1)
    feature_runner, target_tag = feature_target(args, config, state_dict, runner)
    train_dir = work / "features" / f"train-{fingerprint(train_samples)}{tag}{target_tag}"
    eval_dir = work / "features" / f"eval-{fingerprint(eval_samples)}{tag}{target_tag}"
    timings["features"] = round(
        extract_features(feature_runner, train_samples, train_dir, "features (train)", capture=capture)
        + extract_features(feature_runner, eval_samples, eval_dir, "features (eval)", capture=capture), 1)
    del feature_runner
    train_seqs = load_sequences(train_dir)
    mark_target_replies(train_seqs, train_samples, replies_written_by_the_feature_target(args))
    return runner, train_dir, train_seqs, load_sequences(eval_dir)


def replies_written_by_the_feature_target(args) -> bool:
    """Whether the engine writing the replies computes what the features' target does: a quantized target
    (``--target-quantization``, a GGUF model's default in the DFlash trainer) whose own blocks write them, on the
    same batch-invariant kernels. A float target's replies come from ``--generate-dtype``'s engine and its
    features from another runner (``--feature-dtype``, its own GEMMs): not one computation."""
    quantization = target_quantization(args)
    return quantization is not None and generate_quantization(args) == quantization


def frozen_target(args, config, tokenizer, runner, train_samples, eval_samples):
    """A draft trainer's target, frozen, and the draft's hot vocabulary (``--hot-vocab`` ids of the train replies
    and EOS, or None): (target model, hot ids)."""
    from specjet.train import data as D

    eos = tuple(config.eos_token_ids) + (tokenizer.convert_tokens_to_ids(tokenizer.eos_token),)
    hot = D.hot_token_ids(train_samples, args.hot_vocab, config.vocab_size, eos) if args.hot_vocab else None
    if hot is not None:
        print(f"hot vocabulary: {len(hot)} ids, covering {D.coverage(eval_samples, hot):.2%} of held-out reply tokens")
    target = runner.model
    target.requires_grad_(False)
    target.lm_head.packed = None  # the packed matmul has no backward; the draft's logits train through the head
    return target, hot


def target_quantization(args) -> str | None:
    """What ``--target-quantization`` resolves to: "gguf" or None (float weights)."""
    from specjet.models.weights import gguf_source

    choice = args.target_quantization
    if choice == "auto":
        choice = "gguf" if gguf_source(args.model_path) is not None else "none"
    return None if choice == "none" else choice


def generate_dtype(args) -> str:
    """What ``--generate-dtype`` resolves to in the engine that writes the replies (its device "auto": a GPU's
    bf16 where there is one, on a CPU bf16 only with native bf16 instructions)."""
    import torch

    from specjet.models.runner import resolve_dtype

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return str(resolve_dtype(args.generate_dtype, device)).removeprefix("torch.")


def generate_quantization(args) -> str | None:
    """What ``--generate-quantization`` resolves to: the weights that write the replies, "gguf" or None."""
    choice = args.generate_quantization
    if choice == "target":
        return target_quantization(args)
    return None if choice == "none" else choice


def feature_target(args, config, state_dict, float_runner):
    """(the runner whose hidden states the draft reads, a tag naming it in cache paths): the target
    with the weights the draft will draft for (``--target-quantization``; a quantized target computes
    in float32) or, with float weights, in ``--feature-dtype``."""
    from specjet.models.runner import ModelRunner
    from specjet.models.weights import gguf_source

    quantization = target_quantization(args)
    if quantization is not None:
        return (ModelRunner(config, state_dict, "float32", "cpu", 2048 + 64, 0.0, 1,
                            quantization=quantization, gguf_path=gguf_source(args.model_path)), f"-{quantization}")
    if args.feature_dtype == "float32":
        # The float runner's layers serve only this extraction (training reads the target's embedding and head):
        # its packs' projections go as one call each, or as three bf16 tile products each where the CPU has tiles
        # (tagged: such features are not float32's bits).
        float_runner.model.unchunk_projections()
        if args.feature_gemm == "auto" and float_runner.model.bf16x3_projections():
            return float_runner, "-bf16x3"
        return float_runner, ""
    return (ModelRunner(config, state_dict, args.feature_dtype, "cpu", 2048 + 64, 0.0, 1),
            f"-{args.feature_dtype}")


def collect_samples(args, tokenizer, data_dir: pathlib.Path):
    """(train, eval) samples. Replies the target must write are generated once and cached."""
    from specjet.train import data as D
    from specjet.train.generate import generate_cached, gsm8k_few_shot_requests, gsm8k_requests, json_requests

    shots, eval_records, rest = D.gsm8k_split(args.gsm8k, args.num_eval, args.seed)
    train = D.gsm8k_human_samples(tokenizer, rest[:args.num_human_replies], args.max_len)
    for path in args.extra_jsonl:
        train += D.extra_samples(tokenizer, path, args.max_len)

    mnt = args.max_new_tokens
    quantization = generate_quantization(args)
    # Replies are cached per engine that writes them: a quantized target's, or a float one's in its dtype.
    q = f"-{quantization}" if quantization else f"-{generate_dtype(args)}"
    jobs = {  # cache file -> requests, in a fixed order
        f"gsm8k_target_eval-s{args.seed}-n{mnt}{q}.jsonl": gsm8k_requests(tokenizer, eval_records, mnt, "gsm8k"),
        f"gsm8k_target_train-s{args.seed}-n{mnt}{q}.jsonl":
            gsm8k_requests(tokenizer, rest[:args.num_target_replies], mnt, "gsm8k_target"),
        f"gsm8k_fewshot_eval-s{args.seed}-n{mnt}{q}.jsonl":
            gsm8k_few_shot_requests(tokenizer, shots, eval_records[:args.num_few_shot_eval], mnt, "gsm8k_fewshot"),
        f"gsm8k_fewshot_train-s{args.seed}-n{mnt}{q}.jsonl":
            gsm8k_few_shot_requests(tokenizer, shots, rest[:args.num_few_shot_replies], mnt, "gsm8k_fewshot_target"),
    }
    if args.jsonschema_dir is not None and args.json_per_schema > 0:
        schemas = D.load_schemas(args.jsonschema_dir)
        held = [s for i, s in enumerate(schemas) if (i + 1) % args.json_eval_every == 0]
        kept = [s for i, s in enumerate(schemas) if (i + 1) % args.json_eval_every != 0]
        jmnt = args.json_max_new_tokens
        jobs[f"json_eval-s{args.seed}-n{jmnt}{q}.jsonl"] = json_requests(tokenizer, held, 1, 0.0, jmnt, "json",
                                                                         args.seed)
        jobs[f"json_train-s{args.seed}-n{jmnt}{q}.jsonl"] = json_requests(tokenizer, kept, args.json_per_schema, 0.7,
                                                                          jmnt, "json_target", args.seed)
    engine = None

    def get_engine():
        nonlocal engine
        if engine is None:
            from specjet import Engine

            # A quantized target's replies come from that target (the DFlash trainer's default for a GGUF
            # model): its blocks write a batch of 64 faster than float32 on the CPUs measured, and than bf16
            # on a Zen 4 (bench/RESULTS.md, sessions 79, 83, 85). A float target's come from
            # --generate-dtype (bf16 where it is native) or --generate-quantization gguf. KV pages of 16
            # slots: with one-slot pages the 64 requests' decode steps interleave their slots, so the attention reads
            # each cached token's key and value from a line of its own, where 16 positions side by side
            # stream; the replies are the same either way (bench/RESULTS.md, session 69).
            # Room for every running request's longest sequence in whole pages, so none waits or is retracted.
            request_slots = -(-(args.max_len + args.max_new_tokens) // GENERATE_PAGE_SIZE) * GENERATE_PAGE_SIZE
            engine = Engine(model_path=args.model_path, quantization=quantization,
                            dtype=args.generate_dtype if quantization is None else "auto",
                            page_size=GENERATE_PAGE_SIZE,
                            max_running_requests=args.max_running_requests,
                            max_total_tokens=args.max_running_requests * request_slots,
                            random_seed=args.seed)
        return engine

    try:
        generated = generate_cached(get_engine, {data_dir / name: requests for name, requests in jobs.items()},
                                    "generate (target replies)")
    finally:
        if engine is not None:
            engine.shutdown()
    evaluation = []
    for cache, samples in generated.items():
        samples = [D.Sample(s.ids[:args.max_len], s.prompt_len, s.source, s.greedy) for s in samples]
        (evaluation if "_eval" in cache.name else train).extend(samples)
    return train, evaluation


def describe(samples) -> dict:
    by_source: dict[str, dict] = {}
    for s in samples:
        d = by_source.setdefault(s.source, {"sequences": 0, "tokens": 0, "reply_tokens": 0})
        d["sequences"] += 1
        d["tokens"] += len(s.ids)
        d["reply_tokens"] += len(s.ids) - s.prompt_len
    return by_source


def fingerprint(samples) -> str:
    h = hashlib.sha256()
    for s in samples:
        h.update(json.dumps([s.ids, s.prompt_len, s.source]).encode())
    return h.hexdigest()[:12]


def _gguf_name(model_path) -> str | None:
    from specjet.models.weights import default_gguf_path

    if model_path is None:
        return default_gguf_path().name
    return pathlib.Path(model_path).name if str(model_path).lower().endswith(".gguf") else None


def _argv_for_summary(args) -> list[str]:
    """The flags that change the result (paths left out: they differ between machines)."""
    flags = []
    for key in ("num_target_replies", "num_few_shot_replies", "num_human_replies", "num_eval", "num_few_shot_eval",
                "json_per_schema", "max_new_tokens",
                "json_max_new_tokens", "max_len",
                "hot_vocab", "steps", "batch_tokens", "max_prompt", "lr", "warmup_steps", "noise", "p_weight",
                "depths", "depth_decay", "generate_dtype", "generate_quantization", "feature_dtype", "feature_gemm",
                "target_quantization", "seed"):
        value = generate_dtype(args) if key == "generate_dtype" else getattr(args, key)  # "auto" as resolved
        flags += [f"--{key.replace('_', '-')}", str(value)]
    return flags + ["--feature-layers", *map(str, args.feature_layers), "--threads", str(_threads())]


def default_feature_layers(num_layers: int) -> list[int]:
    """``--feature-layers``' default for a target of ``num_layers``: a low layer and a middle one (1 and 14 of the
    default model's 30, the shipped head's), those of them a target of this depth has before its last layer (none
    for one layer: the final hidden state alone, EAGLE-1)."""
    return sorted({i for i in (1, num_layers // 2 - 1) if 0 <= i < num_layers - 1})


def _threads() -> int:
    """The torch threads the run had (a draft's bits depend on them)."""
    import torch

    return torch.get_num_threads()

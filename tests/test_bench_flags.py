"""The bench command lines refuse what they cannot honour when they are read, with a one-line error naming the
flag: a value out of range (a hang at --batch-size 0, a crash or a record lost after the whole run), a flag the
bench would drop, a path that is not there. Parsing only: no engine loads, except for the one missing path read
after the engine's flags."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

REFUSED = [
    ("profile_loop", ["--batch-size", "0"], "--batch-size"),  # hung for ever (a capacity limiter of 0)
    ("profile_loop", ["--num-prompts", "0"], "--num-prompts"),
    ("overlap", ["--repeats", "0"], "--repeats"),  # a ZeroDivisionError after the runs
    ("overlap", ["--batch-sizes", "0"], "--batch-sizes"),
    ("overlap", ["--disable-overlap-schedule"], "the loops are this bench's axis"),  # was dropped
    ("pause", ["--pauses", "nan"], "--pauses"),  # passed `p < 0`, then time.sleep's ValueError
    ("pause", ["--no-disable-overlap-schedule"], "the loops are this bench's axis"),
    ("soak", ["--minutes", "1", "--call-timeout", "inf"], "--call-timeout"),  # OverflowError after the load
    ("compare", ["--temperature", "nan"], "--temperature"),
    ("compare", ["--temperature", "0.7", "--top-p", "nan"], "--top-p"),  # the record was lost at the end
    ("compare", ["--top-p", "0.5"], "give --temperature > 0"),  # was ignored in a greedy run
    ("isa_rates", ["--chains", "15"], "--chains 1 to 14"),  # gcc failed on ymm16
    ("isa_rates", ["--cpu", "4096"], "--cpu"),  # taskset's CalledProcessError
    ("mask_write", ["--vocab", "40", "--allowed", "8"], "multiple of 32"),  # glibc aborted in xgrammar's kernel
    ("prediction", ["--speculative-algorithm", "EAGLE"], "--algorithms"),  # was dropped
    ("latency_common", ["--workload", "gsm8k", "--json-constrained"], "--json-constrained"),  # was ignored
    ("latency_common", ["--sweep", "--speculative-algorithm", "NGRAM", "--llamacpp"], "--llamacpp"),
    ("latency_common", ["--sweep", "--speculative-algorithm", "DFLASH"], "EAGLE or NGRAM"),  # a KeyError
    ("step", ["--model-path", "/nonexistent/model"], "no such file or folder"),  # a traceback from the loader
    ("latency_common", ["--model-path", "/nonexistent/model"], "no such file or folder"),
]


@pytest.mark.parametrize("module,argv,words", REFUSED, ids=[f"{m} {' '.join(a)}" for m, a, _ in REFUSED])
def test_a_flag_the_bench_cannot_honour_is_refused_when_read(module, argv, words, capsys):
    parse_args = importlib.import_module(f"bench.{module}").parse_args
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err, err


def test_a_missing_data_folder_is_one_line_and_status_2():
    """Read after the flags (only the workload knows which paths it needs): ``run_cli`` makes it one line."""
    proc = subprocess.run([sys.executable, "-m", "bench.overlap", "--schema-dir", "/nonexistent/schemas"],
                          cwd=REPO_ROOT, env=dict(os.environ, PYTHONPATH=REPO_ROOT), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip() == "python -m bench.overlap: [Errno 2] No such file or directory: " \
                                  "'/nonexistent/schemas/index.json'"

"""bench.soak: a few seconds of the soak on the tiny model, and its report when a call hangs or comes
back with an internal error (the benchmark reports them and fails; it does not hang or crash)."""
from __future__ import annotations

import json
import threading

import pytest

from bench import soak
from specjet.scheduler.finish_reasons import INTERNAL_ERROR, abort_reason


def test_soak_a_few_seconds_passes_with_consistent_counts(tiny_model_dir, tmp_path, capsys):
    result_file = tmp_path / "soak.jsonl"
    result = soak.main(["--minutes", "0.1", "--model-path", str(tiny_model_dir), "--max-total-tokens", "8192",
                        "--threads", "4", "--async-tasks", "4", "--call-timeout", "60", "--seed", "1",
                        "--result-file", str(result_file)])
    out = capsys.readouterr().out
    (rec,) = result["configs"]
    requests = rec["requests"]
    assert requests.get(soak.SERVED, 0) > 0 and requests.get(soak.REFUSED, 0) > 0, requests
    assert rec["hangs"] == 0 and rec["internal_errors"] == 0, (rec["examples"], out)
    assert rec["end"]["leaked_slots"] == 0 and rec["end"]["kv_invariant"] == "ok" and rec["end"]["alive"]
    assert rec["pass"] and result["pass"]
    # Counts agree with each other: per case and per outcome, refusals per exception type, calls.
    per_case = sum(sum(c.values()) for c in rec["by_case"].values())
    assert per_case == sum(requests.values())
    assert sum(rec["refused_by_type"].values()) == requests[soak.REFUSED]
    assert set(rec["refused_by_type"]) <= {"TypeError", "ValueError", "GrammarError"}
    assert sum(v["n"] for v in rec["latency_s"].values()) == sum(rec["calls"].values())
    assert rec["calls"].get("sync", 0) > 0 and rec["calls"].get("async", 0) > 0
    assert rec["tokens"] > 0
    cpu = result["machine"].get("cpu_description", result["machine"]["cpu"])  # the CPU's model, named
    assert out.startswith("# command: ") and f"\n# machine: {cpu}; " in out and result["machine"]["cpu"]
    assert f"requests served: {requests[soak.SERVED]}; tokens generated: {rec['tokens']} " in out
    assert "\nRESULT [none]: PASS (hangs 0, leaked slots 0, internal errors 0, engine alive yes)" in out
    assert json.loads(result_file.read_text().splitlines()[-1])["requests"] == requests
    # The process's resident memory at the start and at each progress line, reported (Linux: /proc).
    assert rec["rss_mb"][0][1] > 0 and "\nresident memory: " in out


def test_rss_growth_is_the_second_halfs_slope():
    """MB per minute through the second half's samples: the first half's cache filling does not count."""
    samples = [(0.0, 100.0), (30.0, 400.0)] + [(60.0 + 30 * i, 500.0 + 2.0 * i) for i in range(5)]  # 4 MB/min late
    assert soak.rss_growth(samples) == pytest.approx(4.0)
    assert soak.rss_growth([(0.0, 100.0), (60.0, 90.0), (90.0, 90.0), (120.0, 90.0)]) == pytest.approx(0.0)
    assert soak.rss_growth([(0.0, 100.0), (60.0, 110.0)]) is None  # too few samples in the second half
    assert soak.rss_growth([(0.0, None), (60.0, None)]) is None  # no /proc


def test_a_hung_call_and_an_internal_error_are_reported_not_waited_for(tiny_model_dir, tmp_path, capsys,
                                                                       monkeypatch):
    """A call that does not return within --call-timeout counts as a hang (the soak goes on without
    it), and an abort of err_type internal_error is counted and printed: both make the run FAIL."""
    import specjet

    original = specjet.Engine.generate
    lock, count, injected, release = threading.Lock(), [0], [False], threading.Event()

    def generate(self, *args, **kwargs):
        with lock:
            count[0] += 1
            n = count[0]
            inject = n > 3 and not kwargs.get("stream") and not injected[0]
            injected[0] = injected[0] or inject
        if n == 3:  # the warm-up is call 1
            release.wait(30)  # "hangs" past the 3 s bound
        if inject:  # the next non-streamed call
            return {"text": "", "output_ids": [], "meta_info": {"finish_reason": abort_reason(
                INTERNAL_ERROR, "internal error in the decode batch: injected")}}
        return original(self, *args, **kwargs)

    monkeypatch.setattr(specjet.Engine, "generate", generate)
    try:
        result = soak.main(["--minutes", "0.05", "--model-path", str(tiny_model_dir), "--max-total-tokens", "4096",
                            "--threads", "2", "--async-tasks", "0", "--call-timeout", "3",
                            "--result-file", str(tmp_path / "soak.jsonl")])
    finally:
        release.set()
    out = capsys.readouterr().out
    (rec,) = result["configs"]
    # At least: a slow real call may pass the 3 s bound too.
    assert rec["hangs"] >= 1 and rec["internal_errors"] >= 1 and not result["pass"]
    assert "HANG: thread-" in out and "internal error in the decode batch: injected" in out
    assert f"\nRESULT [none]: FAIL (hangs {rec['hangs']}, leaked slots 0, internal errors {rec['internal_errors']}, " in out


@pytest.mark.parametrize("argv", [["--minutes", "0"], ["--minutes", "1", "--threads", "0", "--async-tasks", "0"],
                                  ["--minutes", "1", "--speculative-algorithm", "MEDUSA"]])
def test_bad_flags_are_refused(argv):
    with pytest.raises(SystemExit):
        soak.parse_args(argv)


def test_a_soak_with_injected_compute_faults_passes(tiny_model_dir, tmp_path, capsys):
    """--fault-rate: compute items fail at random under the soak's mixed load (aborts, cancellations, grammars,
    streams): the engine re-runs the requests of failed batches, ends only the ones their faults keep following,
    never hangs or leaks, and the run passes with the faults' ends counted apart."""
    result = soak.main(["--minutes", "0.1", "--model-path", str(tiny_model_dir), "--max-total-tokens", "8192",
                        "--threads", "4", "--async-tasks", "4", "--call-timeout", "60", "--seed", "2",
                        "--fault-rate", "0.05", "--result-file", str(tmp_path / "soak.jsonl")])
    out = capsys.readouterr().out
    (rec,) = result["configs"]
    faults = rec["faults"]
    assert faults["fired"] > 5 and faults["fired_in_shared_batches"] > 0, faults
    assert rec["end"]["engine_stats"]["requests_isolated"] > faults["fired_in_shared_batches"]
    assert rec["hangs"] == 0 and rec["internal_errors"] == 0, (rec["examples"], out)
    assert rec["end"]["leaked_slots"] == 0 and rec["end"]["kv_invariant"] == "ok" and rec["end"]["alive"]
    assert rec["requests"].get(soak.SERVED, 0) > rec["requests"].get(soak.INJECTED, 0)
    assert rec["pass"] and f"injected faults: {faults['fired']} of {faults['items']} compute items" in out

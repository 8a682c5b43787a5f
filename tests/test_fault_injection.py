"""Failures injected into the compute side (forward, sampling, verify) and the host side (output
processing, grammar masks), with requests in flight, under the overlap and the plain loop: only the
request a fault concerns aborts, with a message (a batch of several that fails is re-run one request
at a time to find it; a fault that passes ends none); the others finish with exactly their
fault-free output; later calls succeed; no KV slot leaks."""
from __future__ import annotations

import threading

import pytest
import torch

import specjet
from robustness_helpers import assert_healthy, bounded, submit

RUNNERS = ["The quick brown fox", "Once upon a time", "1, 2, 3,"]
VICTIM = "A request that joins while the others decode"
LONG = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
SHORT = dict(LONG, max_new_tokens=12)


class Fault:
    """Wraps a callable: the first call for which ``when(*args)`` holds raises instead (every such
    call with ``once=False``)."""

    def __init__(self, fn, when=lambda *a, **k: True, once: bool = True):
        self.fn, self.when, self.once = fn, when, once
        self.armed = threading.Event()
        self.fired = threading.Event()

    def __call__(self, *args, **kwargs):
        if self.armed.is_set() and not (self.once and self.fired.is_set()) and self.when(*args, **kwargs):
            self.fired.set()
            raise RuntimeError("injected fault")
        return self.fn(*args, **kwargs)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096, disable_overlap_schedule=True,
                        disable_guided_drafting=True) as eng:
        return ([o["output_ids"] for o in eng.generate(RUNNERS, LONG)], eng.generate(VICTIM, SHORT)["output_ids"])


def make_engine(tiny_model_dir, loop, **kwargs):
    return specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096,
                          disable_overlap_schedule=loop == "plain", **kwargs)


def run_with_victim_joining(eng, fault: Fault):
    """Three requests decode; once they are under way the fault is armed and a fourth joins."""
    streams = [eng.generate(p, LONG, stream=True) for p in RUNNERS]
    firsts = [next(s) for s in streams]
    fault.armed.set()
    victim = bounded(eng.generate, VICTIM, SHORT)
    outs = []
    for first, stream in zip(firsts, streams):
        chunks = [first, *bounded(list, stream)]
        outs.append(([t for c in chunks for t in c["output_ids"]], chunks[-1]["meta_info"]["finish_reason"]))
    return victim, outs


@pytest.mark.parametrize("loop", ["overlap", "plain"])
@pytest.mark.parametrize("where", ["prefill forward", "prefill sampling"])
def test_a_passing_fault_in_a_lone_prefill_ends_no_request(tiny_model_dir, reference, loop, where):
    """A request joins three that decode; its prefill, alone in its batch, fails once. It is prefilled again
    (a fault that passes ends nothing) and every request finishes with exactly its fault-free output."""
    runner_ids, victim_ids = reference
    with make_engine(tiny_model_dir, loop) as eng:
        worker = eng.worker
        if where == "prefill forward":
            # Every prefill asks forward_lists first (the layer stack's one call, or None: the general path).
            fault = Fault(worker.runner.forward_lists, lambda *args, **kwargs: kwargs.get("last_logits", False))
            worker.runner.forward_lists = fault
        else:
            fault = Fault(worker.sample, lambda batch, *a: batch.kind.value == "prefill")
            worker.sample = fault
        victim, outs = run_with_victim_joining(eng, fault)
        assert fault.fired.is_set()
        assert victim["output_ids"] == victim_ids and victim["meta_info"]["finish_reason"]["type"] == "length"
        assert victim["meta_info"]["retractions"] == 1
        for (ids, reason), expected in zip(outs, runner_ids):
            assert reason["type"] == "length" and ids == expected
        stats = eng.get_server_info()["stats"]
        assert (stats["batch_failures"], stats["requests_isolated"], stats["request_errors"]) == (1, 1, 0)
        assert_healthy(eng)


@pytest.mark.parametrize("loop", ["overlap", "plain"])
def test_a_lone_request_whose_batches_keep_failing_ends_after_two(tiny_model_dir, reference, loop):
    """Every batch that holds the victim fails: it is tried alone twice, then ends with the error; the three
    requests decoding beside it finish exactly."""
    runner_ids, _ = reference
    with make_engine(tiny_model_dir, loop) as eng:
        seen = follow_victim(eng.worker, "forward")
        fault = Fault(eng.worker.runner.forward_lists, lambda *a, **k: seen["victim"], once=False)
        eng.worker.runner.forward_lists = fault
        streams = [eng.generate(p, LONG, stream=True) for p in RUNNERS]
        firsts = [next(s) for s in streams]
        fault.armed.set()
        victim = bounded(eng.generate, VICTIM, SHORT, rid="victim")
        assert_aborted_by_fault(victim)
        outs = [[first, *bounded(list, s)] for first, s in zip(firsts, streams)]
        for chunks, ids in zip(outs, runner_ids):
            assert [t for c in chunks for t in c["output_ids"]] == ids
        stats = eng.get_server_info()["stats"]
        assert (stats["batch_failures"], stats["requests_isolated"]) == (2, 1)
        assert_healthy(eng)


def follow_victim(worker, item: str, victim_rid: str = "victim") -> dict:
    """Wrap the worker's compute item (``forward`` or ``speculate``) so that, while it runs, ``seen["victim"]``
    says whether its batch holds the victim and ``seen["kind"]`` is the batch's kind: a fault deeper in the
    compute side keys on them (items run one at a time, on the compute stream)."""
    seen = {"victim": False, "kind": None}
    run = getattr(worker, item)

    def noting(batch, *args, **kwargs):
        seen["victim"] = any(inp.rid == victim_rid for inp in batch.inputs)
        seen["kind"] = batch.kind.value
        return run(batch, *args, **kwargs)

    setattr(worker, item, noting)
    return seen


def decode_fault(runner, when=lambda *a, **k: True, once: bool = True) -> Fault:
    """A fault in the target's decode step: its CUDA graph's replay, or on a CPU ``forward_lists`` (every
    decode step asks it first: the layer stack's one call, or None for the general path; a prefill asks
    it with ``last_logits``)."""
    if runner.graphs is not None:
        fault = Fault(runner.graphs.decode, when, once)
        runner.graphs.decode = fault
    else:
        fault = Fault(runner.forward_lists, lambda *a, **k: not k.get("last_logits", False) and when(*a, **k), once)
        runner.forward_lists = fault
    return fault


def plain_ids(tiny_model_dir, prompts, params) -> list[list[int]]:
    """Plain decoding's ids (no drafting of any kind), the reference every speculative path must give."""
    with make_engine(tiny_model_dir, "plain", disable_guided_drafting=True) as eng:
        ids = [o["output_ids"] for o in eng.generate(prompts, params)]
        assert_healthy(eng)
    return ids


def assert_runners_exact(outs, runner_ids):
    for out, expected in zip(outs, runner_ids):
        assert out["meta_info"]["finish_reason"]["type"] == "length", out["meta_info"]["finish_reason"]
        assert out["output_ids"] == expected


def assert_aborted_by_fault(out):
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "injected fault" in reason["message"], reason
    assert reason["status_code"] == 500 and reason["err_type"] == "internal_error"


@pytest.mark.parametrize("loop", ["overlap", "plain"])
def test_a_passing_decode_fault_ends_no_request(tiny_model_dir, reference, loop):
    """A decode batch of three fails once: no request's data is to blame, so the three are re-run, each alone
    until a decode step of its own succeeds, and all finish with exactly their fault-free output."""
    runner_ids, _ = reference
    with make_engine(tiny_model_dir, loop) as eng:
        fault = decode_fault(eng.worker.runner)
        fault.armed.set()
        outs = bounded(eng.generate, RUNNERS, LONG)
        assert fault.fired.is_set()
        assert_runners_exact(outs, runner_ids)
        assert all(o["meta_info"]["retractions"] == 1 for o in outs)
        stats = eng.get_server_info()["stats"]
        assert (stats["batch_failures"], stats["requests_isolated"], stats["request_errors"]) == (1, 3, 0)
        assert_healthy(eng)


@pytest.mark.parametrize("loop", ["overlap", "plain"])
def test_a_decode_fault_that_follows_one_request_ends_it_alone(tiny_model_dir, reference, loop):
    """Every decode step that holds the victim fails (its data, say, trips a kernel): the batch of four fails,
    its requests re-run alone, the victim's own step fails and ends it alone; the three others finish with
    exactly their fault-free output."""
    runner_ids, _ = reference
    with make_engine(tiny_model_dir, loop) as eng:
        seen = follow_victim(eng.worker, "forward")
        fault = decode_fault(eng.worker.runner, lambda *a, **k: seen["victim"] and seen["kind"] == "decode", once=False)
        fault.armed.set()
        outs = bounded(eng.generate, [*RUNNERS, VICTIM], LONG, rid=["a", "b", "c", "victim"])
        assert fault.fired.is_set()
        assert_aborted_by_fault(outs[3])
        assert_runners_exact(outs[:3], runner_ids)
        assert eng.get_server_info()["stats"]["requests_isolated"] == 5  # four, then the victim after its lone try
        assert [o["output_ids"] for o in bounded(eng.generate, RUNNERS, LONG)] == runner_ids
        assert_healthy(eng)


@pytest.mark.parametrize("loop", ["overlap", "plain"])
def test_a_prefill_fault_that_follows_one_request_ends_it_alone(tiny_model_dir, reference, loop):
    """Four prompts submitted together share one prefill batch, which fails whenever it holds the victim: the
    three others are prefilled again on their own and finish exactly; the victim ends alone."""
    runner_ids, _ = reference
    with make_engine(tiny_model_dir, loop) as eng:
        seen = follow_victim(eng.worker, "forward")
        fault = Fault(eng.worker.runner.forward_lists,
                      lambda *a, **k: k.get("last_logits", False) and seen["victim"], once=False)
        eng.worker.runner.forward_lists = fault
        fault.armed.set()
        outs = bounded(eng.generate, [*RUNNERS, VICTIM], LONG, rid=["a", "b", "c", "victim"])
        assert fault.fired.is_set()
        assert_aborted_by_fault(outs[3])
        assert_runners_exact(outs[:3], runner_ids)
        assert eng.get_server_info()["stats"]["requests_isolated"] == 5
        assert_healthy(eng)


@pytest.mark.parametrize("loop", ["overlap", "plain"])
@pytest.mark.parametrize("once", [True, False], ids=["passing", "following the victim"])
def test_a_verify_fault_in_a_speculative_batch(tiny_model_dir, reference, loop, once):
    """NGRAM verifies every request's tree in one target forward. A passing fault there ends no request; a
    fault in every verify that holds the victim ends the victim alone. The others' ids stay plain decoding's."""
    runner_ids, _ = reference
    with make_engine(tiny_model_dir, loop, speculative_algorithm="NGRAM") as eng:
        seen = follow_victim(eng.worker, "speculate")
        verifier = eng.worker.speculator.verifier
        fault = Fault(verifier.verify, lambda *a, **k: once or seen["victim"], once=once)
        verifier.verify = fault
        streams = [eng.generate(p, LONG, stream=True, rid=r) for p, r in zip([*RUNNERS, VICTIM], ["a", "b", "c", "victim"])]
        firsts = [next(s) for s in streams]
        fault.armed.set()
        outs = []
        for first, stream in zip(firsts, streams):
            chunks = [first, *bounded(list, stream)]
            outs.append({"output_ids": [t for c in chunks for t in c["output_ids"]], "meta_info": chunks[-1]["meta_info"]})
        assert fault.fired.is_set()
        assert_runners_exact(outs[:3], runner_ids)
        if once:
            assert outs[3]["meta_info"]["finish_reason"]["type"] == "length"
        else:
            assert_aborted_by_fault(outs[3])
        assert eng.get_server_info()["stats"]["requests_isolated"] == (4 if once else 5)
        assert [o["output_ids"] for o in bounded(eng.generate, RUNNERS, LONG)] == runner_ids
        assert_healthy(eng)


def test_a_re_run_prefill_still_gives_the_prompt_logprobs(tiny_model_dir):
    """A request asking for its prompt's logprobs shares a prefill batch that fails once. Its re-run must compute
    the prompt again rather than take it from the prefix cache (which holds it from an earlier request), or the
    logprobs it asked for would be missing."""
    prompt = " ".join(f"word{i}" for i in range(40))
    params = dict(SHORT, return_logprob=True, logprob_start_len=0)
    with make_engine(tiny_model_dir, "plain") as eng:
        expected = eng.generate(prompt, params)
        eng.generate(prompt, SHORT)  # the prompt is in the cache now
        seen = follow_victim(eng.worker, "forward")
        fault = Fault(eng.worker.runner.forward_lists, lambda *a, **k: seen["kind"] == "prefill")
        eng.worker.runner.forward_lists = fault
        fault.armed.set()
        got, other = bounded(eng.generate, [prompt, RUNNERS[0]], [params, SHORT])
        assert fault.fired.is_set() and got["meta_info"]["retractions"] == 1
        assert got["output_ids"] == expected["output_ids"]
        logprobs = got["meta_info"]["input_token_logprobs"]
        assert len(logprobs) > 40
        assert logprobs == expected["meta_info"]["input_token_logprobs"]
        assert all(lp is not None for lp, _, _ in logprobs[1:])
        assert other["meta_info"]["finish_reason"]["type"] == "length"
        assert_healthy(eng)


@pytest.mark.parametrize("loop", ["overlap", "plain"])
@pytest.mark.parametrize("where", ["stop checks", "streaming"])
def test_a_failing_host_step_aborts_only_its_request(tiny_model_dir, reference, loop, where, monkeypatch):
    """Host-side work (stop checks, detokenizing, the stream's chunk) is confined per request: the
    failing one ends alone, its batch-mates finish exactly as without the fault."""
    runner_ids, _ = reference
    with make_engine(tiny_model_dir, loop) as eng:
        sched = eng.scheduler
        victim_rid = "victim"
        if where == "stop checks":
            fault = Fault(sched._check_finished, lambda req, token: req.rid == victim_rid)
            sched._check_finished = fault
        else:
            import specjet.scheduler.scheduler as scheduler_module

            fault = Fault(scheduler_module.stream_chunk, lambda req: req.rid == victim_rid)
            monkeypatch.setattr(scheduler_module, "stream_chunk", fault)
        fault.armed.set()
        streams = [eng.generate(p, LONG, stream=True, rid=r)
                   for p, r in zip(RUNNERS, [victim_rid, "b", "c"])]
        chunks = [bounded(list, s) for s in streams]
        assert fault.fired.is_set()
        reason = chunks[0][-1]["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "injected fault" in reason["message"], reason
        assert reason["status_code"] == 500 and reason["err_type"] == "internal_error"
        for got, expected in zip(chunks[1:], runner_ids[1:]):
            assert [t for c in got for t in c["output_ids"]] == expected
            assert got[-1]["meta_info"]["finish_reason"]["type"] == "length"
        assert eng.get_server_info()["stats"]["request_errors"] == 1
        assert_healthy(eng)


@pytest.mark.parametrize("loop", ["overlap", "plain"])
def test_a_failing_grammar_mask_aborts_only_its_request(tiny_model_dir, loop, monkeypatch):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    params = dict(LONG, max_new_tokens=20, json_schema=schema)
    with make_engine(tiny_model_dir, loop) as eng:
        expected = [o["output_ids"] for o in eng.generate(["first", "second"], params)]
        import specjet.scheduler.scheduler as scheduler_module

        sched = eng.scheduler
        victim = {}
        grammar_ready = sched._grammar_ready

        def note_victim_grammar(req):  # runs at admission, before any mask of the request is built
            ready = grammar_ready(req)
            if ready and req.rid == "v":
                victim["grammar"] = req.grammar
            return ready

        sched._grammar_ready = note_victim_grammar
        fill = scheduler_module.fill_token_bitmasks
        # every mask fill that holds the victim's grammar fails: the batch's fill first, then the
        # victim's own when the scheduler retries request by request to find the one that fails
        fault = Fault(fill, lambda grammars, *a: any(g is victim.get("grammar") for g in grammars), once=False)
        fault.armed.set()
        monkeypatch.setattr(scheduler_module, "fill_token_bitmasks", fault)
        outs = bounded(eng.generate, ["first", "second"], params, rid=["v", "ok"])
        assert fault.fired.is_set()
        reason = outs[0]["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "injected fault" in reason["message"], reason
        assert reason["status_code"] == 500 and reason["err_type"] == "internal_error"
        assert outs[1]["output_ids"] == expected[1]
        assert outs[1]["meta_info"]["finish_reason"]["type"] == "stop"
        assert_healthy(eng)


LONG_PROMPT = " ".join(f"item {i} of the shared catalogue;" for i in range(40))  # ~240 tokens


@pytest.mark.parametrize("loop", ["overlap", "plain"])
def test_a_failing_prefill_chunk_aborts_its_request_and_caches_only_what_succeeded(tiny_model_dir, reference, loop):
    """A long prompt prefilled in 64-token chunks fails at its second chunk while three requests
    decode and a request with the same prompt waits to share it (in-batch prefix sharing), and again
    when it is re-run alone from its first chunk, now cached. The chunked request alone aborts; the runners finish exactly; the waiting request is not left behind
    and gets the fault-free output; the first chunk, which succeeded, may serve later hits, and they
    give the fault-free output too. No slot leaks."""
    runner_ids, _ = reference
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096, disable_radix_cache=True,
                        chunked_prefill_size=-1) as ref:
        expected = ref.generate(LONG_PROMPT, SHORT)["output_ids"]
    with make_engine(tiny_model_dir, loop, chunked_prefill_size=64) as eng:
        extends = []

        def second_chunk(*args, **kwargs):  # every prefill chunk asks forward_lists first
            if not kwargs.get("last_logits", False):
                return False
            extends.append(args)
            return len(extends) in (2, 3)  # its second chunk, then that chunk again on its lone re-run

        fault = Fault(eng.worker.runner.forward_lists, second_chunk, once=False)
        eng.worker.runner.forward_lists = fault
        streams = [eng.generate(p, LONG, stream=True) for p in RUNNERS]
        firsts = [next(s) for s in streams]
        extends.clear()
        fault.armed.set()
        victim = submit(eng.generate, LONG_PROMPT, SHORT)
        sharer = submit(eng.generate, LONG_PROMPT, SHORT)
        outs = [[first, *bounded(list, s)] for first, s in zip(firsts, streams)]
        results = [f.result(timeout=60) for f in (victim, sharer)]
        assert fault.fired.is_set()
        reasons = [r["meta_info"]["finish_reason"] for r in results]
        assert sum(r["type"] == "abort" and "injected fault" in r["message"] for r in reasons) == 1, reasons
        assert len(extends) >= 4  # the sharer's prefill ran after the two failures
        for r in results:
            if r["meta_info"]["finish_reason"]["type"] != "abort":
                assert r["output_ids"] == expected
        for chunks, ids in zip(outs, runner_ids):
            assert [t for c in chunks for t in c["output_ids"]] == ids
            assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
        again = bounded(eng.generate, LONG_PROMPT, SHORT)
        assert again["output_ids"] == expected
        assert again["meta_info"]["cached_tokens"] >= 64
        assert_healthy(eng)


@pytest.mark.parametrize("loop", ["overlap", "plain"])
def test_a_grammar_drafting_fault_ends_only_its_request(tiny_model_dir, loop, monkeypatch):
    """Guided drafting runs each constrained request's grammar on the compute side, inside the speculative batch
    (the forced-text search that once ran out of memory did). A fault there whenever the batch holds the victim
    ends the victim alone; the other constrained requests get exactly their fault-free output."""
    from specjet.spec_v2.grammar_guide import GrammarGuide

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["name", "n"]}
    params = dict(LONG, max_new_tokens=24, json_schema=schema)
    prompts = ["first", "second", "third"]
    with make_engine(tiny_model_dir, loop) as eng:
        expected = plain_ids(tiny_model_dir, prompts, params)
        seen = follow_victim(eng.worker, "speculate")
        fault = Fault(GrammarGuide.mask_tree, lambda *a, **k: seen["victim"], once=False)
        monkeypatch.setattr(GrammarGuide, "mask_tree", lambda self, *a, **k: fault(self, *a, **k))
        fault.armed.set()
        outs = bounded(eng.generate, [*prompts, "the victim"], params, rid=["a", "b", "c", "victim"])
        assert fault.fired.is_set()
        assert_aborted_by_fault(outs[3])
        assert [o["output_ids"] for o in outs[:3]] == expected
        assert all(o["meta_info"]["finish_reason"]["type"] != "abort" for o in outs[:3])
        assert eng.get_server_info()["stats"]["requests_isolated"] == 5
        assert_healthy(eng)


@pytest.mark.parametrize("loop", ["overlap", "plain"])
@pytest.mark.parametrize("alone", [False, True], ids=["beside others", "alone"])
def test_a_failing_grammar_fork_at_launch_ends_only_its_request(tiny_model_dir, loop, alone, monkeypatch):
    """Launching a speculative batch forks each constrained request's grammar on the host. A fork that fails ends
    that request alone (an internal error naming the step); the batch launches without it, or not at all when it
    was alone, and the engine goes on."""
    from specjet.grammar import RequestGrammar

    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}, "required": ["n", "s"]}
    params = dict(LONG, max_new_tokens=24, json_schema=schema)
    prompts = ["first", "second"]
    with make_engine(tiny_model_dir, loop) as eng:
        expected = plain_ids(tiny_model_dir, prompts, params)
        sched, victim = eng.scheduler, {}
        grammar_ready = sched._grammar_ready

        def note_victim_grammar(req):
            ready = grammar_ready(req)
            if ready and req.rid == "victim":
                victim["grammar"] = req.grammar
            return ready

        sched._grammar_ready = note_victim_grammar
        fault = Fault(RequestGrammar.fork, lambda grammar: grammar is victim.get("grammar"), once=False)
        monkeypatch.setattr(RequestGrammar, "fork", lambda self: fault(self))
        fault.armed.set()
        if alone:
            out = bounded(eng.generate, "the victim", params, rid="victim")
            reason = out["meta_info"]["finish_reason"]
        else:
            outs = bounded(eng.generate, [*prompts, "the victim"], params, rid=["a", "b", "victim"])
            assert [o["output_ids"] for o in outs[:2]] == expected
            reason = outs[2]["meta_info"]["finish_reason"]
        assert fault.fired.is_set()
        assert reason["type"] == "abort" and "forking its grammar" in reason["message"], reason
        assert reason["status_code"] == 500 and reason["err_type"] == "internal_error"
        assert eng.get_server_info()["stats"]["request_errors"] == 1
        assert [o["output_ids"] for o in bounded(eng.generate, prompts, params)] == expected
        assert_healthy(eng)


@pytest.mark.parametrize("loop", ["overlap", "plain"])
def test_a_request_whose_admission_fails_ends_alone(tiny_model_dir, reference, loop):
    """A request whose own set-up fails as the loop takes it in (its coins, its drafting) is answered with the
    error, not lost; the requests submitted in the same call run as without it, and it no longer counts as queued."""
    runner_ids, _ = reference
    with make_engine(tiny_model_dir, loop) as eng:
        sched = eng.scheduler
        fault = Fault(sched._admit, lambda req: req.rid == "victim", once=False)
        sched._admit = fault
        fault.armed.set()
        outs = bounded(eng.generate, [RUNNERS[0], VICTIM, RUNNERS[1]], LONG, rid=["a", "victim", "b"])
        assert fault.fired.is_set()
        reason = outs[1]["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "being admitted" in reason["message"], reason
        assert reason["status_code"] == 500 and reason["err_type"] == "internal_error"
        assert [outs[0]["output_ids"], outs[2]["output_ids"]] == runner_ids[:2]
        assert eng.get_server_info()["queued_requests"] == 0
        assert_healthy(eng)


@pytest.mark.parametrize("loop", ["overlap", "plain"])
def test_a_grammar_matcher_that_fails_to_start_ends_its_request_as_an_internal_error(tiny_model_dir, loop,
                                                                                      monkeypatch):
    """The grammar compiled, then its matcher could not be made: the engine's failure, not the request's (a 500
    for the server, where a spec's compile error is the caller's 400), and that request's alone."""
    import specjet.scheduler.scheduler as scheduler_module

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    params = dict(LONG, max_new_tokens=24, json_schema=schema)
    with make_engine(tiny_model_dir, loop) as eng:
        expected = plain_ids(tiny_model_dir, ["first"], params)
        real = scheduler_module.RequestGrammar
        victims = {"calls": 0}

        def failing_second(compiled, *rule):
            victims["calls"] += 1
            if victims["calls"] == 2:  # the second request's matcher
                raise RuntimeError("injected fault: no matcher")
            return real(compiled, *rule)

        monkeypatch.setattr(scheduler_module, "RequestGrammar", failing_second)
        outs = bounded(eng.generate, ["first", "second"], params, rid=["a", "victim"])
        monkeypatch.setattr(scheduler_module, "RequestGrammar", real)
        assert outs[0]["output_ids"] == expected[0]
        reason = outs[1]["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "making its grammar matcher" in reason["message"], reason
        assert reason["status_code"] == 500 and reason["err_type"] == "internal_error"
        assert eng.get_server_info()["stats"]["request_errors"] == 1
        assert_healthy(eng)


def test_a_failing_draft_release_strands_no_other_state_and_fails_no_batch():
    """Dropping ended requests' state rides on the next batch: a drafter that fails to drop one request's state
    must neither fail that batch nor leave the other requests' state behind."""
    from types import SimpleNamespace

    from specjet.scheduler.worker import ModelWorker

    dropped = []

    def release(rid):
        dropped.append(rid)
        if rid == "bad":
            raise RuntimeError("boom")

    runner = SimpleNamespace(device=torch.device("cpu"), head_takes_masks=False)
    worker = ModelWorker(runner, torch.zeros(1, 1), SimpleNamespace(release=release))
    worker._states.update({"a": object(), "bad": object(), "c": object(), "live": object()})
    worker.release(("a", "bad", "c"))
    assert dropped == ["a", "bad", "c"] and list(worker._states) == ["live"]

"""Property-based sweep over sampling-parameter dicts (hypothesis): whatever a caller passes, the
call either raises TypeError/ValueError at the door or completes with a finish reason, while an
innocent request running at the same time gets exactly its normal output; the scheduler thread is
alive after and no KV slot leaked."""
from __future__ import annotations

import math
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import specjet
from robustness_helpers import assert_healthy, bounded

INNOCENT = {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}

_scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-3, max_value=40), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.floats(min_value=0, max_value=2),
    st.text(max_size=6), st.sampled_from(["", " ", "\n", "}", "a", "\ufffd"]),
)
_values = st.one_of(_scalars, st.lists(_scalars, max_size=3), st.lists(st.lists(_scalars, max_size=2), max_size=2),
                    st.dictionaries(st.text(max_size=3), _scalars, max_size=2))
_plausible = {
    "max_new_tokens": st.integers(min_value=-2, max_value=12),
    "temperature": st.one_of(st.floats(min_value=0, max_value=3), st.sampled_from([0, 1e-30, math.nan, -1.0])),
    "top_p": st.one_of(st.floats(min_value=0, max_value=1), st.just(1)),
    "top_k": st.one_of(st.integers(min_value=-2, max_value=60), st.just(2**40), st.just(2**63)),
    "min_p": st.floats(min_value=-0.5, max_value=1.5),
    "seed": st.one_of(st.none(), st.integers(min_value=-1, max_value=2**64)),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3)),
    "stop_token_ids": st.lists(st.integers(min_value=-1, max_value=60000), max_size=3),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "json_schema": st.sampled_from([{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                                    {"type": "string", "maxLength": 4}, "{bad", '{"type": "number"}', 7]),
    "regex": st.sampled_from(["[a-c]{1,4}", "(", "x*y", ""]),
    "ebnf": st.sampled_from(['root ::= "yes" | "no"', "root ::= ", 'root ::= [0-9]+']),
    "frequency_penalty": st.floats(min_value=-2.5, max_value=2.5),
    "repetition_penalty": st.one_of(st.floats(min_value=0, max_value=2.5), st.just(math.inf)),
    "logit_bias": st.dictionaries(st.one_of(st.integers(min_value=-1, max_value=60000),
                                            st.sampled_from(["0", "17", "-3", "1e3", "49151", " 5", "x"])),
                                  st.one_of(st.floats(min_value=-101, max_value=101), st.just(math.nan)),
                                  max_size=4),
    "prediction": st.one_of(st.text(max_size=40), st.lists(st.integers(min_value=-1, max_value=60000), max_size=8),
                            st.sampled_from(["Some prompt Some prompt", '{"a": 1}', [1, 2, 3] * 4])),
}
NAMES = sorted(_plausible) + ["bogus_name"]


@st.composite
def sampling_dicts(draw):
    params = {}
    for name in draw(st.lists(st.sampled_from(NAMES), max_size=6, unique=True)):
        wild = name == "bogus_name" or draw(st.integers(0, 4)) == 0
        params[name] = draw(_values if wild else _plausible[name])
    params.setdefault("max_new_tokens", 6)
    if params["max_new_tokens"] is None:  # up to the context (test_engine): thousands of tokens, not a quick example
        params["max_new_tokens"] = 12
    if isinstance(params["max_new_tokens"], int) and not isinstance(params["max_new_tokens"], bool):
        params["max_new_tokens"] = min(params["max_new_tokens"], 12)  # keep each example quick
    return params


@pytest.fixture(scope="module", params=["overlap", "plain", "ngram"])
def engine(request, tiny_model_dir):
    # NGRAM: predictions, biases and penalties through drafting and tree verification.
    spec = {"speculative_algorithm": "NGRAM"} if request.param == "ngram" else {}
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096, random_seed=0,
                        disable_overlap_schedule=request.param == "plain", **spec) as eng:
        yield eng


def test_any_sampling_dict_raises_at_the_door_or_completes(engine):
    expected = bounded(engine.generate, "An innocent bystander", INNOCENT)["output_ids"]
    outcomes = {"refused": 0, "completed": 0}

    @settings(max_examples=120, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(params=sampling_dicts())
    def one(params):
        try:
            out = bounded(engine.generate, "Some prompt", params)
        except (TypeError, ValueError):
            outcomes["refused"] += 1
            return
        outcomes["completed"] += 1
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] in ("stop", "length", "abort"), reason
        if reason["type"] == "abort":  # only a grammar that fails to compile may end this way
            assert "internal error" not in reason["message"], reason
        assert len(out["output_ids"]) <= max(params["max_new_tokens"], 0) or reason["type"] == "abort"

    done, innocent_runs = threading.Event(), []

    def bystander():  # innocent requests, one after another, for as long as the sweep runs
        while not done.is_set():
            innocent_runs.append(engine.generate("An innocent bystander", INNOCENT)["output_ids"])

    thread = threading.Thread(target=bystander)
    thread.start()
    try:
        one()
    finally:
        done.set()
        thread.join(timeout=60)
    assert innocent_runs and all(ids == expected for ids in innocent_runs)
    assert outcomes["refused"] > 10 and outcomes["completed"] > 10, outcomes
    assert_healthy(engine)

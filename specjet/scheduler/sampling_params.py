"""Per-request sampling parameters, with SGLang's names, validated at the door.

Every value is checked for its type and range here, on the caller's thread, so that nothing that
reaches the scheduler thread can fail there: each value becomes a float32 or int64 tensor entry
(temperature, top_p, min_p, top_k), a coin key (kernels/coins.py), or a string the detokenizer
searches for. Checks that need the model (token ids within the vocabulary) are in
``check_token_ids``, which the engine calls with its vocabulary size.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from specjet.kernels.penalties import Penalties

# Below this a temperature is greedy: dividing logits by it would overflow float32 (SGLang uses
# the same cut-off).
GREEDY_TEMPERATURE = 1e-5
# The smallest repetition penalty: a seen token's positive logit is divided by it, and a smaller one
# could carry a large logit past float32's range, where every seen token ties at inf.
MIN_REPETITION_PENALTY = 1e-5
# Largest float32; a value above it becomes inf in the sampling tensors.
_FLOAT32_MAX = 3.4028234663852886e38
# A top_k at least this large keeps the whole vocabulary: it is stored as -1 (off), so the value
# that reaches the int64 tensor is always small.
TOP_K_ALL = 1 << 30
# The most alternatives a token's logprobs list (OpenAI's limit on top_logprobs).
MAX_TOP_LOGPROBS = 20
# Stop strings are searched after every token on the scheduler's thread, each from where a new match of it can
# begin (scheduler/detokenizer.py): their count and length bound that work, which every request waiting on that
# thread pays for (bench/RESULTS.md, session 104). OpenAI allows 4; these leave room for any real use.
MAX_STOP_STRINGS = 1024
MAX_STOP_CHARS = 4096
# A logit_bias key given as a string (JSON's object keys): a decimal token id, sign allowed (refused later).
_DECIMAL = re.compile(r"\s*-?[0-9]{1,18}\s*")
# An unsigned 64-bit seed (kernels/coins.py hashes it with each token's position).
_SEED_LIMIT = 1 << 64


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_unicode(name: str, text: str) -> None:
    """ValueError for text no tokenizer can take: a lone surrogate (JSON's "\\ud800" decodes to one)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"{name} is not valid Unicode: {error.reason} at index {error.start}") from None


def _real(name: str, value: Any, low: float, high: float, low_open: bool = False) -> float:
    if not _is_real(value):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if value < low or (low_open and value == low) or value > high:
        lo = "(" if low_open else "["
        raise ValueError(f"{name} must be in {lo}{low}, {high}], got {value}")
    return value


@dataclass
class SamplingParams:
    # None (SGLang's null): as many as the context leaves; the engine's door makes it that number, and refuses
    # a number that with the prompt does not fit the context.
    max_new_tokens: int | None = 128
    # SGLang's min_new_tokens: until the output holds this many tokens, its stop tokens (stop_token_ids, and EOS
    # unless ignore_eos) are not drawn (stop strings still end it, as in SGLang). Not with a grammar, whose end
    # it would contradict.
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    # Penalties (OpenAI's frequency/presence over the output so far, SGLang's repetition over the
    # prompt and output; specjet/kernels/penalties.py), the same in plain and speculative decoding.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # OpenAI's logit_bias: {token id: value in [-100, 100]} added to those tokens' logits after the penalties
    # (ids as ints or as the decimal strings JSON objects carry), plain and speculative decoding alike.
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # SGLang's: the text of a request that a stop token ended (one of stop_token_ids, EOS, a grammar's end) leaves
    # that token out, unless no_stop_trim (output_ids hold it either way).
    no_stop_trim: bool = False
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    # Each output token's log probability under the model's own next-token distribution (the log-softmax
    # of its logits, before grammar masks, penalties and temperature), and the ``top_logprobs_num`` most
    # likely tokens' (SGLang's names; meta_info's output_token_logprobs / output_top_logprobs).
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # The prompt's tokens from this position on get theirs too (meta_info's input_token_logprobs; -1: none).
    logprob_start_len: int = -1
    # OpenAI's predicted output: text (or token ids) the reply is expected to repeat for the most part (a
    # previous version of a document being edited, say). Where the engine speculates, drafting proposes the
    # prediction's continuation wherever the reply's last tokens match it; verification keeps the output
    # exactly what it would be without it. Token ids are matched as tokens, text as bytes (spec_v2/prediction.py).
    prediction: str | list[int] | None = None

    @classmethod
    def from_dict(cls, params: dict[str, Any] | None) -> "SamplingParams":
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise TypeError(f"sampling_params must be a dict (or a list of dicts, one per prompt), "
                            f"got {type(params).__name__}")
        params = dict(params)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(map(str, set(params) - known))
        if unknown:
            raise TypeError(f"unknown sampling parameter(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        if isinstance(params.get("stop"), str):
            params["stop"] = [params["stop"]]
        schema = params.get("json_schema")
        if isinstance(schema, type) and callable(getattr(schema, "model_json_schema", None)):
            params["json_schema"] = schema.model_json_schema()  # a pydantic model class: its schema
        if isinstance(params.get("json_schema"), (dict, bool)):
            try:
                params["json_schema"] = json.dumps(params["json_schema"])
            except RecursionError:
                raise ValueError("json_schema is nested too deeply") from None
            except (TypeError, ValueError) as exc:
                raise ValueError(f"json_schema is not JSON: {exc}") from None
        for key in ("stop", "stop_token_ids"):
            if params.get(key) is None:
                params.pop(key, None)
        sp = cls(**params)
        sp.validate()
        return sp

    def validate(self) -> None:
        """Type and range of every field; normalises top_k >= TOP_K_ALL to -1 and the lists to lists."""
        if not _is_int(self.max_new_tokens) and self.max_new_tokens is not None:
            raise TypeError(f"max_new_tokens must be an int, got {type(self.max_new_tokens).__name__}")
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not _is_int(self.min_new_tokens):
            raise TypeError(f"min_new_tokens must be an int, got {type(self.min_new_tokens).__name__}")
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        self.temperature = _real("temperature", self.temperature, 0.0, _FLOAT32_MAX)
        self.top_p = _real("top_p", self.top_p, 0.0, 1.0, low_open=True)
        self.min_p = _real("min_p", self.min_p, 0.0, 1.0)
        self.frequency_penalty = _real("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        self.presence_penalty = _real("presence_penalty", self.presence_penalty, -2.0, 2.0)
        self.repetition_penalty = _real("repetition_penalty", self.repetition_penalty, MIN_REPETITION_PENALTY, 2.0)
        self.logit_bias = self._bias_dict(self.logit_bias)
        if not _is_int(self.top_k):
            raise TypeError(f"top_k must be an int, got {type(self.top_k).__name__}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.top_k >= TOP_K_ALL:
            if self.top_k >= 1 << 63:  # could not be an int64 anywhere: surely a mistake
                raise ValueError(f"top_k must be below 2**63, got {self.top_k}")
            self.top_k = -1
        if self.seed is not None:
            if not _is_int(self.seed):
                raise TypeError(f"seed must be an int or None, got {type(self.seed).__name__} {self.seed!r}")
            if not 0 <= self.seed < _SEED_LIMIT:
                raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        self.stop = self._string_list("stop", self.stop)
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must be non-empty (an empty one would match at once)")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop holds {len(self.stop)} strings; at most {MAX_STOP_STRINGS}")
        longest = max(map(len, self.stop), default=0)
        if longest > MAX_STOP_CHARS:
            raise ValueError(f"stop strings must be at most {MAX_STOP_CHARS} characters, got one of {longest}")
        self.stop_token_ids = self._int_list("stop_token_ids", self.stop_token_ids)
        if not _is_int(self.top_logprobs_num):
            raise TypeError(f"top_logprobs_num must be an int, got {type(self.top_logprobs_num).__name__}")
        if not 0 <= self.top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs_num}")
        if self.top_logprobs_num and not self.return_logprob:
            raise ValueError("top_logprobs_num needs return_logprob=True")
        if not _is_int(self.logprob_start_len):
            raise TypeError(f"logprob_start_len must be an int, got {type(self.logprob_start_len).__name__}")
        if self.logprob_start_len < -1:
            raise ValueError(f"logprob_start_len must be -1 (no prompt logprobs) or >= 0, got {self.logprob_start_len}")
        if self.logprob_start_len >= 0 and not self.return_logprob:
            raise ValueError("logprob_start_len needs return_logprob=True")
        for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim", "return_logprob"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        for name in ("json_schema", "regex", "ebnf"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                kinds = "a str, a dict or a pydantic model class" if name == "json_schema" else "a str"
                raise TypeError(f"{name} must be {kinds}, got {type(value).__name__}")
        if isinstance(self.prediction, str):
            check_unicode("prediction", self.prediction)
        if self.prediction is not None and not isinstance(self.prediction, str):
            if not isinstance(self.prediction, (list, tuple)):
                raise TypeError(f"prediction must be a str or a list of token ids, got {type(self.prediction).__name__}")
            self.prediction = self._int_list("prediction", self.prediction)
        if not self.prediction:
            self.prediction = None
        constraints = [n for n in ("json_schema", "regex", "ebnf") if getattr(self, n) is not None]
        if len(constraints) > 1:
            raise ValueError(f"give at most one of json_schema, regex, ebnf (got {', '.join(constraints)})")
        if constraints and self.min_new_tokens:
            raise ValueError(f"min_new_tokens cannot go with {constraints[0]}: the grammar decides where the output "
                             f"ends")

    def check_token_ids(self, vocab_size: int, eos_token_ids=()) -> None:
        """Token ids that become tensor indices must be inside the model's vocabulary; ``eos_token_ids``: the
        model's, which min_new_tokens holds back (unless ignore_eos)."""
        self.__dict__["_eos_ids"] = tuple(sorted(t for t in eos_token_ids if 0 <= t < vocab_size))
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids must be in [0, {vocab_size}), got {bad[:5]}")
        if isinstance(self.prediction, list):
            bad = [t for t in self.prediction if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"prediction token ids must be in [0, {vocab_size}), got {bad[:5]}")
        bad = [t for t in self.logit_bias or () if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"logit_bias keys must be token ids in [0, {vocab_size}), got {bad[:5]}")

    @staticmethod
    def _bias_dict(value: Any) -> dict[int, float] | None:
        """``logit_bias`` as {int id: float}; None when empty."""
        if value is None:
            return None
        if not isinstance(value, dict):
            raise TypeError(f"logit_bias must be a dict of token id -> bias, got {type(value).__name__}")
        out: dict[int, float] = {}
        for key, bias in value.items():
            token = key
            if isinstance(key, str) and _DECIMAL.fullmatch(key):
                token = int(key)  # a JSON object's keys are strings
            if not _is_int(token):
                raise TypeError(f"logit_bias keys must be token ids (ints or decimal strings), got {key!r}")
            if token in out:
                raise ValueError(f"logit_bias gives token {token} twice")
            out[token] = _real(f"logit_bias[{key!r}]", bias, -100.0, 100.0)
        return out or None

    @staticmethod
    def _string_list(name: str, value: Any) -> list[str]:
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise TypeError(f"{name} must be a str or a list of str, got {type(value).__name__}")
        for item in value:
            if not isinstance(item, str):
                raise TypeError(f"{name} must be a str or a list of str; it holds a {type(item).__name__}")
        return list(value)

    @staticmethod
    def _int_list(name: str, value: Any) -> list[int]:
        if not isinstance(value, (list, tuple, set, frozenset)):
            raise TypeError(f"{name} must be a list of ints, got {type(value).__name__}")
        for item in value:
            if not _is_int(item):
                raise TypeError(f"{name} must be a list of ints; it holds a {type(item).__name__} {item!r}")
        return list(value)

    @property
    def penalties(self) -> Penalties | None:
        """The request's penalties, or None when it has none (read several times per request and iteration: made
        once for the values it holds, as a full-vocabulary logit_bias is 49,152 entries to copy)."""
        bias = self.logit_bias
        stops = self._held_stops()
        key = (self.frequency_penalty, self.presence_penalty, self.repetition_penalty, stops)
        cached = self.__dict__.get("_penalties")  # (key, the bias dict itself, held so its identity is its own)
        if cached is not None and cached[0] == key and cached[1] is bias:
            return cached[2]
        made = None
        if not (self.frequency_penalty == 0.0 and self.presence_penalty == 0.0 and self.repetition_penalty == 1.0
                and not bias and not stops):
            made = Penalties(self.frequency_penalty, self.presence_penalty, self.repetition_penalty,
                             tuple(bias) if bias else (), tuple(bias.values()) if bias else (),
                             self.min_new_tokens if stops else 0, stops)
        self.__dict__["_penalties"] = (key, bias, made)
        return made

    def _held_stops(self) -> tuple[int, ...]:
        """The tokens min_new_tokens holds back: the stop ids, and the model's EOS (``check_token_ids``) unless
        EOS is ignored; () without min_new_tokens."""
        if not self.min_new_tokens:
            return ()
        eos = () if self.ignore_eos else self.__dict__.get("_eos_ids", ())
        return tuple(sorted({*self.stop_token_ids, *eos}))

    @property
    def is_greedy(self) -> bool:
        # top_k == 1 is greedy too; treating it so skips the sort.
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def grammar_key(self) -> tuple[str, str] | None:
        for kind in ("json_schema", "regex", "ebnf"):
            value = getattr(self, kind)
            if value is not None:
                return kind, value
        return None

    @property
    def guided(self) -> bool:
        """Whether its drafts are guided (no model forward): it brings a prediction or decodes under a grammar."""
        return bool(self.prediction) or self.grammar_key is not None

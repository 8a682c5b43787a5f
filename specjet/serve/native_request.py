"""SGLang's ``GenerateReqInput`` (the body of ``POST /generate``) as specjet reads it: the fields specjet serves,
SGLang's fields and sampling parameters for features specjet lacks accepted at the values that ask for nothing
(a 400 naming any other value), routing and logging labels ignored, and the result turned into
``Engine.generate``'s arguments (``sampling_seed`` as the seed, a string ``rid`` for a list of prompts as r_0, r_1,
...; SGLang's ``n`` and a null ``max_new_tokens`` are the engine's own)."""
from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict

from specjet.engine import choices
from specjet.serve.errors import ApiError

# SGLang's sampling parameters for features specjet does not have, and the values at which they ask for nothing.
_SGLANG_DEFAULTS: dict[str, tuple] = {"spaces_between_special_tokens": (True,),
                                      "stop_regex": (None, "", []), "structural_tag": (None,), "custom_params": (None,),
                                      "stream_interval": (None,)}
# SGLang's GenerateReqInput fields for features specjet does not have, and the values (its defaults, null among them)
# at which they ask for nothing: accepted there, a 400 naming them otherwise.
_NOOP_FIELDS: dict[str, tuple] = {
    **{name: (None,) for name in (
        "lora_path", "lora_id", "image_data", "video_data", "audio_data", "input_embeds", "positional_embed_overrides",
        "token_ids_logprob", "modalities", "session_params", "custom_logit_processor", "bootstrap_host",
        "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "decode_tp_size", "data_parallel_rank",
        "routed_dp_rank", "disagg_prefill_dp_rank", "priority")},
    **{name: (None, False) for name in ("return_hidden_states", "return_routed_experts", "return_entropy",
                                        "return_bytes")}}


class GenerateRequest(BaseModel):
    """SGLang's GenerateReqInput, the fields specjet serves; unknown fields are a 400 that names them. The types
    are checked strictly (a JSON true is not an int), the sampling parameters by the engine at its door."""

    model_config = ConfigDict(extra="forbid", strict=True)

    text: Union[str, list[str], None] = None
    input_ids: Union[list[int], list[list[int]], None] = None
    sampling_params: Union[dict[str, Any], list[dict[str, Any]], None] = None
    stream: bool = False
    rid: Union[str, list[str], None] = None
    return_logprob: Union[bool, list[bool], None] = None
    top_logprobs_num: Union[int, list[int], None] = None
    logprob_start_len: Union[int, list[int], None] = None
    # The logprob triples' third element, each token's text (SGLang's frontend reads it), where True.
    return_text_in_logprobs: Optional[bool] = None
    stream_options: Optional[dict[str, Any]] = None  # SGLang's benchmarks send it; /generate has no usage chunk
    # SGLang fields for features specjet does not have (_NOOP_FIELDS: accepted at the values that ask for nothing),
    # and routing and logging labels (_IGNORED_FIELDS).
    lora_path: Any = None
    lora_id: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    input_embeds: Any = None
    positional_embed_overrides: Any = None
    token_ids_logprob: Any = None
    modalities: Any = None
    session_params: Any = None
    custom_logit_processor: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    bootstrap_pair_key: Any = None
    decode_tp_size: Any = None
    data_parallel_rank: Any = None
    routed_dp_rank: Any = None
    disagg_prefill_dp_rank: Any = None
    priority: Any = None
    return_hidden_states: Any = None
    return_routed_experts: Any = None
    return_entropy: Any = None
    return_bytes: Any = None
    model: Any = None
    log_metrics: Any = None
    no_logs: Any = None
    conversation_id: Any = None
    extra_key: Any = None
    custom_labels: Any = None
    external_trace_header: Any = None
    received_time: Any = None
    http_worker_ipc: Any = None

    def engine_kwargs(self) -> dict[str, Any]:
        """``Engine.generate``'s arguments (``logprob_start_len`` goes into the sampling parameters, where the
        engine reads it, as it reads SGLang's ``n``); a string ``rid`` with a list of prompts r_0, r_1, ... (SGLang's
        ``_normalize_rid``)."""
        if (self.text is None) == (self.input_ids is None):
            raise ApiError(400, "give exactly one of text and input_ids", "invalid_request_error", "text",
                           "invalid_value")
        for name, allowed in _NOOP_FIELDS.items():
            value = getattr(self, name)
            if not any(value == a and type(value) is type(a) for a in allowed):
                raise ApiError(400, f"{name}={value!r} is not supported by specjet (only {allowed[-1]!r}, SGLang's "
                                    f"default)", "invalid_request_error", name, "unsupported_value")
        n = parallel_samples(self.sampling_params)  # the engine expands n itself (engine/choices.py)
        for name in ("return_logprob", "top_logprobs_num", "logprob_start_len") if n > 1 else ():
            if isinstance(getattr(self, name), list):  # as SGLang: one a prompt cannot go with several samples
                raise ApiError(400, f"{name} given as a list cannot go with n > 1", "invalid_request_error", name,
                               "invalid_value")
        batch = self._batch()
        if isinstance(self.rid, str) and batch and n == 1:  # (with n > 1 the engine names the choices r_0, ...)
            return self.model_copy(update={"rid": [f"{self.rid}_{i}" for i in range(len(batch))]}).engine_kwargs()
        params = ([_without_sglang_defaults(d) for d in self.sampling_params]
                  if isinstance(self.sampling_params, list) else _without_sglang_defaults(self.sampling_params))
        wants = self.return_logprob
        if not (any(wants) if isinstance(wants, list) else wants):  # SGLang ignores the logprob fields then
            return self._kwargs(params, None)
        starts = self.logprob_start_len
        if isinstance(starts, list):
            count = 1 if batch is None else len(batch)
            if len(starts) != count:
                raise ApiError(400, f"{len(starts)} logprob_start_len values for {count} prompts",
                               "invalid_request_error", "logprob_start_len", "invalid_value")
            dicts = params if isinstance(params, list) else [params] * count
            if len(dicts) != count:
                raise ApiError(400, f"{len(dicts)} sampling_params for {count} prompts", "invalid_request_error",
                               "sampling_params", "invalid_value")
            params = [dict(d or {}, logprob_start_len=s) for d, s in zip(dicts, starts)]
        elif starts is not None:
            params = ([dict(d, logprob_start_len=starts) for d in params] if isinstance(params, list)
                      else dict(params or {}, logprob_start_len=starts))
        return self._kwargs(params, self.top_logprobs_num)

    def _batch(self) -> Optional[list]:
        """The prompts of a list of them (a list of strings, or of token id lists; an empty list is none), or None
        for one prompt (a string, or one list of token ids)."""
        if isinstance(self.text, list):
            return self.text
        ids = self.input_ids
        return ids if isinstance(ids, list) and (not ids or not isinstance(ids[0], int)) else None

    def _kwargs(self, params, top_logprobs_num) -> dict[str, Any]:
        return {"prompt": self.text, "input_ids": self.input_ids, "sampling_params": params, "rid": self.rid,
                "return_logprob": self.return_logprob, "top_logprobs_num": top_logprobs_num}


def parallel_samples(params) -> int:
    """SGLang's ``n`` (parallel samples a prompt): the same in every prompt's sampling parameters, in
    [1, MAX_CHOICES]; 1 when not given (the engine's rule, a 400 naming ``n`` here)."""
    try:
        return choices.parallel_samples(params if isinstance(params, list) else [params])
    except ValueError as error:
        raise ApiError(400, str(error), "invalid_request_error", "n", "invalid_value") from None


def _without_sglang_defaults(params: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """``params`` in the engine's terms: without SGLang's parameters for features specjet lacks, where they ask for
    nothing (a 400 naming one that asks for something) and SGLang's ``sampling_seed`` as ``seed`` (a null
    ``max_new_tokens``, SGLang's "up to the context", means that to the engine too)."""
    if params and "sampling_seed" in params:
        if params.get("seed") is not None and params["sampling_seed"] is not None:
            raise ApiError(400, "give seed or sampling_seed, not both", "invalid_request_error", "sampling_seed",
                           "invalid_value")
        seed = params["sampling_seed"] if params["sampling_seed"] is not None else params.get("seed")
        params = {k: v for k, v in params.items() if k not in ("seed", "sampling_seed")}
        if seed is not None:
            params["seed"] = seed
    if not params or not _SGLANG_DEFAULTS.keys() & params.keys():
        return params
    for name, allowed in _SGLANG_DEFAULTS.items():
        if name in params and not any(params[name] == a and type(params[name]) is type(a) for a in allowed):
            raise ApiError(400, f"sampling parameter {name}={params[name]!r} is not supported by specjet (only "
                                f"{allowed[0]!r}, SGLang's default)", "invalid_request_error", name,
                           "unsupported_value")
    return {k: v for k, v in params.items() if k not in _SGLANG_DEFAULTS}

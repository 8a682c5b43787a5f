"""Self-distillation data: replies the target writes itself, through specjet's batched Engine.

A draft head is judged by how often the target agrees with it, so the best training replies are
the target's own. Generation is the slowest stage of the pipeline; every reply is appended to a
jsonl cache as it finishes, so an interrupted run resumes where it stopped.
"""
from __future__ import annotations

import hashlib
import json
import pathlib
import time

import anyio
from tqdm.auto import tqdm

from specjet.train.data import FEW_SHOT_STOP, Sample, few_shot_prompt, gsm8k_question, prompt_ids


def generate_cached(get_engine, jobs: dict[pathlib.Path, list[tuple[list[int], dict, str]]],
                    desc: str = "generate") -> dict[pathlib.Path, list[Sample]]:
    """``jobs``: cache file -> requests (prompt ids, sampling params, source) in a fixed order.
    Returns, per cache file, one Sample per request in that order, leaving out aborted ones; a reply
    cut by ``max_new_tokens`` is kept (the target did write it). ``get_engine()`` is called only if
    something is left to generate.

    Every request of every job is submitted at once, so continuous batching keeps the batch full
    to the end; each reply is appended to its cache (with its request index) the moment it finishes."""
    done = {cache: _read_cache(cache, requests) for cache, requests in jobs.items()}
    todo = [(cache, i) for cache, requests in jobs.items() for i in range(len(requests)) if i not in done[cache]]
    if todo:
        engine = get_engine()
        total = sum(len(r) for r in jobs.values())
        bar = tqdm(total=total, initial=total - len(todo), desc=desc, unit="req")
        start, new_tokens = time.perf_counter(), 0
        files = {}

        async def one(cache: pathlib.Path, i: int) -> None:
            nonlocal new_tokens
            ids, params, source = jobs[cache][i]
            out = await engine.async_generate(input_ids=ids, sampling_params=params)
            aborted = out["meta_info"]["finish_reason"]["type"] == "abort"
            sample = Sample(ids=ids + ([] if aborted else list(out["output_ids"])), prompt_len=len(ids), source=source,
                            greedy=writes_greedy_choices(params))
            done[cache][i] = sample
            record = {"index": i, "ids": sample.ids, "prompt_len": sample.prompt_len, "source": sample.source,
                      "params": params_key(params)}
            files[cache].write(json.dumps(record) + "\n")
            files[cache].flush()
            new_tokens += len(out["output_ids"])
            bar.update()
            bar.set_postfix_str(f"{new_tokens / (time.perf_counter() - start):.0f} tok/s")

        async def run_all() -> None:
            async with anyio.create_task_group() as tg:
                for cache, i in todo:
                    tg.start_soon(one, cache, i)

        try:
            for cache in jobs:
                cache.parent.mkdir(parents=True, exist_ok=True)
                files[cache] = open(cache, "a", encoding="utf-8")
            anyio.run(run_all)
        finally:
            for f in files.values():
                f.close()
        bar.close()
    return {cache: [s for i, s in sorted(done[cache].items()) if len(s.ids) > s.prompt_len] for cache in jobs}


# Sampling parameters that leave every token the engine's argmax over the model's logits (a stop string only ends
# the reply); anything else (a grammar, logit_bias, ignore_eos, a temperature) may make a token another one.
_GREEDY_KEYS = frozenset({"temperature", "max_new_tokens", "stop", "seed"})


def writes_greedy_choices(params: dict) -> bool:
    """Whether a request with these sampling parameters writes the model's greedy token at every position."""
    return params.get("temperature") == 0 and set(params) <= _GREEDY_KEYS


def params_key(params: dict) -> str:
    """12 hex digits naming a request's sampling parameters (its schema, temperature, seed, limits), kept with its
    cached reply: a reply written under other parameters for the same prompt is not this request's."""
    return hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:12]


def _read_cache(cache: pathlib.Path, requests: list[tuple]) -> dict[int, Sample]:
    """The cached replies whose request (index, prompt and sampling parameters) is still asked for. A record
    written before the parameters were kept is taken for a request without a schema only (a GSM8K reply, whose
    parameters the cache's name and the prompt fix); a JSON instance's schema could have changed under the same
    prompt."""
    done: dict[int, Sample] = {}
    if cache.is_file():
        with open(cache, encoding="utf-8") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # a line torn by an interrupted write: generate it again
                    continue
                index = record.pop("index")
                sample = Sample(ids=record["ids"], prompt_len=record["prompt_len"], source=record["source"])
                if index >= len(requests) or sample.ids[:sample.prompt_len] != requests[index][0]:
                    continue
                params, kept = requests[index][1], record.get("params")
                if kept == params_key(params) or (kept is None and "json_schema" not in params):
                    sample.greedy = writes_greedy_choices(requests[index][1])
                    done[index] = sample
    return done


def gsm8k_requests(tokenizer, records: list[dict], max_new_tokens: int, source: str) -> list[tuple]:
    """Greedy replies to GSM8K questions, prompted as the GSM8K benchmark prompts (one user turn)."""
    params = {"temperature": 0, "max_new_tokens": max_new_tokens}
    return [(prompt_ids(tokenizer, gsm8k_question(r)), params, source) for r in records]


def gsm8k_few_shot_requests(tokenizer, shots: list[dict], records: list[dict], max_new_tokens: int,
                            source: str) -> list[tuple]:
    """Greedy replies in the GSM8K benchmark's default form: plain few-shot text, no chat template."""
    params = {"temperature": 0, "max_new_tokens": max_new_tokens, "stop": FEW_SHOT_STOP}
    return [(tokenizer(few_shot_prompt(shots, r["question"]))["input_ids"], params, source) for r in records]


def json_requests(tokenizer, schemas: list[dict], samples_per_schema: int, temperature: float,
                  max_new_tokens: int, source: str, seed: int) -> list[tuple]:
    """JSON instances under each schema: the first greedy, the others sampled at ``temperature``."""
    out = []
    for i, entry in enumerate(schemas):
        ids = prompt_ids(tokenizer, [{"role": "user", "content": entry["prompt"]}])
        for j in range(samples_per_schema):
            params = {"json_schema": entry["schema"], "max_new_tokens": max_new_tokens,
                      "temperature": 0 if j == 0 else temperature, "seed": seed + 1000 * i + j}
            out.append((ids, params, source))
    return out

"""Training sequences for a draft head: token ids in the target's chat format, cached as jsonl.

A ``Sample`` is one conversation as the target sees it: ``ids[:prompt_len]`` is the chat-formatted
prompt (ending in the assistant header), ``ids[prompt_len:]`` the reply, ending in the end-of-turn
token. Replies come from people (GSM8K's reference solutions, a user's jsonl) or from the target
itself (see generate.py); the head is trained on both, evaluated only on the target's own.
"""
from __future__ import annotations

import json
import pathlib
import random
from collections import Counter
from dataclasses import dataclass

import torch

# The GSM8K benchmark's default prompt (bench/gsm8k.py, as SGLang's benchmark builds it): the first
# NUM_SHOTS solved train examples, then the question with an open answer, ending at these strings.
NUM_SHOTS = 5
FEW_SHOT_STOP = ["Question", "Assistant:", "<|separator|>", "\n\n\n"]


@dataclass
class Sample:
    ids: list[int]
    prompt_len: int
    source: str
    # The generating engine wrote every reply token as its greedy choice, unconstrained (generate.py): the reply is
    # that engine's own labels. Taken from the request, never from the reply cache.
    greedy: bool = False


class InputFileError(ValueError):
    """A data file the trainer reads (``--gsm8k``, ``--extra-jsonl``, the schema set) that does not read as it should:
    the message names the file (and line)."""


def read_jsonl(path) -> list[dict]:
    """The JSON objects of a jsonl file, one a non-empty line; InputFileError naming the file and line otherwise."""
    records = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as error:
                    raise InputFileError(f"{path}:{number}: not a JSON line ({error})") from None
                if not isinstance(record, dict):
                    raise InputFileError(f"{path}:{number}: a JSON object per line expected, got a "
                                         f"{type(record).__name__}")
                records.append(record)
    except (OSError, UnicodeDecodeError) as error:
        raise InputFileError(f"{path}: cannot be read as UTF-8 text ({error})") from None
    return records


def _read_json(path: pathlib.Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise InputFileError(f"{path}: does not read as JSON ({error})") from None


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The chat template up to the assistant header, tokenized as the Engine tokenizes a prompt."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text)["input_ids"]


def conversation_sample(tokenizer, messages: list[dict], source: str, max_len: int) -> Sample:
    """A conversation whose last message is the assistant's reply: ids end at its end-of-turn token."""
    if messages[-1].get("role") != "assistant":
        raise ValueError(f"{source}: the last message must be the assistant's reply")
    prompt = prompt_ids(tokenizer, messages[:-1])
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    ids = tokenizer(text)["input_ids"]
    if ids[:len(prompt)] != prompt:
        raise ValueError(f"{source}: the chat template does not extend the prompt with the reply")
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    if eos in ids[len(prompt):]:  # drop what the template adds after the end of turn (a newline)
        ids = ids[:len(prompt) + ids[len(prompt):].index(eos) + 1]
    return Sample(ids=ids[:max_len], prompt_len=len(prompt), source=source)


def gsm8k_split(path, num_eval: int, seed: int) -> tuple[list[dict], list[dict], list[dict]]:
    """GSM8K *train* records: (the benchmark's few-shot examples, held-out questions for
    evaluation, the rest); the last two shuffled with ``seed`` and free of the shots.

    The GSM8K test split is the benchmark; nothing here reads it."""
    records = read_jsonl(path)
    for number, record in enumerate(records, 1):
        if not (isinstance(record.get("question"), str) and isinstance(record.get("answer"), str)):
            raise InputFileError(f"{path}: record {number} lacks the GSM8K fields 'question' and 'answer' (strings)")
    shots = records[:NUM_SHOTS]
    shuffled = list(records)
    random.Random(seed).shuffle(shuffled)
    shot_questions = {r["question"] for r in shots}
    held, rest = shuffled[:num_eval], shuffled[num_eval:]
    return shots, [r for r in held if r["question"] not in shot_questions], \
        [r for r in rest if r["question"] not in shot_questions]


def gsm8k_question(record: dict) -> list[dict]:
    return [{"role": "user", "content": record["question"]}]


def few_shot_prompt(shots: list[dict], question: str) -> str:
    """The benchmark's plain-text few-shot prompt (solutions verbatim, calculator notes included)."""
    solved = "".join(f"Question: {s['question']}\nAnswer: {s['answer']}\n\n" for s in shots)
    return f"{solved}Question: {question}\nAnswer:"


def gsm8k_human_samples(tokenizer, records: list[dict], max_len: int) -> list[Sample]:
    """The reference solutions, verbatim, as the assistant's reply. Their calculator notes
    ("<<48/2=24>>") stay: prompted with few-shot examples the target writes them too."""
    out = []
    for r in records:
        messages = gsm8k_question(r) + [{"role": "assistant", "content": r["answer"]}]
        out.append(conversation_sample(tokenizer, messages, "gsm8k_human", max_len))
    return out


def extra_samples(tokenizer, path, max_len: int) -> list[Sample]:
    """A user's jsonl: each line ``{"messages": [...]}`` (ending in an assistant turn) or ``{"text": ...}``
    (plain text, used as is, all of it counted as reply)."""
    out = []
    for i, record in enumerate(read_jsonl(path)):
        where = f"{path}:{i + 1}"
        if "messages" in record:
            messages = record["messages"]
            if not (isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)):
                raise InputFileError(f"{where}: 'messages' must be a non-empty list of messages")
            try:
                out.append(conversation_sample(tokenizer, messages, "extra", max_len))
            except ValueError as error:  # (its message names the source "extra", not the line)
                raise InputFileError(f"{where}: {str(error).removeprefix('extra: ')}") from None
        elif "text" in record:
            if not isinstance(record["text"], str):
                raise InputFileError(f"{where}: 'text' must be a string")
            ids = tokenizer(record["text"])["input_ids"][:max_len]
            if len(ids) >= 2:
                out.append(Sample(ids=ids, prompt_len=0, source="extra"))
        else:
            raise InputFileError(f"{where}: expected a 'messages' or a 'text' field")
    return out


def load_schemas(folder) -> list[dict]:
    """The JSON-schema set (index.json lists each schema file with a prompt), in index order."""
    folder = pathlib.Path(folder)
    index = _read_json(folder / "index.json")
    entries = index.get("schemas") if isinstance(index, dict) else None
    if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("file"), str) for e in entries):
        raise InputFileError(f"{folder / 'index.json'}: expected {{\"schemas\": [{{\"file\": ..., \"prompt\": ...}}, ...]}}")
    return [dict(e, schema=_read_json(folder / e["file"])) for e in entries]


def hot_token_ids(samples: list[Sample], k: int, vocab_size: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The ``k`` ids that occur most often in ``samples`` (ties by id), plus ``always``; sorted."""
    counts = Counter()
    for s in samples:
        counts.update(s.ids)
    chosen = set(always)
    for token, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(chosen) >= k:
            break
        chosen.add(token)
    # Fewer distinct ids than k in the data: fill with the lowest unused ids, so K is always k.
    filler = (i for i in range(vocab_size) if i not in chosen)
    while len(chosen) < min(k, vocab_size):
        chosen.add(next(filler))
    return torch.tensor(sorted(chosen), dtype=torch.int64)


def coverage(samples: list[Sample], hot: torch.Tensor) -> float:
    """Fraction of reply tokens inside the hot vocabulary."""
    hot_set = set(hot.tolist())
    total = hit = 0
    for s in samples:
        reply = s.ids[s.prompt_len:]
        total += len(reply)
        hit += sum(t in hot_set for t in reply)
    return hit / max(total, 1)

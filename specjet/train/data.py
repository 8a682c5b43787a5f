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


def read_jsonl(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


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
            out.append(conversation_sample(tokenizer, record["messages"], "extra", max_len))
        elif "text" in record:
            ids = tokenizer(record["text"])["input_ids"][:max_len]
            if len(ids) >= 2:
                out.append(Sample(ids=ids, prompt_len=0, source="extra"))
        else:
            raise ValueError(f"{where}: expected a 'messages' or a 'text' field")
    return out


def load_schemas(folder) -> list[dict]:
    """The JSON-schema set (index.json lists each schema file with a prompt), in index order."""
    folder = pathlib.Path(folder)
    entries = json.loads((folder / "index.json").read_text())["schemas"]
    return [dict(e, schema=json.loads((folder / e["file"]).read_text())) for e in entries]


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

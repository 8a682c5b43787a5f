"""OpenAI's ``usage.completion_tokens_details`` for a predicted output: how many of the prediction's tokens appear in
the completion, in order (accepted), and how many do not (rejected), on the tokenizer's split of both texts. The
match is difflib's matching blocks (the longest common runs, in order); drafting itself does not need it (the
engine matches the prediction as bytes wherever the reply reaches it), so it is counted once the reply is done."""
from __future__ import annotations

import difflib

from specjet.serve.protocol import CompletionTokensDetails


def prediction_details(tokenizer, prediction: str, completions: list[str]) -> CompletionTokensDetails:
    """Summed over ``completions`` (a response's choices), each against the whole prediction."""
    predicted = tokenizer(prediction, add_special_tokens=False)["input_ids"]
    accepted = rejected = 0
    for text in completions:
        got = tokenizer(text, add_special_tokens=False)["input_ids"]
        matcher = difflib.SequenceMatcher(None, predicted, got, autojunk=False)
        same = sum(block.size for block in matcher.get_matching_blocks())
        accepted += same
        rejected += len(predicted) - same
    return CompletionTokensDetails(accepted_prediction_tokens=accepted, rejected_prediction_tokens=rejected)

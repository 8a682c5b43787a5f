"""Per-request sampling parameters, with SGLang's names, validated at the door."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    @classmethod
    def from_dict(cls, params: dict[str, Any] | None) -> "SamplingParams":
        params = dict(params or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise TypeError(f"unknown sampling parameter(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        if isinstance(params.get("stop"), str):
            params["stop"] = [params["stop"]]
        if isinstance(params.get("json_schema"), dict):
            params["json_schema"] = json.dumps(params["json_schema"])
        for key in ("stop", "stop_token_ids"):
            if params.get(key) is None:
                params.pop(key, None)
        sp = cls(**params)
        sp.validate()
        return sp

    def validate(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be a non-negative int, got {self.max_new_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        constraints = [n for n in ("json_schema", "regex", "ebnf") if getattr(self, n) is not None]
        if len(constraints) > 1:
            raise ValueError(f"give at most one of json_schema, regex, ebnf (got {', '.join(constraints)})")

    @property
    def is_greedy(self) -> bool:
        # top_k == 1 is greedy too; treating it so skips the sort.
        return self.temperature == 0 or self.top_k == 1

    @property
    def grammar_key(self) -> tuple[str, str] | None:
        for kind in ("json_schema", "regex", "ebnf"):
            value = getattr(self, kind)
            if value is not None:
                return kind, value
        return None

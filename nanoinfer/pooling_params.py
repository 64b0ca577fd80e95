"""Embeddings: what a request asks of its vector (vLLM's PoolingParams), and what the model's folder says of how
its hidden states become one (sentence-transformers' pooling and normalize modules).

An engine built with `runner="pooling"` runs each prompt through the model once and pools the final (normed)
hidden states of its tokens into one vector: the last token's (LAST, the decoder embedding models' way: the
only one that can read cached prompt prefixes, since the last token is always computed), their mean (MEAN) or
the first token's (CLS). The core returns that raw vector; the front end cuts it to `dimensions` and
normalizes it, per request."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass
class PoolingParams:
    """`normalize`: scale the vector to unit length (None: as the model's folder says, else True);
    `dimensions`: keep the first `dimensions` values (models trained for it only: Matryoshka embeddings);
    `truncate_prompt_tokens`: keep only the prompt's last tokens (-1: as many as max_model_len allows)."""

    normalize: bool | None = None
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise TypeError(f"normalize must be a bool or None, got {self.normalize!r:.40}")
        for name in ("dimensions", "truncate_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r:.40}")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be at least 1, got {self.dimensions}")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens not in (-1,) and \
                self.truncate_prompt_tokens < 1:
            raise ValueError(f"truncate_prompt_tokens must be -1 or at least 1, got {self.truncate_prompt_tokens}")


@dataclass(frozen=True)
class PoolerConfig:
    """How this model's hidden states become an embedding."""

    pooling_type: str = "LAST"
    normalize: bool = True
    matryoshka: bool = False  # its vectors may be cut to fewer dimensions
    matryoshka_dimensions: tuple[int, ...] | None = None  # ... to these only, where the model names them

    @classmethod
    def resolve(cls, model_dir: str | None, hf_config, override: dict | None) -> PoolerConfig:
        """sentence-transformers' files in the model's folder (`1_Pooling/config.json`, a Normalize module in
        `modules.json`) if it has them, else LAST pooling, normalized (vLLM's default for a decoder model);
        `override` (the engine's `pooler_config`) wins over both."""
        pooling_type, normalize = "LAST", True
        folder = Path(model_dir) if model_dir is not None else None  # a folder, or dummy weights' config.json
        if folder is not None and folder.is_dir() and (folder / "modules.json").is_file():
            modules = json.loads((folder / "modules.json").read_text())
            normalize = any(m.get("type", "").endswith("Normalize") for m in modules)
            pooling = next((m for m in modules if m.get("type", "").endswith("Pooling")), None)
            settings = folder / (pooling or {}).get("path", "1_Pooling") / "config.json"
            if settings.is_file():
                modes = json.loads(settings.read_text())
                pooling_type = next((kind for key, kind in (("pooling_mode_lasttoken", "LAST"),
                                                            ("pooling_mode_mean_tokens", "MEAN"),
                                                            ("pooling_mode_cls_token", "CLS")) if modes.get(key)),
                                    pooling_type)
        override = dict(override or {})
        unknown = sorted(set(override) - {"pooling_type", "normalize"})
        if unknown:
            raise ValueError(f"pooler_config takes 'pooling_type' and 'normalize', got {unknown}")
        pooling_type = override.get("pooling_type", pooling_type)
        normalize = override.get("normalize", normalize)
        if pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {list(POOLING_TYPES)}, got {pooling_type!r:.40}")
        if not isinstance(normalize, bool):
            raise TypeError(f"pooler_config normalize must be a bool, got {normalize!r:.40}")
        dimensions = getattr(hf_config, "matryoshka_dimensions", None)
        matryoshka = bool(getattr(hf_config, "is_matryoshka", False) or dimensions)
        return cls(pooling_type, normalize, matryoshka, tuple(dimensions) if dimensions else None)

    def check(self, params: PoolingParams, hidden_size: int) -> None:
        """A request's `dimensions` this model can give (ValueError otherwise), checked at admission."""
        if params.dimensions is None:
            return
        if not self.matryoshka:
            raise ValueError("dimensions is not supported by this model (it is not a Matryoshka embedding model: "
                             "a shortened vector would be a poor embedding)")
        if params.dimensions > hidden_size:
            raise ValueError(f"dimensions ({params.dimensions}) is more than the model's {hidden_size}")
        if self.matryoshka_dimensions and params.dimensions not in self.matryoshka_dimensions:  # as vLLM's
            raise ValueError(f"dimensions ({params.dimensions}) is not one this model was trained to give: "
                             f"{list(self.matryoshka_dimensions)}")

    def finish(self, vector: list[float], params: PoolingParams) -> list[float]:
        """The request's embedding from the pooled vector: cut to `dimensions`, then normalized if asked."""
        if params.dimensions is not None:
            vector = vector[: params.dimensions]
        if self.normalize if params.normalize is None else params.normalize:
            norm = math.sqrt(math.fsum(v * v for v in vector))
            vector = [v / max(norm, 1e-12) for v in vector]
        return vector


def score_pairs(num_1: int, num_2: int) -> list[tuple[int, int]]:
    """vLLM's pairing of a score request's two sides: one text against each of the other side's, or the two
    sides element by element."""
    if not num_1 or not num_2:
        raise ValueError("each side of a score request needs at least one text")
    if num_1 == 1:
        return [(0, j) for j in range(num_2)]
    if num_1 == num_2:
        return [(i, i) for i in range(num_1)]
    raise ValueError(f"the first side of a score request has {num_1} texts and the second {num_2}: give one "
                     f"first text, or as many as the second side has")


def pair_scores(side_1: list[list[float]], side_2: list[list[float]]) -> list[float]:
    """Each pair's score, the two sides' embeddings paired as `score_pairs` pairs them."""
    return [cosine(side_1[a], side_2[b]) for a, b in score_pairs(len(side_1), len(side_2))]


def cosine(a: list[float], b: list[float]) -> float:
    """The cosine similarity of two embeddings: a bi-encoder's score (vLLM's for embedding models)."""
    dot = math.fsum(x * y for x, y in zip(a, b))
    return dot / max(math.sqrt(math.fsum(x * x for x in a) * math.fsum(y * y for y in b)), 1e-12)

"""nanoinfer: a small, fast LLM inference and serving engine."""

from nanoinfer.config import EngineConfig
from nanoinfer.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from nanoinfer.engine.llm import LLM
from nanoinfer.outputs import (CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob, RequestOutput,
                               ScoringOutput, ScoringRequestOutput)
from nanoinfer.pooling_params import PoolingParams
from nanoinfer.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "EngineConfig", "RequestOutput", "RequestOutputKind", "CompletionOutput", "Logprob",
           "PoolingParams", "EmbeddingRequestOutput", "EmbeddingOutput", "ScoringRequestOutput", "ScoringOutput",
           "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence",
           "__version__"]

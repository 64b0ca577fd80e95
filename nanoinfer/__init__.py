"""nanoinfer: a small, fast LLM inference and serving engine."""

from nanoinfer.config import EngineArgs, EngineConfig
from nanoinfer.engine.async_llm import AsyncEngineArgs, AsyncLLM, AsyncLLMEngine
from nanoinfer.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from nanoinfer.engine.llm import LLM
from nanoinfer.engine.llm_engine import LLMEngine
from nanoinfer.inputs import PromptType, TextPrompt, TokensPrompt
from nanoinfer.lora.request import LoRARequest
from nanoinfer.outputs import (CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob, PoolingOutput,
                               PoolingRequestOutput, RequestOutput, ScoringOutput, ScoringRequestOutput)
from nanoinfer.pooling_params import PoolingParams
from nanoinfer.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "EngineArgs", "EngineConfig", "AsyncLLM", "AsyncLLMEngine", "AsyncEngineArgs",
           "SamplingParams", "StructuredOutputsParams", "RequestOutput", "RequestOutputKind", "CompletionOutput",
           "Logprob", "PromptType", "TextPrompt", "TokensPrompt", "PoolingParams", "EmbeddingRequestOutput",
           "EmbeddingOutput", "PoolingRequestOutput", "PoolingOutput", "ScoringRequestOutput", "ScoringOutput",
           "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence", "LoRARequest", "__version__"]

"""moeserve: serve DeepSeek-V3-class MoE models, and plan their deployments."""
from moeserve.sampling_params import GuidedDecodingParams, SamplingParams, StructuredOutputsParams
from moeserve.version import __version__

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "GuidedDecodingParams", "RequestOutput",
           "CompletionOutput", "Logprob", "__version__"]


def __getattr__(name: str):
    # Lazy: `import moeserve` stays light for API-server processes and the planner.
    if name == "LLM":
        from moeserve.llm import LLM
        return LLM
    if name in ("RequestOutput", "CompletionOutput", "Logprob"):
        from moeserve import outputs
        return getattr(outputs, name)
    raise AttributeError(f"module 'moeserve' has no attribute {name!r}")

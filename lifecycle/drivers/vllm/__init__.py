"""kvlife inside vLLM: a KV connector driven by kvlife's lifecycle and policies, a recording
wrapper that writes any connector's lifecycle as a kvlife trace, simulated workers, and the
differential comparison against vLLM's own scheduler.

Everything here may import vLLM; nothing outside this package does. The public names are
re-exported by ``kvlife.vllm``.
"""

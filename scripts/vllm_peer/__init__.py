"""vLLM's own tests as kvlife's peer suite (docs/vllm.md): run by ``scripts/vllm-peer-suite.sh``."""

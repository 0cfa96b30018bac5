"""kvlife inside vLLM (needs vLLM; see docs/vllm.md and scripts/install-vllm.sh).

``KVLifeConnector`` is a vLLM KV connector whose scheduler side is kvlife's connector core
and policy stack; ``RecordingConnector`` (``RecordingConnectorHMA`` for an inner connector
with HMA support) wraps any connector and writes the lifecycle it observes as a kvlife
trace. Load them in vLLM with ``"kv_connector_module_path": "kvlife.vllm"``.
"""

from kvlife.lifecycle.drivers.vllm.connector import KVLifeConnector
from kvlife.lifecycle.drivers.vllm.recording import RecordingConnector, RecordingConnectorHMA
from kvlife.lifecycle.drivers.vllm.worker import HostPoolWorker, SimulatedWorker

__all__ = ["HostPoolWorker", "KVLifeConnector", "RecordingConnector", "RecordingConnectorHMA", "SimulatedWorker"]

"""zkv asks vLLM for PIECEWISE CUDA graphs. A forward's attention layers wait for zkv's loads
(``wait_for_layer_load``), and a full CUDA graph replays the kernels without that Python:
a layer would read blocks zkv has not written yet. vLLM asks the connector class
(``requires_piecewise_for_cudagraph``) and then runs PIECEWISE graphs, which keep the
attention, and the wait, outside the graph.

In a child process (importing vLLM here would change this test process: its warnings,
logging and torch settings). vLLM's CPU platform has no CUDA graphs, so the child makes it
answer as a CUDA platform does (static graphs supported, no CPU rewrite of the
compilation config) and lets VllmConfig choose the mode from the README's connector
config.
"""

from __future__ import annotations

import pytest

from tests.integrations.child import run_child

pytest.importorskip("vllm", reason="needs vLLM's CPU build: pip install -e '.[vllm]'")

CHILD = r'''
import json, warnings
warnings.simplefilter("ignore")
from vllm.config import CompilationConfig, KVTransferConfig, VllmConfig
from vllm.config.compilation import CompilationMode, CUDAGraphMode
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.platforms import current_platform

platform = type(current_platform)
platform.support_static_graph_mode = classmethod(lambda cls: True)
platform.check_and_update_config = classmethod(lambda cls, config: None)
tc = KVTransferConfig(kv_connector="ZkvConnector",
                      kv_connector_module_path="zkv.integrations.vllm_connector",
                      kv_role="kv_both", kv_connector_extra_config={"host_bytes": "8GiB"})
cls = KVConnectorFactory.get_connector_class(tc)
config = VllmConfig(kv_transfer_config=tc, compilation_config=CompilationConfig(
    mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE))
print(json.dumps({"class": cls.__name__,
                  "piecewise": cls.requires_piecewise_for_cudagraph({}),
                  "mode": config.compilation_config.cudagraph_mode.name}))
'''


def test_full_cuda_graphs_become_piecewise() -> None:
    got = run_child(CHILD)
    assert got == {"class": "ZkvConnector", "piecewise": True, "mode": "PIECEWISE"}, got

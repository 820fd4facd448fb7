"""The KV core: one implementation of TokenCake's KV mechanism, driven by two backends.

It holds every rule (offload planning, device holds and reserves, prefetch and top-up, demand
load and provenance, stall expiry, copy-job lifecycle, stats) and no I/O: the vLLM connector
(``tokencake/serving/vllm/``) and the simulator (``tokencake/sim/``) give it a block pool, copy
completions and a clock through the interfaces of :mod:`tokencake.serving.kvcore.ports`. No module
here imports vLLM or torch.
"""

from tokencake.serving.kvcore.ports import DeviceBlock, DevicePool

__all__ = ["DeviceBlock", "DevicePool"]

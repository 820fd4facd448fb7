"""Scheduler-side half of the connector: the KV core (``tokencake/serving/kvcore/``) on vLLM.

vLLM's hooks reach the core through :class:`SchedulerSide`, which only translates: vLLM's
``BlockPool`` becomes the core's :class:`~tokencake.serving.kvcore.ports.DevicePool`
(``device_pool.py``), the private block-pool internals are checked once (``_blockpool.check``),
and the step's copy jobs travel to the workers as :class:`TokenCakeMetadata`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokencake.serving.kvcore.core import READINESS, KVCore, request_meta
from tokencake.serving.options import Options
from tokencake.serving.vllm import _blockpool as bp
from tokencake.serving.vllm.device_pool import VllmDevicePool
from tokencake.serving.vllm.metadata import TokenCakeMetadata

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool

__all__ = ["READINESS", "Options", "SchedulerSide", "request_meta"]


class SchedulerSide(KVCore):
    """The KV core bound to vLLM's block pool and workers."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(private_api=bp.check(), **kwargs)

    def bind_pool(self, pool: BlockPool) -> None:  # type: ignore[override]
        super().bind_pool(VllmDevicePool(pool))

    def build_meta(self) -> TokenCakeMetadata:
        """The step's policy work and its copy jobs, for the workers."""
        return TokenCakeMetadata(self.build_jobs(), release_after_report=True)

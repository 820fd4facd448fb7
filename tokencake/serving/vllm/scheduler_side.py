"""Scheduler-side half of the connector: the KV core (``tokencake/serving/kvcore/``) on vLLM.

vLLM's hooks reach the core through :class:`SchedulerSide`, which only translates: vLLM's
``BlockPool`` becomes the core's :class:`~tokencake.serving.kvcore.ports.DevicePool`
(``device_pool.py``), the private block-pool internals are checked once (``_blockpool.check``),
the step's copy jobs travel to the workers as :class:`TokenCakeMetadata`, and a device prefix-cache
reset that vLLM does not pass on to the connector is detected here and applied to the core.
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
        #: The device pool's prefix-cache epoch the host state is valid for (``follow_pool_reset``);
        #: a strong reference, so a later epoch can never share its identity.
        self._pool_epoch: object | None = None

    def bind_pool(self, pool: BlockPool) -> None:  # type: ignore[override]
        super().bind_pool(VllmDevicePool(pool))
        self._pool_epoch = bp.cache_epoch(pool)

    def reset_cache(self) -> bool:
        """The core's reset; the pool's epoch is recorded only once it succeeded (this reset covers
        the pool's as well): a reset that raised partway is run again by ``follow_pool_reset``."""
        done = super().reset_cache()
        if isinstance(self.pool, VllmDevicePool):
            self._pool_epoch = bp.cache_epoch(self.pool.pool)
        return done

    def follow_pool_reset(self) -> bool:
        """Do what ``reset_cache`` does if vLLM reset the device prefix cache since the last call
        (or ``reset_cache``); returns whether it did.

        vLLM's ``reset_prefix_cache`` (``POST /reset_prefix_cache``, a weight update) tells the
        connector only with ``reset_connector=True``, which the API defaults to off; the host
        copies hold KV of the old weights as much as the device blocks did. The connector calls
        this first in every hook that serves, plans or commits a copy, so nothing from before the
        reset is served, whichever scheduler class runs and however the reset was asked for.
        """
        if not isinstance(self.pool, VllmDevicePool) or bp.cache_epoch(self.pool.pool) is self._pool_epoch:
            return False
        self.stats.inc("reset.device_only")
        return self.reset_cache()

    def build_meta(self) -> TokenCakeMetadata:
        """The step's policy work and its copy jobs, for the workers."""
        return TokenCakeMetadata(self.build_jobs(), release_after_report=True)

"""``KVBridgeConnector``: vLLM's v1 KV connector API over kvbridge.

Loaded by vLLM from ``--kv-transfer-config '{"kv_connector": "KVBridgeConnector",
"kv_connector_module_path": "kvbridge.integrations.vllm", "kv_role": ...,
"kv_connector_extra_config": {...}}'``; see docs/integrations.md.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from .layout import describe_vllm_caches, mamba_groups
from .metadata import KVBridgeMetadata
from .scheduler import SchedulerSide
from .settings import ConnectorSettings
from .worker import WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["KVBridgeConnector"]

log = logging.getLogger(__name__)


def _tp_rank(vllm_config: VllmConfig) -> int:
    """This worker's TP rank: from vLLM's process groups when they exist, else its configured rank."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_rank()
    pc = vllm_config.parallel_config
    return pc.rank % pc.tensor_parallel_size


class KVBridgeConnector(KVConnectorBase_V1, SupportsHMA):
    """Prefill/decode KV transfer through kvbridge: any registered backend, rooms in ``kv_transfer_params``."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        kt = self._kv_transfer_config
        pc = vllm_config.parallel_config
        self.settings = ConnectorSettings.from_extra_config(kt.kv_connector_extra_config, kt.kv_role,
                                                            dp_rank=pc.data_parallel_rank, dp_size=pc.data_parallel_size)
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerSide(vllm_config, kv_cache_config, self.settings.transfer.bootstrap,
                                        kt.engine_id or "")
        else:
            self._worker = WorkerSide(self.settings, producer=kt.is_kv_producer, consumer=kt.is_kv_consumer,
                                      tp_rank=_tp_rank(vllm_config),
                                      multi_group=len(kv_cache_config.kv_cache_groups) > 1)

    # -- scheduler side ----------------------------------------------------------------------
    @property
    def _s(self) -> SchedulerSide:
        if self._sched is None:
            raise RuntimeError("KVBridgeConnector: a scheduler-side method was called on a worker-side connector")
        return self._sched

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._s.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._s.update_state_after_alloc(request, blocks, num_external_tokens)

    def on_new_request(self, request: Request) -> None:
        self._s.on_new_request(request)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._s.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._s.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._s.request_finished(request, (block_ids,))

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self._s.request_finished(request, block_ids)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        # A load brings the request's own blocks of every transferred group (sliding windows included).
        return self._kv_cache_config.transfer_group_ids

    def has_pending_push_work(self) -> bool:
        # Prefill must keep stepping while finished requests wait for decode: sends start from get_finished.
        return self._sched is not None and self._sched.has_pending_push_work()

    # -- worker side -------------------------------------------------------------------------
    @property
    def _w(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("KVBridgeConnector: a worker-side method was called on the scheduler-side connector")
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        pc = self._vllm_config.parallel_config
        owners: dict[str, int] = {}
        kvargs = describe_vllm_caches(kv_caches, self._kv_cache_config,
                                      total_kv_heads=self._vllm_config.model_config.get_total_num_kv_heads(),
                                      tp_rank=self._w.tp_rank, tp_size=pc.tensor_parallel_size, owners=owners,
                                      mamba_n_groups=mamba_groups(self._vllm_config.model_config.hf_text_config))
        log.info("kvbridge: registering %d region(s) of %d block(s) over backend %r", len(kvargs.regions),
                 kvargs.index_spaces[0].count, self.settings.transfer.backend)
        self._w.register(kvargs, owners, next(iter(kv_caches.values()), None))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVBridgeMetadata)
        self._w.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Deliberately nothing: loads are asynchronous (get_num_new_matched_tokens says so), so vLLM runs a
        # request only after its whole room landed (WAITING_FOR_REMOTE_KVS); no forward reads a loading layer.
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        # Decode-first requests in their last prefill step: this layer goes out now (layerwise.py). Requests
        # of the default flow are sent after they finished, when decode asks: nothing to do per layer.
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVBridgeMetadata)
        self._w.begin_sends(meta)  # the step's sends start here: vLLM runs start_load_kv after the forward
        self._w.layerwise.saved_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        # The step's layer-wise chunks get any layer the forward did not report; the writes go on after this
        # returns (vLLM keeps the blocks until get_finished reports the request finished sending).
        self._w.layerwise.end_step(self._w.any_cache)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sent, recvd, failed = self._w.results(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=recvd, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sent, recvd, _ = self._w.results(finished_req_ids)
        return sent or None, recvd or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._w.take_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

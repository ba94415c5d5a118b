"""Two real vLLM schedulers and their workers' connector calls, on CPU, for KVBridgeConnector's tests.

What is real: vLLM 0.33's ``Scheduler`` (block allocation, WAITING_FOR_REMOTE_KVS,
load-failure policy), its config classes, its KV cache planning
(``get_kv_cache_configs``) and allocation (``allocate_kv_cache``: the views a
model runner registers), its connector factory (the connector is loaded from
``kv_connector_module_path``), and the worker-side sequence of its
``KVConnectorModelRunnerMixin`` (the real mixin, one rank at a time) with its
``KVOutputAggregator`` across TP ranks. What is not: the model. A step's
"forward" samples token 7 for every scheduled request and calls
``wait_for_layer_load`` / ``save_kv_layer`` per layer as attention layers do;
KV bytes are random, written by the test, not computed (``Server.on_layer`` writes a step's rows
per layer, as a forward would); a chunk that does not end the prompt samples nothing.
"""

from __future__ import annotations

import copy
import json
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import set_forward_context
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_planning
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, resolve_kv_cache_block_sizes
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin
from vllm.v1.worker.utils import allocate_kv_cache

BLOCK = 16
HEAD = 16
KV_HEADS = 4  # the model's total; TP 2 holds 2 per rank, TP 4 one
LAYERS = 4
WINDOW = 32  # the hybrid model's sliding window (layers 1 and 3)
# The Mamba hybrid's Mamba2 layers (1 and 3), sized by vLLM's own mamba2_state_shape: 4 heads of 16, one group,
# state 16, conv kernel 4 -> conv state (3 rows, x|B|C channels: 64/TP + 16 + 16, the one group on every rank),
# SSM state (heads/TP, 16, 16).
MAMBA_HEADS, MAMBA_HEAD_DIM, MAMBA_STATE, MAMBA_GROUPS, MAMBA_CONV = 4, 16, 16, 1, 4


def mamba_shapes(tp: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator

    return MambaStateShapeCalculator.mamba2_state_shape(
        tp_world_size=tp, intermediate_size=MAMBA_HEADS * MAMBA_HEAD_DIM, n_groups=MAMBA_GROUPS,
        num_heads=MAMBA_HEADS, head_dim=MAMBA_HEAD_DIM, state_size=MAMBA_STATE, conv_kernel=MAMBA_CONV)
EOS = 2
TOKEN = 7

# A Llama-shaped config.json (no model hub here); only the scheduler and the KV layout use it.
MODEL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": KV_HEADS * HEAD * 2,
         "intermediate_size": 128, "num_attention_heads": KV_HEADS * 2, "num_key_value_heads": KV_HEADS,
         "num_hidden_layers": LAYERS, "vocab_size": 1000, "max_position_embeddings": 1024,
         "torch_dtype": "float16", "rms_norm_eps": 1e-5, "eos_token_id": EOS,
         "n_groups": MAMBA_GROUPS}  # read only by the Mamba hybrid (a Mamba2 config's field)


def model_config(folder: Path, **overrides: Any) -> ModelConfig:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**MODEL, **overrides}))
    return ModelConfig(model=str(folder), dtype="float16", seed=0, skip_tokenizer_init=True, max_model_len=512)


def vllm_config(model: ModelConfig, role: str, extra: dict[str, Any], *, policy: str = "fail", tp: int = 1,
                hybrid: bool = False, layout: str = "LBNHC", mamba: bool = False) -> VllmConfig:
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512,
                            enable_chunked_prefill=True, is_encoder_decoder=False)
    # A Mamba hybrid without prefix caching: vLLM's "none" Mamba cache mode (one state block per request, Mamba
    # block size = max_model_len), as vLLM's HybridAttentionMambaModelConfig sets it up.
    cache = CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9, cache_dtype="auto",
                        enable_prefix_caching=not mamba)
    if mamba:
        cache.mamba_cache_mode = "none"
        cache.mamba_block_size = model.max_model_len
    cache.kv_cache_layout = layout
    kt = KVTransferConfig(kv_connector="KVBridgeConnector", kv_connector_module_path="kvbridge.integrations.vllm",
                          kv_role=role, kv_connector_extra_config=extra, kv_load_failure_policy=policy)
    cfg = VllmConfig(scheduler_config=sched, model_config=model, cache_config=cache, kv_transfer_config=kt,
                     device_config=DeviceConfig("cpu"))
    cfg.parallel_config.tensor_parallel_size = tp
    # vLLM turns its hybrid KV cache manager off on an unknown platform (this CPU machine); CUDA keeps it on.
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = not hybrid
    return cfg


def kv_cache_config(cfg: VllmConfig, tp: int, hybrid: bool, num_blocks: int, mla: bool = False,
                    mamba: bool = False) -> Any:
    """vLLM's own planning for this rank's layer specs (what the model runner would report).

    ``mamba``: layers 1 and 3 are Mamba2 layers (``MambaSpec`` as ``MambaBase.get_kv_cache_spec`` builds it,
    its page padded to the attention page as vLLM's platform config pads it).
    """
    specs: dict[str, Any] = {}
    for i in range(LAYERS):
        kw = dict(block_size=BLOCK, num_kv_heads=KV_HEADS // tp, head_size=HEAD, dtype=torch.float16)
        if mamba and i % 2:
            specs[layer_name(i)] = MambaSpec(block_size=cfg.model_config.max_model_len, shapes=mamba_shapes(tp),
                                             dtypes=(torch.float16, torch.float16),
                                             page_size_padded=2 * BLOCK * (KV_HEADS // tp) * HEAD * 2,
                                             mamba_type=MambaAttentionBackendEnum.MAMBA2)
            continue
        if mla:  # one latent of 2 * HEAD per token, the same on every TP rank
            specs[layer_name(i)] = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=2 * HEAD,
                                                    dtype=torch.float16)
            continue
        specs[layer_name(i)] = (SlidingWindowSpec(sliding_window=WINDOW, **kw) if hybrid and i % 2
                                else FullAttentionSpec(**kw))
    page = 2 * BLOCK * (KV_HEADS // tp) * HEAD * 2
    groups = kv_cache_planning.get_global_kv_cache_groups(cfg, [specs])
    per_group_layers = LAYERS // len(groups)
    memory = num_blocks * page * per_group_layers
    return kv_cache_planning.get_kv_cache_configs(cfg, [specs], [memory], groups)[0]


def layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


@dataclass
class Rank:
    """One worker: its connector and the KV cache views vLLM would register."""

    connector: Any
    caches: dict[str, torch.Tensor]
    cfg: VllmConfig

    def raw(self) -> torch.Tensor:
        """The backing allocation as bytes (every layer view shares it)."""
        any_view = next(iter(self.caches.values()))
        return torch.empty(0, dtype=torch.uint8).set_(any_view.untyped_storage())


@dataclass
class Server:
    """One vLLM engine: a real Scheduler and its TP workers' connectors."""

    sched: Scheduler
    ranks: list[Rank]
    cfg: VllmConfig
    aggregator: KVOutputAggregator = field(init=False)
    last_output: Any = None
    # The "model" of a step: called with (rank index, layer) just before that layer's save_kv_layer, as an
    # attention layer writes its KV before vLLM hands it to the connector; and with (rank, -1 - layer) just after.
    on_layer: Callable[[int, int], None] | None = None

    def __post_init__(self) -> None:
        self.aggregator = KVOutputAggregator(len(self.ranks))

    def step(self) -> dict[str, Any]:
        """schedule -> every rank runs the connector sequence around a fake forward -> update_from_output.

        Returns the EngineCoreOutputs of this step by request id.
        """
        so = self.sched.schedule()
        self.last_output = so
        scheduled = list(so.num_scheduled_tokens)
        # A request still short of its prompt's end (a chunked prefill's earlier chunks) samples nothing,
        # as vLLM's model runner discards those samples (num_computed_tokens was advanced by schedule()).
        sampled = [[TOKEN] if self.sched.requests[r].num_computed_tokens >= self.sched.requests[r].num_prompt_tokens
                   else [] for r in scheduled]
        outputs = []
        for rank in self.ranks:
            kv_transfer_state._KV_CONNECTOR_AGENT = rank.connector  # the process-wide agent, one rank at a time
            try:
                with set_forward_context(None, rank.cfg), \
                        KVConnectorModelRunnerMixin.maybe_get_kv_connector_output(so) as kv_out:
                    for i in range(LAYERS):  # what attention layers call during the forward
                        rank.connector.wait_for_layer_load(layer_name(i))
                        if self.on_layer is not None:
                            self.on_layer(self.ranks.index(rank), i)
                        rank.connector.save_kv_layer(layer_name(i), rank.caches[layer_name(i)], None)
                        if self.on_layer is not None:
                            self.on_layer(self.ranks.index(rank), -1 - i)
            finally:
                kv_transfer_state._KV_CONNECTOR_AGENT = None
            outputs.append(ModelRunnerOutput(
                req_ids=scheduled, req_id_to_index={r: i for i, r in enumerate(scheduled)},
                sampled_token_ids=sampled, kv_connector_output=kv_out))
        merged = self.aggregator.aggregate(outputs)
        result = self.sched.update_from_output(so, merged)
        return {o.request_id: o for outs in result.values() for o in outs.outputs}

    def close(self) -> None:
        for rank in self.ranks:
            rank.connector.shutdown()


def make_server(model: ModelConfig, role: str, extra: dict[str, Any], *, tp: int = 1, policy: str = "fail",
                hybrid: bool = False, num_blocks: int = 64, fill: bool = False, seed: int = 0,
                layout: str = "LBNHC", mla: bool = False, mamba: bool = False) -> Server:
    cfg = vllm_config(model, role, extra, policy=policy, tp=tp, hybrid=hybrid or mamba, layout=layout, mamba=mamba)
    kcc = kv_cache_config(cfg, tp, hybrid, num_blocks, mla, mamba)
    cfg.cache_config.num_gpu_blocks = kcc.num_blocks
    # The scheduler's block sizes as vLLM's engine core resolves them (the LCM of the groups' with Mamba groups).
    sched_block, hash_block = resolve_kv_cache_block_sizes(kcc, cfg) if mamba else (BLOCK, BLOCK)
    sched = Scheduler(vllm_config=cfg, kv_cache_config=kcc, structured_output_manager=StructuredOutputManager(cfg),
                      block_size=sched_block, hash_block_size=hash_block, log_stats=True)
    ranks = []
    gen = torch.Generator().manual_seed(seed)
    for r in range(tp):
        rank_cfg = copy.copy(cfg)
        rank_cfg.parallel_config = copy.copy(cfg.parallel_config)
        rank_cfg.parallel_config.rank = r
        conn = KVConnectorFactory.create_connector(rank_cfg, KVConnectorRole.WORKER, kcc)
        caches = allocate_kv_cache(kcc, torch.device("cpu"), cfg.cache_config.get_resolved_kv_cache_layout())
        rank = Rank(conn, caches, rank_cfg)
        if fill:
            raw = rank.raw()
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
        ranks.append(rank)
    for rank in ranks:  # after every rank exists: prefill rank 0 serves the bootstrap others register with
        rank.connector.register_kv_caches(rank.caches)
    return Server(sched, ranks, cfg)


_hash_ready = False


def make_request(req_id: str, prompt: list[int], max_tokens: int, params: dict[str, Any] | None) -> Request:
    global _hash_ready
    if not _hash_ready:
        init_none_hash(sha256)
        _hash_ready = True
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sp.update_from_generation_config({}, EOS)
    req = Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=sp, pooling_params=None,
                  mm_features=None, block_hasher=get_request_block_hasher(BLOCK, sha256))
    req.kv_transfer_params = params
    return req


def step_until(servers: Iterable[Server], done: Any, timeout: float = 30.0) -> None:
    """Step every server in turn until ``done()`` holds (bounded)."""
    servers = list(servers)
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"not done within {timeout}s")
        for s in servers:
            s.step()
        time.sleep(0.002)


def block_ids(sched: Scheduler, req_id: str) -> tuple[list[int], ...]:
    return tuple(list(g) for g in sched.kv_cache_manager.get_block_ids(req_id))


def status(sched: Scheduler, req_id: str) -> RequestStatus | None:
    req = sched.requests.get(req_id)
    return None if req is None else req.status


def prefill_request(prefill: Server, req_id: str, prompt: list[int]) -> dict:
    """Run a do_remote_decode request to completion on prefill; its kv_transfer_params."""
    prefill.sched.add_request(make_request(req_id, prompt, 1, {"do_remote_decode": True}))
    finished: dict = {}

    def done() -> bool:
        finished.update({k: v for k, v in prefill.step().items() if v.finished})
        return req_id in finished

    step_until([], done)
    params = finished[req_id].kv_transfer_params
    assert params and params["do_remote_prefill"] and isinstance(params["kvbridge_room"], int), params
    return params


def check_bytes(prefill: Server, decode: Server, src: list[list[int]], dst: list[list[int]], positions: range) -> None:
    """Oracle: for every token position, layer and KV head, decode's page row equals prefill's (heads mapped by TP)."""
    hp, hd = KV_HEADS // len(prefill.ranks), KV_HEADS // len(decode.ranks)
    if prefill.ranks[0].caches[layer_name(0)].shape[1] == 1 == decode.ranks[0].caches[layer_name(0)].shape[1]:
        heads = {rd: [(0, 0, 0)] for rd in range(len(decode.ranks))}  # MLA: (local head, prefill rank, its head)
    else:
        heads = {rd: [(j, (rd * hd + j) // hp, (rd * hd + j) % hp) for j in range(hd)] for rd in range(len(decode.ranks))}
    for layer in range(LAYERS):
        group = 1 if len(src) > 1 and layer % 2 else 0
        for pos in positions:
            s_block, d_block, row = src[group][pos // BLOCK], dst[group][pos // BLOCK], pos % BLOCK
            for rd, drank in enumerate(decode.ranks):
                for j, rp, hp_local in heads[rd]:
                    want = prefill.ranks[rp].caches[layer_name(layer)][s_block, hp_local, row]
                    got = drank.caches[layer_name(layer)][d_block, j, row]
                    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (layer, pos, rd, j)


def hand_over(prefill: Server, decode: Server, req_id: str, prompt_len: int, hybrid: bool = False,
              prompt: list[int] | None = None) -> None:
    """One P/D request end to end, checked at every step a router and vLLM's schedulers go through."""
    prompt = prompt or [random.randrange(10, 900) for _ in range(prompt_len)]
    prompt_len = len(prompt)
    free_before = prefill.sched.kv_cache_manager.block_pool.get_num_free_blocks()
    params = prefill_request(prefill, req_id, prompt)
    src = block_ids(prefill.sched, req_id)
    assert status(prefill.sched, req_id) == RequestStatus.FINISHED_LENGTH_CAPPED  # finished, blocks still held
    assert prefill.sched.kv_cache_manager.block_pool.get_num_free_blocks() < free_before

    decode.sched.add_request(make_request(req_id, prompt, 4, params))
    decode.step()
    assert status(decode.sched, req_id) == RequestStatus.WAITING_FOR_REMOTE_KVS
    dst = block_ids(decode.sched, req_id)
    assert prefill.sched.kv_cache_manager.block_pool.get_num_free_blocks() < free_before  # not before the transfer

    step_until([prefill, decode], lambda: status(decode.sched, req_id) == RequestStatus.RUNNING)
    # Loaded every prompt token but the last, which decode recomputes to sample the next one.
    assert decode.last_output.num_scheduled_tokens[req_id] == 1
    assert decode.sched.requests[req_id].num_computed_tokens == prompt_len
    window = range(prompt_len - WINDOW, prompt_len) if hybrid else range(prompt_len)
    check_bytes(prefill, decode, list(src), list(dst), window if hybrid else range(prompt_len))
    if hybrid:  # the full-attention layers got every position
        check_bytes(prefill, decode, [src[0], src[0]], [dst[0], dst[0]], range(prompt_len))
    step_until([prefill], lambda: req_id not in prefill.sched.requests)  # freed once sent
    assert prefill.sched.kv_cache_manager.block_pool.get_num_free_blocks() == free_before
    step_until([decode], lambda: req_id not in decode.sched.requests)  # decode runs it to the end


class Seen:
    """Everything decode's workers reported through vLLM's KVConnectorOutput, across steps."""

    def __init__(self, server) -> None:
        self.invalid: set[int] = set()
        self.finished: dict = {}
        step = server.step

        def recording_step():
            outs = step()
            self.finished.update({k: v for k, v in outs.items() if v.finished})
            return outs

        server.step = recording_step
        original = server.aggregator.aggregate

        def aggregate(outputs, output_rank=0):
            merged = original(outputs, output_rank)
            if merged is not None and merged.kv_connector_output is not None:
                self.invalid |= set(merged.kv_connector_output.invalid_block_ids or ())
            return merged

        server.aggregator.aggregate = aggregate

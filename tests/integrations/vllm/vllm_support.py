"""Shared set-up of the vLLM integration tests: the import guard, configs, requests, steps.

The tests run against the real vLLM wheel on CPU (``make test-vllm`` builds its environment).
Where vLLM is not importable they skip, unless ``MMKEY_REQUIRE_VLLM=1`` (CI) makes that a
failure.

What is vLLM's own here: `VllmConfig`/`ECTransferConfig`, `ECConnectorFactory` (which imports
``mmkey.integrations.vllm`` by module path), `Request` and `MultiModalFeatureSpec`,
`SchedulerOutput`, and on the worker side vLLM's model-runner glue
(`ECConnectorModelRunnerMixin` with the process-wide connector from
``ensure_ec_transfer_initialized``). Stand-ins: vLLM's `Scheduler` (it needs a model and KV
cache config) is replaced by `schedule`, which calls the connector in the order the real
scheduler does; the encoder is replaced by the tensors a test passes in.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pytest

from tests._support import ROOMY_TIMEOUT, require_stack, wait_until

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # vLLM cannot infer a device without one
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded

if TYPE_CHECKING:
    import torch
    from vllm.config import ECRole, VllmConfig
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

    from mmkey.integrations.vllm import MMKeyECConnector, MMKeyECMetadata
    from mmkey.testing.mooncake_master import MasterProcess

REQUIRE_ENV = "MMKEY_REQUIRE_VLLM"
TIMEOUT = 0.4
"""The short deadline of the tests that fault the master (hung, dead, slow)."""
BOUND = TIMEOUT + 2.5
"""A call may overrun its deadline by scheduling noise on a loaded machine, never by a hang."""


def require_vllm() -> None:
    """Skip the calling test module when vLLM does not import (fail under MMKEY_REQUIRE_VLLM=1)."""
    require_stack(
        "vllm.distributed.ec_transfer.ec_connector.base",
        stack="vLLM",
        require_env=REQUIRE_ENV,
        make_target="test-vllm",
    )


def mooncake_extra(master: MasterProcess, **overrides: Any) -> dict[str, Any]:
    """``ec_connector_extra_config['mooncake']`` for a test master: small, a roomy deadline
    (tests that fault the master pass ``timeout=TIMEOUT``)."""
    fields: dict[str, Any] = {
        "master_server_address": master.address,
        "global_segment_size": "96MB",
        "local_buffer_size": "32MB",
        "timeout": ROOMY_TIMEOUT,
        "setup_timeout": 5.0,
        "retry_after": 0.2,
    }
    fields.update(overrides)
    return fields


def vllm_config(role: ECRole, **extra: Any) -> VllmConfig:
    """A real model-less `VllmConfig` whose EC connector is mmkey's, loaded by module path.

    ``first_answer_wait_s`` is 0 unless given: a first look defers its request, whatever the
    host's speed, so that a test sees each step as it sets it up (its own tests set it).
    ``save_hold_s`` is 0 unless given: a save starts at once, as the tests of saves expect
    (its own tests set it)."""
    from vllm.config import ECTransferConfig, VllmConfig

    extra.setdefault("first_answer_wait_s", 0.0)
    extra.setdefault("save_hold_s", 0.0)

    return VllmConfig(
        ec_transfer_config=ECTransferConfig(
            ec_connector="MMKeyECConnector",
            ec_connector_module_path="mmkey.integrations.vllm",
            ec_role=role,
            ec_connector_extra_config=dict(extra),
        )
    )


def producer_only_config(**extra: Any) -> VllmConfig:
    """A `VllmConfig` whose EC role is ``ec_producer``.

    vLLM refuses ``ec_producer`` without a multimodal model, which its CPU install cannot
    build; the config is built as ``ec_both`` and then given the producer's transfer config
    (the stand-in: vLLM's model check is skipped, nothing else).
    """
    from vllm.config import ECTransferConfig

    extra.setdefault("first_answer_wait_s", 0.0)
    extra.setdefault("save_hold_s", 0.0)
    config = vllm_config("ec_both", **extra)
    config.ec_transfer_config = ECTransferConfig(
        ec_connector="MMKeyECConnector",
        ec_connector_module_path="mmkey.integrations.vllm",
        ec_role="ec_producer",
        ec_connector_extra_config=dict(extra),
    )
    return config


@contextlib.contextmanager
def connector(config: VllmConfig, role: str) -> Iterator[MMKeyECConnector]:
    """One side ("scheduler" or "worker") made by vLLM's `ECConnectorFactory`; shut down after."""
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    from mmkey.integrations.vllm import MMKeyECConnector

    made = ECConnectorFactory.create_connector(config, ECConnectorRole[role.upper()])
    assert isinstance(made, MMKeyECConnector)
    try:
        yield made
    finally:
        made.shutdown()


@contextlib.contextmanager
def vllm_worker_agent(config: VllmConfig) -> Iterator[MMKeyECConnector]:
    """The process-wide worker connector, made and shut down by vLLM's own functions."""
    from vllm.distributed.ec_transfer import (
        ensure_ec_transfer_initialized,
        ensure_ec_transfer_shutdown,
        get_ec_transfer,
    )

    from mmkey.integrations.vllm import MMKeyECConnector

    ensure_ec_transfer_initialized(config)
    try:
        agent = get_ec_transfer()
        assert isinstance(agent, MMKeyECConnector)
        yield agent
    finally:
        ensure_ec_transfer_shutdown()


def request(
    request_id: str,
    items: Sequence[tuple[str, str, int]],
    *,
    data: Mapping[str, torch.Tensor] | None = None,
    ec_transfer_params: object = None,
    cache_salt: str | None = None,
    lora_name: str | None = None,
) -> Request:
    """A vLLM `Request` whose features are (identifier, modality, embeddings) in prompt order.

    `data`: processed inputs by identifier (vLLM's `MultiModalKwargsItem` of one field,
    ``pixel_values``), as a scheduler sees them; without, the features carry no data.
    `cache_salt` and `lora_name` are vLLM's own request fields (a tenant's salt, an adapter).
    """
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import (
        MultiModalFeatureSpec,
        MultiModalFieldElem,
        MultiModalKwargsItem,
        MultiModalSharedField,
        PlaceholderRange,
    )
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    def item(identifier: str) -> Any:
        if data is None or identifier not in data:
            return None
        elem = MultiModalFieldElem(data=data[identifier], field=MultiModalSharedField(batch_size=1))
        return MultiModalKwargsItem({"pixel_values": elem})

    features = []
    offset = 1
    for identifier, modality, length in items:
        features.append(
            MultiModalFeatureSpec(
                data=item(identifier),
                modality=modality,
                identifier=identifier,
                mm_position=PlaceholderRange(offset=offset, length=length),
            )
        )
        offset += length + 1
    lora = None if lora_name is None else LoRARequest(lora_name, 1, "/nonexistent")
    made = Request(
        request_id,
        [0] * (offset + 1),
        SamplingParams(max_tokens=1),
        None,
        mm_features=features,
        lora_request=lora,
        cache_salt=cache_salt,
    )
    made.ec_transfer_params = ec_transfer_params  # type: ignore[assignment]  # what a client may send
    return made


def until_available(scheduler: MMKeyECConnector, req: Request, num_computed_tokens: int = 0) -> int:
    """Call `ensure_cache_available` as vLLM does, once a step, until it says yes; the number
    of calls that deferred the request (bounded: a hang fails the test)."""
    deferred = 0

    def available() -> bool:
        nonlocal deferred
        if scheduler.ensure_cache_available(req, num_computed_tokens):
            return True
        deferred += 1
        return False

    assert wait_until(available, BOUND + 10.0, poll=0.002), (
        "ensure_cache_available deferred the request without end"
    )
    return deferred


def schedule(scheduler: MMKeyECConnector, requests: Sequence[Request]) -> tuple[MMKeyECMetadata, list[str]]:
    """Stand-in for one `Scheduler.schedule()`: the connector calls in vLLM's order.

    Per request `ensure_cache_available` (again, as vLLM does on later steps, until it says
    yes), then per item `has_cache_item` and, for hits and items to encode alike,
    `update_state_after_alloc`; finally `build_connector_meta`, and each request finishes.
    Returns the metadata and the identifiers the connector claimed.
    """
    from vllm.v1.core.sched.output import SchedulerOutput

    from mmkey.integrations.vllm import MMKeyECMetadata

    hits: list[str] = []
    for req in requests:
        until_available(scheduler, req)
        for index, feature in enumerate(req.mm_features):
            if scheduler.has_cache_item(feature.identifier):
                hits.append(feature.identifier)
            scheduler.update_state_after_alloc(req, index)
    meta = scheduler.build_connector_meta(SchedulerOutput.make_empty())
    assert isinstance(meta, MMKeyECMetadata)
    for req in requests:  # one-step requests: each finishes after its step
        scheduler.request_finished(req)
    return meta, hits


def produce(worker: MMKeyECConnector, meta: MMKeyECMetadata, outputs: Mapping[str, torch.Tensor]) -> None:
    """Stand-in for a producer's model-runner step: the encoder outputs `outputs`, each saved."""
    encoder_cache: dict[str, torch.Tensor] = {}
    worker.bind_connector_metadata(meta)
    try:
        for identifier, tensor in outputs.items():
            encoder_cache[identifier] = tensor
            worker.save_caches(encoder_cache=encoder_cache, mm_hash=identifier)
    finally:
        worker.get_finished(set())
        worker.build_connector_worker_meta()
        worker.clear_connector_metadata()


def consume(meta: MMKeyECMetadata, encoder_cache: dict[str, torch.Tensor]) -> ECConnectorOutput:
    """One consumer step through vLLM's own model-runner glue; returns its `ECConnectorOutput`."""
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.worker.ec_connector_model_runner_mixin import ECConnectorModelRunnerMixin

    scheduler_output = SchedulerOutput.make_empty()
    scheduler_output.ec_connector_metadata = meta
    with ECConnectorModelRunnerMixin.maybe_get_ec_connector_output(
        scheduler_output, encoder_cache=encoder_cache
    ) as output:
        pass  # the model would run here: vLLM gathers encoder outputs from encoder_cache
    assert output is not None
    return output


class StepClock:
    """A monotonic clock that moves only when the test says (``clock.now += seconds``)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def install_step_clock(monkeypatch: pytest.MonkeyPatch) -> StepClock:
    """A `StepClock` that times every wait of the connectors built afterwards (until undone)."""
    import mmkey.integrations.vllm._connector as connector_module

    made = StepClock()
    monkeypatch.setattr(connector_module, "_clock", made, raising=False)
    return made

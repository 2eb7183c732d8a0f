class SchedulerOutput:
    scheduled_encoder_inputs: dict[str, list[int]]
    finished_req_ids: set[str]
    free_encoder_mm_hashes: list[str]
    ec_connector_metadata: object | None
    @classmethod
    def make_empty(cls) -> SchedulerOutput: ...
